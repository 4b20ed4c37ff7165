"""prime-rl's LR schedule for `floe prime-trainer`: prime-rl's own scheduler, run in the trainer.

prime-rl's trainer builds `setup_scheduler(optimizer, config.scheduler, config.max_steps,
config.optim.lr)` (src/prime_rl/trainer/scheduler.py: constant = ConstantLR(factor 1); linear =
LinearLR warm-up from min_lr/lr (1e-8 when min_lr = 0), a constant phase, LinearLR decay to
min_lr, chained by SequentialLR; cosine = the same warm-up, then CosineAnnealingLR to min_lr over
max_steps - warmup_steps) and calls `scheduler.step()` after every `optimizer.step()`: training
step k runs at the rate after k - 1 scheduler steps. `PrimeRlSchedule` builds that scheduler with
prime-rl's function over a stand-in optimizer (floe.integrations.stand_in) and hands each rate to
`client.optim_step(lr=...)`, so the rates are prime-rl's by construction. Its position is floe's
optimizer step (`info().step` at start, then each `OptimStepResult.step`): a restored state
continues the schedule where it stopped.

Where prime-rl is not importable in the trainer's environment, the `constant` scheduler needs no
code of prime-rl's (its rate is trainer.optim.lr at every step) and `linear` / `cosine` are
refused with InvalidInput: floe does not re-implement prime-rl's formulas.

prime-rl's `prime_rl.trainer.optim` package imports `dion` (a git-only package, for its Muon
optimizer) at load; the scheduler module needs only its `base` submodule. Where `dion` is
missing, `prime_rl_scheduler_module` imports the scheduler with that package's `__init__` skipped
(base.py's names put in its place for the import), then removes the stand-in package again.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import torch

from floe.errors import InvalidInput
from floe.integrations.prime_rl.optim import PrimeOptim, PrimeScheduler
from floe.integrations.stand_in import advance, stand_in_optimizer

SCHEDULER_MODULE = "prime_rl.trainer.scheduler"


def prime_rl_installed() -> bool:
    """Whether a `prime_rl` package (prime-rl's checkout or environment) is importable here."""
    try:
        return importlib.util.find_spec("prime_rl.trainer") is not None
    except ModuleNotFoundError:
        return False


def prime_rl_scheduler_module() -> types.ModuleType | None:
    """prime-rl's src/prime_rl/trainer/scheduler.py as a module, or None where prime-rl is not
    installed. A broken prime-rl install raises its own ImportError (except a missing `dion`,
    see the module doc)."""
    if not prime_rl_installed():
        return None
    try:
        return importlib.import_module(SCHEDULER_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "dion":
            raise
    spec = importlib.util.find_spec("prime_rl.trainer")
    assert spec is not None and spec.submodule_search_locations is not None
    package = "prime_rl.trainer.optim"
    shim = types.ModuleType(package)
    shim.__path__ = [str(Path(next(iter(spec.submodule_search_locations))) / "optim")]
    shim.__package__ = package
    sys.modules[package] = shim
    try:
        base = importlib.import_module(f"{package}.base")
        shim.OffloadOptimizer = base.OffloadOptimizer  # type: ignore[attr-defined]
        shim.OptimizerLike = base.OptimizerLike  # type: ignore[attr-defined]
        return importlib.import_module(SCHEDULER_MODULE)
    finally:
        del sys.modules[package]


def prime_rl_scheduler_config(scheduler: PrimeScheduler) -> Any:
    """prime-rl's own SchedulerConfig object (prime_rl.configs.trainer) for these keys."""
    from prime_rl.configs.trainer import SchedulerConfig  # type: ignore[import-not-found]  # noqa: PLC0415
    from pydantic import TypeAdapter  # noqa: PLC0415 - only with prime-rl installed

    return TypeAdapter(SchedulerConfig).validate_python(scheduler.as_prime_rl())


class PrimeRlSchedule:
    """prime-rl's scheduler for one run. `lr` is the rate of the next optimizer step; `steps` the
    optimizer steps taken so far (the scheduler's `last_epoch`); `advance_to(step)` moves it to
    floe's optimizer step after an `optim_step` (forward only). `source` says whose code computes
    the rates ("prime-rl" or "constant": trainer.optim.lr, prime-rl not installed)."""

    def __init__(self, optim: PrimeOptim, scheduler: PrimeScheduler, max_steps: int, steps: int = 0):
        self.optim, self.scheduler_keys, self.max_steps = optim, scheduler, max_steps
        module = prime_rl_scheduler_module()
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self._steps = 0
        if module is None:
            if scheduler.type != "constant":
                raise InvalidInput("trainer.scheduler.type", f"is {scheduler.type!r}: floe runs prime-rl's own scheduler "
                                   "(prime_rl.trainer.scheduler) and prime-rl is not importable here; run "
                                   "`floe prime-trainer` in prime-rl's environment (pip install floe-rl there), "
                                   "or use type = \"constant\"")
            self.source = "constant"
        else:
            self.source = "prime-rl"
            self.scheduler = module.setup_scheduler(stand_in_optimizer(optim.lr), prime_rl_scheduler_config(scheduler),
                                                    max_steps, optim.lr)
        self.advance_to(steps)

    @property
    def steps(self) -> int:
        return int(self.scheduler.last_epoch) if self.scheduler is not None else self._steps

    @property
    def lr(self) -> float:
        if self.scheduler is None:
            return self.optim.lr
        return float(self.scheduler.get_last_lr()[0])

    def advance_to(self, step: int) -> float:
        """Step the scheduler until it has taken `step` steps; returns the next rate."""
        if step < self.steps:
            raise InvalidInput("step", f"the schedule is at optimizer step {self.steps}; it cannot go back to {step}")
        if self.scheduler is None:
            self._steps = step
            return self.lr
        return advance(self.scheduler, step - self.steps) if step > self.steps else self.lr

    def describe(self) -> str:
        s = self.scheduler_keys
        keys = {"constant": "", "linear": f", warmup_steps {s.warmup_steps}, decay_steps {s.decay_steps}, min_lr {s.min_lr:g}",
                "cosine": f", warmup_steps {s.warmup_steps}, min_lr {s.min_lr:g}"}[s.type]
        return (f"{s.type} (lr {self.optim.lr:g}{keys}, max_steps {self.max_steps}; computed by "
                f"{'prime-rl' if self.source == 'prime-rl' else 'none: constant rate, prime-rl not installed'}), "
                f"from optimizer step {self.steps}")
