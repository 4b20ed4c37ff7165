"""From ragged groups to micro-batches: which samples run together, within a token budget.

Groups stay whole where they fit the budget; a larger group is split into parts of whole
samples. Parts are then packed into the fewest micro-batches the budget allows, largest first
into the least-loaded bin, so micro-batches come out balanced. The cost of a part is the
number of tokens the model actually processes for it: with prompt dedup the prompt counts
once (P + sum R_i), without it once per sample (sum (P + R_i)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

# How a micro-batch runs through the model (see backend/scoring.py): one padded row per
# sample, or the shared-prefix stream (compute/prefix.py).
Layout = Literal["padded", "shared_prefix"]


@dataclass(frozen=True)
class GroupPart:
    """Some samples of one group: `group` indexes the batch, `samples` index the group."""

    group: int
    samples: tuple[int, ...]
    cost: int


@dataclass(frozen=True)
class MicroBatch:
    """Group parts that run through the model together, and the layout they run in."""

    parts: tuple[GroupPart, ...]
    layout: Layout = "padded"

    @property
    def cost(self) -> int:
        return sum(p.cost for p in self.parts)


def part_cost(prompt_len: int, sample_lens: list[int], dedup: bool) -> int:
    if dedup:
        return prompt_len + sum(sample_lens)
    return sum(prompt_len + r for r in sample_lens)


def split_group(
    group: int, prompt_len: int, sample_lens: list[int], budget: int, dedup: bool
) -> list[GroupPart]:
    """Whole group if it fits; otherwise consecutive runs of samples that each fit (a single
    sample larger than the budget still forms a part of its own)."""
    parts: list[GroupPart] = []
    current: list[int] = []
    for i, r in enumerate(sample_lens):
        trial = current + [i]
        if current and part_cost(prompt_len, [sample_lens[j] for j in trial], dedup) > budget:
            parts.append(GroupPart(group, tuple(current), part_cost(prompt_len, [sample_lens[j] for j in current], dedup)))
            current = [i]
        else:
            current = trial
    if current:
        parts.append(GroupPart(group, tuple(current), part_cost(prompt_len, [sample_lens[j] for j in current], dedup)))
    return parts


def plan_microbatches(
    prompt_lens: list[int], sample_lens: list[list[int]], budget: int, layout: Layout = "padded"
) -> list[MicroBatch]:
    """Balanced micro-batches of group parts, each within `budget` tokens where possible.

    Bins: the fewest that fit (starting at ceil(total / budget)), filled largest part first
    into the least-loaded bin (LPT), so the heaviest micro-batch is at most 4/3 of optimal.
    """
    parts = [
        part
        for g, (p, lens) in enumerate(zip(prompt_lens, sample_lens))
        for part in split_group(g, p, lens, budget, layout == "shared_prefix")
    ]
    if not parts:
        return []
    total = sum(p.cost for p in parts)
    n_bins = max(1, math.ceil(total / budget))
    while True:
        bins: list[list[GroupPart]] = [[] for _ in range(n_bins)]
        loads = [0] * n_bins
        ok = True
        for part in sorted(parts, key=lambda p: -p.cost):
            best = min(range(n_bins), key=lambda b: loads[b])
            if loads[best] and loads[best] + part.cost > budget:
                ok = False
                break
            bins[best].append(part)
            loads[best] += part.cost
        if ok:
            break
        n_bins += 1
    # Keep the original group order inside each micro-batch for readable, reproducible runs.
    out = [MicroBatch(tuple(sorted(b, key=lambda p: (p.group, p.samples))), layout) for b in bins if b]
    return sorted(out, key=lambda mb: (mb.parts[0].group, mb.parts[0].samples))
