"""What `floe prime-trainer` reads from prime-rl's `@ rl.toml` layers.

The same files configure prime-rl's orchestrator and inference server, so only these keys are
read here; the `[floe]` table (the overlay, recipes/prime_rl/floe.toml) adds floe's own:

  output_dir, run.name / run.dir      the run directory: <output_dir>/<run.dir or run.name>
                                      ([floe] run_dir replaces it)
  max_steps, trainer.max_steps        steps to train (the trainer's own wins)
  trainer.loss                        mapped by loss_mapping.map_loss, or refused
  rollout_transport, trainer.rollout_transport   transport.parse_transport: "zmq" (prime-rl's default:
                                      host, port, hwm) or "filesystem"
  weight_broadcast, trainer.weight_broadcast     must be type "filesystem" (the default)
  trainer.model.lora                  lora.parse_lora: the adapter floe's backend trains (rank, alpha,
                                      target_modules); checked against a running server's
  ckpt, trainer.ckpt                  checkpoint.CkptConfig: interval, keep_last, keep_interval, output_dir
                                      (trainer.ckpt's keys over the shared ones); skip_* refused when true
  resume, trainer.resume              checkpoint.ResumeConfig: step or dir
  trainer.optim                       optim.parse_optim: lr sets the schedule's peak; betas1/2,
                                      weight_decay, max_norm are checked against the server's
                                      optimizer at start (optim.check_server_optimizer)
  trainer.scheduler                   optim.parse_scheduler: run by prime-rl's own scheduler
                                      (schedule.PrimeRlSchedule), each step's rate passed to optim_step

  [floe] url ("http://127.0.0.1:7000"), token_env ("FLOE_TOKEN"), ranks (1: rank files per
  step, the orchestrator's num_train_workers), poll_s (0.2), wait_timeout_s (None = forever),
  run_dir, loss ({name, config}: a floe loss instead of trainer.loss);
  `floe prime-rl` (launch.py) also reads backend (a [backend] table for the floe serve it starts)
  and ready_timeout_s (300: how long it waits for that server)

Every other `[trainer]` key tunes prime-rl's own torch trainer (compile, FSDP, activation
checkpointing, ...); `ignored_trainer_keys` lists them and the trainer prints them at start
(`floe prime-rl` maps trainer.model.ac and optimization_dtype onto the floe serve it starts:
hardware.prime_hardware, and drops them from that list).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from floe.config import LoraConfig
from floe.errors import InvalidInput
from floe.integrations.prime_rl.checkpoint import CkptConfig, ResumeConfig
from floe.integrations.prime_rl.lora import parse_lora
from floe.integrations.prime_rl.loss_mapping import MappedLoss, map_loss, native_loss
from floe.integrations.prime_rl.optim import PrimeOptim, PrimeScheduler, parse_optim, parse_scheduler
from floe.integrations.prime_rl.transport import FileSystemTransport, ZmqTransport, parse_transport

FLOE_KEYS = {"url", "token_env", "ranks", "poll_s", "wait_timeout_s", "run_dir", "loss", "backend", "ready_timeout_s"}
LAUNCH_KEYS = {"backend", "ready_timeout_s"}  # read by `floe prime-rl` (launch.py), not by the trainer
READ_TRAINER_KEYS = {"loss", "max_steps", "rollout_transport", "weight_broadcast", "model", "output_dir", "optim",
                     "scheduler", "ckpt", "resume"}
CKPT_KEYS = {"interval", "keep_last", "keep_interval", "output_dir"}
# trainer.ckpt keys that change what a resume restores: floe's states restore weights, optimizer and
# step together, and prime-rl's scheduler position follows the restored optimizer step.
CKPT_SKIPS = {"skip_progress", "skip_scheduler", "skip_optimizer", "skip_dataloader"}


@dataclass
class PrimeTrainerConfig:
    run_dir: Path
    max_steps: int
    loss: MappedLoss
    transport: FileSystemTransport | ZmqTransport = field(default_factory=ZmqTransport)
    ckpt: CkptConfig | None = None  # None: no checkpoints saved
    resume: ResumeConfig | None = None
    optim: PrimeOptim = field(default_factory=PrimeOptim)
    scheduler: PrimeScheduler = field(default_factory=PrimeScheduler)
    lora: LoraConfig | None = None  # trainer.model.lora: the adapter the backend trains; None = every weight
    url: str = "http://127.0.0.1:7000"
    token_env: str = "FLOE_TOKEN"
    ranks: int = 1
    poll_s: float = 0.2
    wait_timeout_s: float | None = None
    ignored_trainer_keys: list[str] = field(default_factory=list)


def _type_of(data: dict[str, Any], key: str) -> tuple[str, Any]:
    trainer = data.get("trainer", {})
    if isinstance(trainer.get(key), dict) and "type" in trainer[key]:
        return f"trainer.{key}.type", trainer[key]["type"]
    if isinstance(data.get(key), dict) and "type" in data[key]:
        return f"{key}.type", data[key]["type"]
    return f"{key}.type", None


def _int(value: Any, field_name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInput(field_name, f"must be an integer >= {minimum}, got {value!r}")
    return value


def parse_config(data: dict[str, Any]) -> PrimeTrainerConfig:
    """The trainer's settings from merged rl.toml layers; InvalidInput naming the first bad key."""
    floe = dict(data.get("floe") or {})
    for key in floe:
        if key not in FLOE_KEYS:
            raise InvalidInput(f"floe.{key}", f"unknown key; [floe] keys: {', '.join(sorted(FLOE_KEYS))}")
    trainer = data.get("trainer") or {}
    if not isinstance(trainer, dict):
        raise InvalidInput("trainer", "must be a table")

    if "run_dir" in floe:
        run_dir = Path(floe["run_dir"])
    else:
        run = data.get("run") or {}
        name = run.get("dir") or run.get("name")
        if not name:
            raise InvalidInput("run.name", "set the run's name (prime-rl otherwise makes one up with a random "
                               "suffix the trainer cannot know), or [floe] run_dir")
        run_dir = Path(data.get("output_dir", "outputs")) / str(name)

    steps = trainer.get("max_steps", data.get("max_steps"))
    if steps is None:
        raise InvalidInput("max_steps", "set max_steps (or trainer.max_steps): how many steps to train")
    max_steps = _int(steps, "trainer.max_steps" if "max_steps" in trainer else "max_steps", 1)

    if isinstance(trainer.get("rollout_transport"), dict):
        transport = parse_transport(trainer["rollout_transport"], "trainer.rollout_transport")
    else:
        transport = parse_transport(data.get("rollout_transport"), "rollout_transport")
    ckpt = _ckpt(data.get("ckpt"), trainer.get("ckpt"))
    resume = _resume(trainer["resume"], "trainer.resume") if trainer.get("resume") is not None else (
        _resume(data["resume"], "resume") if data.get("resume") is not None else None)
    broadcast_field, broadcast = _type_of(data, "weight_broadcast")
    if broadcast not in (None, "filesystem"):
        raise InvalidInput(broadcast_field, f"is {broadcast!r}; floe publishes steps as broadcasts/step_N/STABLE: "
                           "use type = \"filesystem\"")
    model = trainer.get("model") or {}
    lora = parse_lora(model.get("lora"))
    optim = parse_optim(trainer)
    scheduler = parse_scheduler(trainer, max_steps, optim.lr)

    if "loss" in floe:
        if not isinstance(floe["loss"], dict):
            raise InvalidInput("floe.loss", "must be a table with `name` and `config`")
        loss = native_loss(floe["loss"])
    else:
        loss = map_loss(trainer.get("loss"))

    ranks = _int(floe.get("ranks", 1), "floe.ranks", 1)
    poll = floe.get("poll_s", 0.2)
    if isinstance(poll, bool) or not isinstance(poll, (int, float)) or poll <= 0:
        raise InvalidInput("floe.poll_s", f"must be a number of seconds > 0, got {poll!r}")
    timeout = floe.get("wait_timeout_s")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise InvalidInput("floe.wait_timeout_s", f"must be a number of seconds > 0, got {timeout!r}")
    url = floe.get("url", "http://127.0.0.1:7000")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise InvalidInput("floe.url", f"must be the http(s):// address of `floe serve`, got {url!r}")
    ignored = sorted(f"trainer.{k}" for k in trainer if k not in READ_TRAINER_KEYS)
    ignored += sorted(f"trainer.model.{k}" for k in model if k not in ("name", "lora"))
    return PrimeTrainerConfig(run_dir=run_dir, max_steps=max_steps, loss=loss, transport=transport, ckpt=ckpt,
                              resume=resume, optim=optim, scheduler=scheduler, lora=lora, url=url,
                              token_env=str(floe.get("token_env", "FLOE_TOKEN")), ranks=ranks, poll_s=float(poll),
                              wait_timeout_s=None if timeout is None else float(timeout), ignored_trainer_keys=ignored)


def _positive(value: Any, field_name: str) -> int | None:
    return None if value is None else _int(value, field_name, 1)


def _ckpt(shared: Any, own: Any) -> CkptConfig | None:
    """prime-rl's trainer checkpoint config: the shared `[ckpt]` leaves under `[trainer.ckpt]`'s."""
    if shared is None and own is None:
        return None
    merged: dict[str, tuple[str, Any]] = {}
    for prefix, table in (("ckpt", shared), ("trainer.ckpt", own)):
        if table is None:
            continue
        if not isinstance(table, dict):
            raise InvalidInput(prefix, "must be a table (an empty one turns checkpoints on)")
        for key, value in table.items():
            if key in CKPT_SKIPS and prefix == "trainer.ckpt":
                if value is not False:
                    raise InvalidInput(f"trainer.ckpt.{key}", "must be false: a floe state restores weights, optimizer "
                                       "and step together (and prime-rl's scheduler follows the restored step); "
                                       "remove it")
                continue
            if key not in CKPT_KEYS:
                raise InvalidInput(f"{prefix}.{key}", f"unknown key; [{prefix}] keys: {', '.join(sorted(CKPT_KEYS))}"
                                   + (f", {', '.join(sorted(CKPT_SKIPS))}" if prefix == "trainer.ckpt" else ""))
            merged[key] = (f"{prefix}.{key}", value)

    def get(key: str) -> Any:
        return merged[key][1] if key in merged else None

    out = get("output_dir")
    if out is not None and not isinstance(out, str):
        raise InvalidInput(merged["output_dir"][0], f"must be a directory path, got {out!r}")
    ints = {k: _positive(get(k), merged[k][0] if k in merged else k) for k in ("interval", "keep_last", "keep_interval")}
    return CkptConfig(output_dir=None if out is None else Path(out), **ints)


def _resume(table: Any, prefix: str) -> ResumeConfig:
    """prime-rl's ResumeConfig: `step` >= 1 or `dir` (a `.../step_N` directory), not both."""
    if table is True:  # a bare --resume flag
        table = {}
    if not isinstance(table, dict):
        raise InvalidInput(prefix, "must be a table: {} (the latest checkpoint), {step = N} or {dir = \".../step_N\"}")
    for key in table:
        if key not in ("step", "dir"):
            raise InvalidInput(f"{prefix}.{key}", "unknown key; resume keys: dir, step")
    step = _positive(table.get("step"), f"{prefix}.step")
    where = table.get("dir")
    if where is not None:
        if step is not None:
            raise InvalidInput(f"{prefix}.step", "resume.step and resume.dir are exclusive: the step is the "
                               "directory's name")
        if not isinstance(where, str) or not re.fullmatch(r"step_\d+", Path(where).name):
            raise InvalidInput(f"{prefix}.dir", f"must point at a checkpoint step directory (.../step_N), got {where!r}")
    return ResumeConfig(step=step, dir=None if where is None else Path(where))
