"""The GRPO loop (`floe train`): rollouts, advantages, sync/async scheduling, metrics, plots.

The loop's names are imported on first use, so reading and validating a recipe
(`floe.rl.config`) does not load the model stack (transformers) first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from floe.rl.config import Recipe

if TYPE_CHECKING:
    from floe.rl.loop import RunSummary, Trainer, evaluate, train

__all__ = ["Recipe", "RunSummary", "Trainer", "evaluate", "train"]

_LAZY = {"RunSummary", "Trainer", "evaluate", "train"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module("floe.rl.loop"), name)
    raise AttributeError(f"module 'floe.rl' has no attribute {name!r}")
