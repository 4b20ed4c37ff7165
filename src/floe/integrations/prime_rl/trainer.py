"""`floe prime-trainer @ rl.toml`: prime-rl's trainer, training through the floe client.

The loop follows prime-rl's own trainer (src/prime_rl/trainer/rl/train.py at PRIME_RL_COMMIT):
publish the startup policy as step 0 (or, with `resume`, load the checkpoint's floe state and
publish it as step N: checkpoint.py); then for each step up to max_steps: receive every rank's
micro-batches of the step over the run's `rollout_transport` (transport.py: zmq or files), train
on them (one `forward_backward` over the whole step, then `optim_step(lr=...)` at prime-rl's
scheduled rate), `sync_weights(version = v0 + step)` so the sampler serves the new policy, publish
`broadcasts/step_{step}/` (floe.json, then STABLE) and, at prime-rl's checkpoint steps, save the
state (checkpoint.save). The orchestrator's watcher sees STABLE and calls `/update_weights` on
`floe serve`, which checks that the sampler serves that version. The trainer must talk to the
same `floe serve` the orchestrator samples from.

Before anything is published, the server's optimizer is checked against `trainer.optim`
(optim.check_server_optimizer) and prime-rl's scheduler is built at the server's optimizer step
(schedule.PrimeRlSchedule): every step's rate is prime-rl's, also after a restored state.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from floe.errors import InvalidInput
from floe.integrations.prime_rl.batch import to_floe_batch
from floe.integrations.prime_rl.checkpoint import checkpoints_dir, clean, read_checkpoint, resume_step, save, saved_steps
from floe.integrations.prime_rl.config import PrimeTrainerConfig
from floe.integrations.prime_rl.formats import BroadcastMarker, publish, unpublish
from floe.integrations.prime_rl.lora import check_server_lora
from floe.integrations.prime_rl.optim import check_server_optimizer
from floe.integrations.prime_rl.schedule import PrimeRlSchedule
from floe.integrations.prime_rl.transport import open_receiver


@dataclass
class StepReport:
    """One trained step: prime-rl's step number, floe's loss metrics and the published version."""

    step: int
    loss: float
    rl_scale: int
    samples: int
    grad_norm: float | None
    lr: float | None  # the rate this step's optimizer step ran at (prime-rl's schedule)
    next_lr: float  # the schedule's rate after this step (what prime-rl logs as optim/lr)
    weights_version: int
    broadcast: str
    metrics: dict[str, float] = field(default_factory=dict)  # forward_backward's (ratio_*, kl_sampler_k3, ...)


def run(cfg: PrimeTrainerConfig, client: Any, log: Any = print) -> list[StepReport]:
    """Train cfg.max_steps steps from the run directory through `client`; see the module doc."""
    run_dir = cfg.run_dir
    ckpt_root = checkpoints_dir(run_dir, cfg.ckpt)
    start = 1
    if cfg.resume is not None:  # load before anything is published: step N's broadcast is the restored policy
        step = resume_step(cfg.resume, ckpt_root)
        unpublish(run_dir, step)
        restored = read_checkpoint(cfg.resume.dir if cfg.resume.dir is not None else ckpt_root / f"step_{step}")
        loaded = client.load_state(restored.state)
        log(f"prime-trainer: resumed step {step} from floe state {loaded.name!r} (optimizer step {loaded.step}, "
            f"weights version {loaded.version})")
        start = step + 1
    info = client.info()
    check_server_optimizer(cfg.optim, info.capabilities.get("optimizer"))
    check_server_lora(cfg.lora, info.capabilities.get("lora"))
    if cfg.lora is not None:
        log(f"prime-trainer: the server trains a LoRA adapter (rank {cfg.lora.rank}, alpha {cfg.lora.alpha}); "
            "the sampler serves the merged weights")
    schedule = PrimeRlSchedule(cfg.optim, cfg.scheduler, cfg.max_steps, steps=info.step)
    log(f"prime-trainer: lr schedule {schedule.describe()}")
    if cfg.ignored_trainer_keys:
        log(f"prime-trainer: not applied (prime-rl's own trainer internals): {', '.join(cfg.ignored_trainer_keys)}")
    # the startup broadcast, as prime-rl's trainer does (v0, or the resumed step's policy): sampler = policy
    version = client.sync_weights().version if start == 1 else info.sampler_version
    v0 = version - (start - 1)  # step s publishes version v0 + s
    publish(run_dir, BroadcastMarker(step=start - 1, weights_version=version, policy_step=info.step, model=info.model))
    log(f"prime-trainer: published step {start - 1} (weights version {version}) in {run_dir / 'broadcasts'}")
    receiver = open_receiver(cfg.transport, run_dir, cfg.ranks, cfg.poll_s, cfg.wait_timeout_s)
    saved = [s for s in saved_steps(ckpt_root) if s < start]  # prime-rl's ckpt_steps: on disk, up to the resume step
    reports: list[StepReport] = []
    try:
        for step in range(start, cfg.max_steps + 1):
            step_batch = to_floe_batch(receiver.receive(step), cfg.loss)
            grad_norm = lr = None
            loss = 0.0
            metrics: dict[str, float] = {}
            if step_batch.batch.groups:
                fb = client.forward_backward(step_batch.batch, loss=cfg.loss.name, loss_config=cfg.loss.config)
                loss = float(fb.metrics["loss"])
                metrics = {k: float(v) for k, v in fb.metrics.items() if isinstance(v, (int, float))}
                opt = client.optim_step(lr=schedule.lr)
                grad_norm, lr = opt.grad_norm, opt.lr
                schedule.advance_to(opt.step)
                version = client.sync_weights(version=v0 + step).version
            policy_step = client.info().step
            out = publish(run_dir, BroadcastMarker(step=step, weights_version=version, policy_step=policy_step,
                                                   model=info.model))
            report = StepReport(step, loss, step_batch.rl_scale, step_batch.samples, grad_norm, lr, schedule.lr,
                                version, str(out), metrics)
            reports.append(report)
            log(f"prime-trainer: step {step} | loss {loss:.6f} | samples {step_batch.samples} | "
                f"tokens {step_batch.rl_scale} | grad_norm {grad_norm} | lr {lr} | weights version {version}"
                + (f" | kl(sampler||policy) {metrics['kl_sampler_k3']:.2e}" if "kl_sampler_k3" in metrics else ""))
            with open(run_dir / "floe_trainer.jsonl", "a") as f:
                f.write(json.dumps(report.__dict__) + "\n")
            # prime-rl's checkpoint steps: every `interval`, and the last step (its final checkpoint)
            if cfg.ckpt is not None and (step == cfg.max_steps or (cfg.ckpt.interval and step % cfg.ckpt.interval == 0)):
                ckpt = save(client, ckpt_root, run_dir, step, version, info.model)
                saved.append(step)
                deleted = clean(client, ckpt_root, cfg.ckpt, saved)
                saved = [s for s in saved if s not in deleted]
                log(f"prime-trainer: checkpoint step {step} (floe state {ckpt.state!r})"
                    + (f"; deleted steps {', '.join(map(str, deleted))}" if deleted else ""))
    finally:
        receiver.close()
    return reports


def main(argv: list[str]) -> int:
    """`floe prime-trainer RL.toml [@ OVERLAY.toml ...] [--a.b VALUE ...]` (prime-rl's `@` layering;
    `--a.b-c` flags as prime-rl's CLI spells them). Returns the exit status."""
    from floe.config import load_layers, split_recipe_args  # noqa: PLC0415
    from floe.integrations.prime_rl.config import parse_config  # noqa: PLC0415

    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\nusage: floe prime-trainer @ rl.toml [@ overlay.toml ...] [--section.key VALUE ...]\n"
              "see docs/integrations.md (prime-rl) and recipes/prime_rl/floe.toml")
        return 0
    files, overrides, rest = split_recipe_args(argv)
    if rest:
        raise InvalidInput("arguments", f"unexpected {rest[0]!r}; give @ FILE.toml layers and --section.key VALUE flags")
    if not files:
        raise InvalidInput("RL.toml", "give prime-rl's config, e.g. floe prime-trainer @ rl.toml @ recipes/prime_rl/floe.toml")
    overrides = {k.replace("-", "_"): v for k, v in overrides.items()}
    cfg = parse_config(load_layers(files, overrides))
    import floe  # noqa: PLC0415 - the client stack

    client = floe.connect(cfg.url, token=os.environ.get(cfg.token_env))
    try:
        run(cfg, client, log=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        client.close()
    return 0
