"""A framework's own LR scheduler, run beside floe: a one-element stand-in optimizer holds its
rate, which the plugin passes to each `optim_step(lr=...)` (verl: schedule.py, SkyRL: dispatch.py)."""

from __future__ import annotations

import torch


def stand_in_optimizer(lr: float) -> torch.optim.Optimizer:
    """AdamW over one zero parameter at `lr`: what a framework's scheduler factory is given."""
    return torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=lr)


def advance(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int = 1) -> float:
    """Step `scheduler` `steps` times, as the framework does after each optimizer step; returns
    the new rate. The stand-in's own step (no gradients: a no-op) keeps torch's step-order check quiet."""
    for _ in range(steps):
        scheduler.optimizer.step()
        scheduler.step()
    return float(scheduler.get_last_lr()[0])
