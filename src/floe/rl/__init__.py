"""The GRPO loop (`floe train`): rollouts, advantages, sync/async scheduling, metrics, plots."""

from floe.rl.config import Recipe
from floe.rl.loop import RunSummary, Trainer, evaluate, train

__all__ = ["Recipe", "RunSummary", "Trainer", "evaluate", "train"]
