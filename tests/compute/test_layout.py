"""The token-budget micro-batch planner: coverage, budgets, whole groups, balance."""

from __future__ import annotations

import random

import pytest

from floe.compute.layout import part_cost, plan_microbatches


def _random_batch(seed: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    groups = rng.randint(1, 12)
    prompts = [rng.randint(1, 300) for _ in range(groups)]
    samples = [[rng.randint(1, 200) for _ in range(rng.randint(1, 16))] for _ in range(groups)]
    return prompts, samples


@pytest.mark.parametrize("layout", ["padded", "shared_prefix"])
@pytest.mark.parametrize("seed", range(20))
def test_every_sample_once_within_budget(seed: int, layout: str) -> None:
    prompts, samples = _random_batch(seed)
    budget = random.Random(seed).choice([256, 1024, 4096])
    dedup = layout == "shared_prefix"
    plan = plan_microbatches(prompts, samples, budget, layout)  # type: ignore[arg-type]
    seen = sorted((p.group, i) for mb in plan for p in mb.parts for i in p.samples)
    assert seen == sorted((g, i) for g, s in enumerate(samples) for i in range(len(s)))
    for mb in plan:
        assert mb.layout == layout
        # Over budget only when a single sample alone is larger than the budget.
        if mb.cost > budget:
            assert len(mb.parts) == 1 and len(mb.parts[0].samples) == 1
    for g, (p, lens) in enumerate(zip(prompts, samples)):
        parts = [part for mb in plan for part in mb.parts if part.group == g]
        if part_cost(p, lens, dedup) <= budget:
            assert len(parts) == 1  # a group that fits stays whole


def test_balanced_and_fewest_bins() -> None:
    prompts = [100] * 6
    samples = [[50] * 4] * 6  # dedup cost 300 per group
    plan = plan_microbatches(prompts, samples, 600, "shared_prefix")
    assert [mb.cost for mb in plan] == [600, 600, 600]
    plan = plan_microbatches(prompts, samples, 1000, "shared_prefix")
    costs = sorted(mb.cost for mb in plan)
    assert len(plan) == 2 and costs == [900, 900]


def test_group_larger_than_budget_is_split() -> None:
    plan = plan_microbatches([100], [[60] * 8], 300, "shared_prefix")
    assert len(plan) > 1 and all(mb.cost <= 300 for mb in plan)
    assert sum(len(p.samples) for mb in plan for p in mb.parts) == 8
