"""verl's LR schedule for the floe plugin: verl's own scheduler, run where verl runs it.

verl 0.9.1's FSDP engine builds its scheduler from `actor_rollout_ref.actor.optim`
(`FSDPEngine._build_lr_scheduler`) and steps it once per `update_actor` call, after the last
mini-batch (`engine_workers.update_actor` sets `update_lr_scheduler` on it): every mini-batch
of one training step runs at the same rate, and the `actor/lr` verl logs is the rate after
that step. `VerlSchedule` rebuilds the same scheduler with verl's functions over a stand-in
parameter and hands its rate to each floe `optim_step(lr=...)`, so the floe backend trains at
verl's rate whether the plugin started it or it is a shared `floe serve`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

from floe.errors import InvalidInput
from floe.integrations.stand_in import advance, stand_in_optimizer
from floe.integrations.verl.backend_config import OPTIM, scheduler_type


def verl_scheduler(optim: Mapping[str, Any]) -> torch.optim.lr_scheduler.LRScheduler:
    """The scheduler verl's FSDP engine builds for this `actor_rollout_ref.actor.optim` (resolved:
    verl's trainer has set `total_training_steps`): warm-up `lr_warmup_steps`, or when that is
    <= 0, int(`lr_warmup_steps_ratio` × total); `constant` or `cosine` (`min_lr_ratio`,
    `num_cycles`, `zero_indexed_step`). InvalidInput naming the key for a bad value."""
    kind = scheduler_type(optim)
    total = optim.get("total_training_steps")
    if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
        raise InvalidInput(f"{OPTIM}.total_training_steps", f"must be the run's optimizer updates (verl's trainer sets "
                           f"it from the data and trainer.total_training_steps), got {total!r}")
    warmup = int(optim.get("lr_warmup_steps") or -1)
    if warmup <= 0:  # verl's rule: a ratio of the total when no step count is given
        warmup = int(float(optim.get("lr_warmup_steps_ratio") or 0.0) * total)
    stand_in = stand_in_optimizer(float(optim.get("lr", 1e-6)))
    if kind == "constant":
        return get_constant_schedule_with_warmup(optimizer=stand_in, num_warmup_steps=warmup)
    return get_cosine_schedule_with_warmup(
        optimizer=stand_in, num_warmup_steps=warmup, num_training_steps=total,
        min_lr_ratio=optim.get("min_lr_ratio"), num_cycles=float(optim.get("num_cycles", 0.5)),
        zero_indexed_step=bool(optim.get("zero_indexed_step", True)),
    )


class VerlSchedule:
    """verl's scheduler for one run: `lr` is the rate of the current training step's optimizer
    steps; `step()` advances it once per training step (returns the new rate, what verl logs as
    actor/lr); `steps` is how many times it has advanced (saved with each checkpoint, and
    `at(steps)` resumes there, as verl's own checkpoint restores its scheduler)."""

    def __init__(self, optim: Mapping[str, Any], steps: int = 0):
        self.optim = dict(optim)
        self.scheduler = verl_scheduler(self.optim)
        advance(self.scheduler, steps)

    @property
    def steps(self) -> int:
        return int(self.scheduler.last_epoch)

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def step(self) -> float:
        return advance(self.scheduler)

    def at(self, steps: int) -> VerlSchedule:
        """The same schedule after `steps` training steps."""
        return VerlSchedule(self.optim, steps)


class ScheduleNotSet:
    """A worker group's schedule before its trainer knows the run's total training steps (verl's
    fully-async trainer sets them after building its workers): any use is a RuntimeError."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("verl's LR schedule is not set yet: the trainer has not set "
                           "actor_rollout_ref.actor.optim.total_training_steps (set_total_train_steps)")
