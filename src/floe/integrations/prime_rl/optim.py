"""prime-rl's `trainer.optim` and `trainer.scheduler` tables, read for `floe prime-trainer`.

prime-rl (PRIME_RL_COMMIT) builds `AdamW(params, lr, weight_decay, betas=(betas1, betas2))`
over every trainable parameter (`_create_optimizer`, src/prime_rl/trainer/optim/__init__.py;
eps is torch's default), clips the global gradient norm to `max_norm` before each step
(`max_norm = None`: no clipping), and steps its scheduler (src/prime_rl/trainer/scheduler.py)
once after each optimizer step. With floe:

  the rate of each step       prime-rl's own scheduler, run in the trainer (schedule.py), passed
                              as `client.optim_step(lr=...)`: exact whatever the server's schedule
  betas, weight decay, eps,   the server's optimizer (`floe serve`'s [backend.optimizer] table) applies
  max_norm                    them; the trainer compares them with the server's
                              `info().capabilities["optimizer"]` and refuses a difference,
                              naming the key, both values and the [backend.optimizer] line that fixes it

The defaults are prime-rl's (`AdamWConfig`, `*SchedulerConfig` in
packages/prime-rl-configs/src/prime_rl/configs/trainer.py); the `prime_rl` suite checks them
against prime-rl's own config classes, and the checks against prime-rl's `validate_scheduler`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from floe.backend.validation import MAX_LEARNING_RATE
from floe.errors import InvalidInput

# prime-rl's AdamWConfig defaults (BaseOptimizerConfig + betas).
ADAMW_DEFAULTS: dict[str, Any] = {"lr": 1e-6, "weight_decay": 0.01, "max_norm": 1.0, "betas1": 0.9, "betas2": 0.999}
# torch.optim.AdamW's eps, which prime-rl leaves at its default.
TORCH_ADAMW_EPS = 1e-8
SCHEDULER_DEFAULTS: dict[str, dict[str, Any]] = {
    "constant": {},
    "linear": {"warmup_steps": 10, "decay_steps": 10, "min_lr": 0.0},
    "cosine": {"warmup_steps": 10, "min_lr": 0.0},
}
OTHER_OPTIMIZERS = ("sgd", "muon", "sign_sgd")


@dataclass(frozen=True)
class PrimeOptim:
    """prime-rl's `trainer.optim` (type "adamw"), defaults filled in."""

    lr: float = ADAMW_DEFAULTS["lr"]
    weight_decay: float = ADAMW_DEFAULTS["weight_decay"]
    max_norm: float | None = ADAMW_DEFAULTS["max_norm"]
    betas1: float = ADAMW_DEFAULTS["betas1"]
    betas2: float = ADAMW_DEFAULTS["betas2"]

    def as_prime_rl(self) -> dict[str, Any]:
        """The table prime-rl's `AdamWConfig` takes."""
        return {"type": "adamw", **asdict(self)}

    def serve_optimizer(self) -> dict[str, Any]:
        """The `[backend.optimizer]` keys of a `floe serve` config that train as prime-rl's AdamW does
        (`lr` and the schedule do not matter: the trainer passes each step's rate)."""
        return {"betas": [self.betas1, self.betas2], "eps": TORCH_ADAMW_EPS, "weight_decay": self.weight_decay,
                "grad_clip": self.max_norm}


@dataclass(frozen=True)
class PrimeScheduler:
    """prime-rl's `trainer.scheduler`, defaults of its type filled in."""

    type: str = "constant"
    warmup_steps: int = 0
    decay_steps: int = 0
    min_lr: float = 0.0

    def as_prime_rl(self) -> dict[str, Any]:
        """The table prime-rl's `SchedulerConfig` union takes (only the keys of this type)."""
        return {"type": self.type, **{k: getattr(self, k) for k in SCHEDULER_DEFAULTS[self.type]}}


def _table(trainer: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = trainer.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidInput(f"trainer.{key}", f"must be a table, got {value!r}")
    return dict(value)


def _number(value: Any, field: str, low: float, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < low \
            or (high is not None and value > high):
        bound = f"in [{low:g}, {high:g}]" if high is not None else f">= {low:g}"
        raise InvalidInput(field, f"must be a number {bound}, got {value!r}")
    return float(value)


def _count(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(field, f"must be an integer >= 0, got {value!r}")
    return value


def _unknown(table: Mapping[str, Any], known: Mapping[str, Any], prefix: str) -> None:
    for key in table:
        if key != "type" and key not in known:
            raise InvalidInput(f"{prefix}.{key}", f"unknown key; prime-rl's keys here: type, {', '.join(known)}")


def parse_optim(trainer: Mapping[str, Any]) -> PrimeOptim:
    """`trainer.optim` -> PrimeOptim; InvalidInput naming the key for another optimizer type, an
    unknown key or a bad value (prime-rl's bounds, and lr <= floe's MAX_LEARNING_RATE)."""
    table = _table(trainer, "optim")
    kind = table.get("type", "adamw")
    if kind in OTHER_OPTIMIZERS:
        raise InvalidInput("trainer.optim.type", f"is {kind!r}; floe's policy zone trains with AdamW only: "
                           "use type = \"adamw\" (prime-rl's default)")
    if kind != "adamw":
        raise InvalidInput("trainer.optim.type", f"unknown optimizer {kind!r}; prime-rl's are adamw, {', '.join(OTHER_OPTIMIZERS)}")
    _unknown(table, ADAMW_DEFAULTS, "trainer.optim")
    values = {**ADAMW_DEFAULTS, **{k: v for k, v in table.items() if k != "type"}}
    max_norm = values["max_norm"]
    if max_norm is not None:
        max_norm = _number(max_norm, "trainer.optim.max_norm", 0.0)
        if max_norm == 0:
            raise InvalidInput("trainer.optim.max_norm", "0 clips every gradient to zero; give a norm > 0")
    return PrimeOptim(
        lr=_number(values["lr"], "trainer.optim.lr", 0.0, MAX_LEARNING_RATE),
        weight_decay=_number(values["weight_decay"], "trainer.optim.weight_decay", 0.0),
        max_norm=max_norm,
        betas1=_number(values["betas1"], "trainer.optim.betas1", 0.0, 1.0 - 1e-12),
        betas2=_number(values["betas2"], "trainer.optim.betas2", 0.0, 1.0 - 1e-12),
    )


def parse_scheduler(trainer: Mapping[str, Any], max_steps: int, lr: float) -> PrimeScheduler:
    """`trainer.scheduler` -> PrimeScheduler; InvalidInput naming the key where prime-rl's
    `validate_scheduler` (or its scheduler factory) would fail over `max_steps`."""
    table = _table(trainer, "scheduler")
    kind = table.get("type", "constant")
    if kind not in SCHEDULER_DEFAULTS:
        raise InvalidInput("trainer.scheduler.type", f"unknown scheduler {kind!r}; prime-rl's are "
                           f"{', '.join(SCHEDULER_DEFAULTS)}")
    defaults = SCHEDULER_DEFAULTS[kind]
    _unknown(table, defaults, "trainer.scheduler")
    values = {**defaults, **{k: v for k, v in table.items() if k != "type"}}
    warmup = _count(values.get("warmup_steps", 0), "trainer.scheduler.warmup_steps")
    decay = _count(values.get("decay_steps", 0), "trainer.scheduler.decay_steps")
    min_lr = _number(values.get("min_lr", 0.0), "trainer.scheduler.min_lr", 0.0, MAX_LEARNING_RATE)
    if min_lr > 0 and lr == 0 and warmup + decay > 0:
        raise InvalidInput("trainer.optim.lr", "is 0 with trainer.scheduler.min_lr > 0: prime-rl's warm-up and "
                           "decay factors are min_lr / lr")
    if kind == "linear":
        if warmup == 0 and decay == 0:
            raise InvalidInput("trainer.scheduler.warmup_steps", "a linear scheduler needs warmup_steps > 0 or "
                               "decay_steps > 0 (prime-rl's rule); use type = \"constant\" instead")
        if decay > 0 and warmup + decay > max_steps:
            raise InvalidInput("trainer.scheduler.decay_steps", f"warmup_steps ({warmup}) + decay_steps ({decay}) "
                               f"must not exceed max_steps ({max_steps}) (prime-rl's rule)")
    if kind == "cosine" and warmup >= max_steps:
        raise InvalidInput("trainer.scheduler.warmup_steps", f"warmup_steps ({warmup}) must be less than "
                           f"max_steps ({max_steps}) (prime-rl's rule)")
    return PrimeScheduler(type=kind, warmup_steps=warmup, decay_steps=decay, min_lr=min_lr)


def _toml(value: Any) -> str:
    if value is None:
        return "none (no clipping)"
    if isinstance(value, list):
        return "[" + ", ".join(repr(float(v)) for v in value) + "]"
    return repr(float(value))


def check_server_optimizer(optim: PrimeOptim, server: Mapping[str, Any] | None) -> None:
    """InvalidInput when the server's optimizer (`info().capabilities["optimizer"]`) would not
    train as prime-rl's AdamW with these keys: the recipe's key, both values, and the
    `floe serve` [backend.optimizer] line that makes them agree. Floats compare exactly."""
    fix = "start `floe serve` with [backend.optimizer] " + ", ".join(f"{k} = {_toml(v)}" for k, v in optim.serve_optimizer().items())
    if not server:
        raise InvalidInput("floe.url", "the server does not report its optimizer (info().capabilities['optimizer']), "
                           "so prime-rl's trainer.optim cannot be checked; use a floe serve of this floe version")
    if server.get("name", "adamw") != "adamw":
        raise InvalidInput("trainer.optim.type", f"the server's optimizer is {server.get('name')!r}, the recipe's adamw")
    want = optim.serve_optimizer()
    keys = {"betas": "trainer.optim.betas1 / betas2", "eps": "trainer.optim (prime-rl uses torch's eps 1e-8)",
            "weight_decay": "trainer.optim.weight_decay", "grad_clip": "trainer.optim.max_norm"}
    for key, field in keys.items():
        have = server.get(key)
        have_cmp = list(have) if isinstance(have, (list, tuple)) else have
        if have_cmp != want[key]:
            raise InvalidInput(field.split(" ")[0], f"the recipe trains with {key} = {_toml(want[key])} ({field}); the "
                               f"server's optimizer has {key} = {_toml(have)}: {fix}")
