"""A GSM8K reward that a random tiny model can move: verl's own gsm8k score, plus half the
fraction of digits in the response (so rewards differ within a group and GRPO advantages are
not all zero). Loaded by verl through reward.custom_reward_function.path."""

from __future__ import annotations

from typing import Any


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **kwargs: Any) -> float:
    from verl.utils.reward_score import gsm8k  # noqa: PLC0415 - runs inside verl's reward workers only

    digits = sum(c.isdigit() for c in solution_str)
    return float(gsm8k.compute_score(solution_str, ground_truth)) + 0.5 * digits / max(1, len(solution_str))
