"""`floe prime-trainer @ rl.toml`: prime-rl's trainer, training through the floe client.

The loop follows prime-rl's own trainer (src/prime_rl/trainer/rl/train.py at PRIME_RL_COMMIT):
publish the startup policy as step 0; then for step = 1 .. max_steps: wait for every rank's
`rollouts/step_{step}/rank_{r}.bin`, train on them (one `forward_backward` over the whole step,
then `optim_step(lr=...)` at prime-rl's scheduled rate), `sync_weights(version = v0 + step)` so the sampler serves the new policy,
and publish `broadcasts/step_{step}/` (floe.json, then STABLE). The orchestrator's watcher sees
STABLE and calls `/update_weights` on `floe serve`, which checks that the sampler serves that
version. The trainer must talk to the same `floe serve` the orchestrator samples from.

Before anything is published, the server's optimizer is checked against `trainer.optim`
(optim.check_server_optimizer) and prime-rl's scheduler is built at the server's optimizer step
(schedule.PrimeRlSchedule): every step's rate is prime-rl's, also after a restored state.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from floe.errors import InvalidInput, StateError
from floe.integrations.prime_rl.batch import to_floe_batch
from floe.integrations.prime_rl.config import PrimeTrainerConfig
from floe.integrations.prime_rl.formats import BroadcastMarker, publish, read_micro_batches, rollout_path
from floe.integrations.prime_rl.optim import check_server_optimizer
from floe.integrations.prime_rl.schedule import PrimeRlSchedule


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


def wait_for(paths: list[Path], poll_s: float, timeout_s: float | None) -> None:
    """Block until every path exists; StateError naming the first missing one after timeout_s."""
    start = time.monotonic()
    while True:
        missing = [p for p in paths if not p.exists()]
        if not missing:
            return
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise StateError(f"waited {timeout_s:g} s for {missing[0]}; is the orchestrator running with "
                             f"output_dir/run.name pointing at {missing[0].parents[2]}?")
        time.sleep(poll_s)


def run(cfg: PrimeTrainerConfig, client: Any, log: Any = print) -> list[StepReport]:
    """Train cfg.max_steps steps from the run directory through `client`; see the module doc."""
    info = client.info()
    check_server_optimizer(cfg.optim, info.capabilities.get("optimizer"))
    schedule = PrimeRlSchedule(cfg.optim, cfg.scheduler, cfg.max_steps, steps=info.step)
    log(f"prime-trainer: lr schedule {schedule.describe()}")
    if cfg.ignored_trainer_keys:
        log(f"prime-trainer: not applied (prime-rl's own trainer internals): {', '.join(cfg.ignored_trainer_keys)}")
    run_dir = cfg.run_dir
    v0 = client.sync_weights().version  # the startup broadcast: sampler = policy, as prime-rl's step 0
    publish(run_dir, BroadcastMarker(step=0, weights_version=v0, policy_step=info.step, model=info.model))
    log(f"prime-trainer: published step 0 (weights version {v0}) in {run_dir / 'broadcasts'}")
    reports: list[StepReport] = []
    version = v0
    for step in range(1, cfg.max_steps + 1):
        paths = [rollout_path(run_dir, step, r) for r in range(cfg.ranks)]
        wait_for(paths, cfg.poll_s, cfg.wait_timeout_s)
        micro_batches = [mb for p in paths for mb in read_micro_batches(p)]
        step_batch = to_floe_batch(micro_batches, cfg.loss)
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
        report = StepReport(step, loss, step_batch.rl_scale, step_batch.samples, grad_norm, lr, schedule.lr, version,
                            str(out), metrics)
        reports.append(report)
        log(f"prime-trainer: step {step} | loss {loss:.6f} | samples {step_batch.samples} | "
            f"tokens {step_batch.rl_scale} | grad_norm {grad_norm} | lr {lr} | weights version {version}"
            + (f" | kl(sampler||policy) {metrics['kl_sampler_k3']:.2e}" if "kl_sampler_k3" in metrics else ""))
        with open(run_dir / "floe_trainer.jsonl", "a") as f:
            f.write(json.dumps(report.__dict__) + "\n")
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
