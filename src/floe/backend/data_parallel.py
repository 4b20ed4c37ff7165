"""Driver-side data parallelism for the policy: split a batch across ranks, merge their results.

Pure functions on floe.types (no torch.distributed): the placement that runs the policy on
several ranks (`policy_sharded.ShardedPolicyZone`, one per rank) calls `split_batch` once per
`forward` / `forward_backward`, sends each rank its `RankShare`, and merges what comes back.

Why the split leaves the result unchanged:
* groups are never cut: a group's prompt goes through the model once on one rank (prompt dedup
  still applies within a rank);
* the loss's aggregation scales (one per sample for each term: policy, KL, entropy,
  `SampleScales`) are computed here over the WHOLE batch (`batch_scales`, the same function
  the single-process `PolicyZone` uses) and sent with each share, so every
  rank's micro-batch losses are terms of the one global loss; the ranks' gradients are summed
  (FSDP reduce-scatter with divide factor 1), and the metric sums are added here before
  `finalize_metrics`, exactly as the single process adds its micro-batches' sums.

Balance: groups go largest-first (by tokens: prompt + samples) onto the rank with the fewest
tokens so far (ties: the lower group index first, the lower rank first), so the split is
deterministic. A rank may get no groups (fewer groups than ranks): its share has `batch=None`
and it still takes part in every collective (see `policy_sharded`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from floe.compute.losses import LossSpec, SampleScales, finalize_metrics, term_scales
from floe.types import Batch, ForwardBackwardResult, ForwardResult

__all__ = ["RankPartial", "RankShare", "batch_scales", "merge_forward", "merge_forward_backward", "split_batch"]


@dataclass
class RankShare:
    """One rank's part of a batch.

    `batch`: its groups in batch order (None when it got none); `group_indices[k]`: the
    position in the full batch of `batch.groups[k]`; `scales`: the aggregation scales of each
    term (policy, KL, entropy) per sample of its groups, in order, computed over the whole batch
    (empty for `forward`); `stats`: for a
    loss with a batch statistic (clip_cov, kl_cov), its per-token values for each sample of its
    groups, in order, computed over the whole batch (`policy.batch_token_stats`), else None."""

    batch: Batch | None
    group_indices: list[int] = field(default_factory=list)
    scales: SampleScales = field(default_factory=lambda: SampleScales([], [], []))
    stats: list[list[float]] | None = None


@dataclass
class RankPartial:
    """What one rank's `forward_backward` returns: per-token log-probs of its groups
    ([group k of its share][sample][token]) and the un-finalized metric sums of its
    micro-batches (`compute_loss`'s sums; dummy micro-batches contribute none)."""

    logprobs: list[list[list[float]]]
    metric_sums: list[dict[str, float]]


def batch_scales(batch: Batch, spec: LossSpec) -> SampleScales:
    """The aggregation scales of every sample of `batch` (in group, then sample order) under
    `spec`, one per term (`term_scales`): the factors that make Σ_t w·ℓ, Σ_t w·k and Σ_t w·H of
    a sample its terms in the aggregated loss."""
    samples = [s for g in batch.groups for s in g.samples]
    weight_sums = [float(sum(s.weights)) if s.weights is not None else float(len(s.tokens)) for s in samples]
    return term_scales([len(s.tokens) for s in samples], weight_sums, spec.config)


def _group_tokens(batch: Batch, index: int) -> int:
    group = batch.groups[index]
    return len(group.prompt) + sum(len(s.tokens) for s in group.samples)


def split_batch(
    batch: Batch, world_size: int, spec: LossSpec | None, stats: list[list[float]] | None = None
) -> list[RankShare]:
    """`world_size` shares of `batch` (groups whole, balanced by tokens, see the module doc).

    With `spec` (forward_backward) each share carries its samples' global aggregation scales;
    with None (forward) the scales are empty. `stats` (one list per sample of `batch`, the
    loss's batch statistic) are split the same way. ValueError for world_size < 1."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    scales = batch_scales(batch, spec) if spec is not None else None
    first = [0]
    for g in batch.groups:
        first.append(first[-1] + len(g.samples))
    load = [0] * world_size
    assigned: list[list[int]] = [[] for _ in range(world_size)]
    order = sorted(range(len(batch.groups)), key=lambda i: (-_group_tokens(batch, i), i))
    for i in order:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        assigned[rank].append(i)
        load[rank] += _group_tokens(batch, i)
    shares = []
    for indices in assigned:
        indices.sort()
        picked = [k for i in indices for k in range(first[i], first[i + 1])]
        share_scales = SampleScales([], [], []) if scales is None else scales.pick(picked)
        share_stats = None if stats is None else [stats[k] for k in picked]
        sub = Batch([batch.groups[i] for i in indices]) if indices else None
        shares.append(RankShare(sub, indices, share_scales, share_stats))
    return shares


def _place(num_groups: int, shares: list[RankShare], parts: list[list[list[list[float]]]]) -> list[list[list[float]]]:
    out: list[list[list[float]] | None] = [None] * num_groups
    for share, part in zip(shares, parts, strict=True):
        if len(part) != len(share.group_indices):
            raise ValueError(f"a rank returned {len(part)} groups for a share of {len(share.group_indices)}")
        for index, values in zip(share.group_indices, part):
            out[index] = values
    missing = [i for i, v in enumerate(out) if v is None]
    if missing:
        raise ValueError(f"no rank returned groups {missing[:5]}")
    return out  # type: ignore[return-value]


def merge_forward(num_groups: int, shares: list[RankShare], results: list[ForwardResult]) -> ForwardResult:
    """The ranks' `forward` results (one per share, in rank order) as one result in batch order."""
    logprobs = _place(num_groups, shares, [r.logprobs for r in results])
    with_entropy = any(r.entropy is not None for r in results if r.logprobs)
    entropy = _place(num_groups, shares, [r.entropy or [] for r in results]) if with_entropy else None
    return ForwardResult(logprobs, entropy)


def merge_forward_backward(
    batch: Batch, shares: list[RankShare], partials: list[RankPartial], spec: LossSpec
) -> ForwardBackwardResult:
    """The ranks' partials (one per share, in rank order) as the single-process result:
    log-probs in batch order, metrics from the summed micro-batch sums (`finalize_metrics`),
    `samples` the whole batch's sample count."""
    logprobs = _place(len(batch.groups), shares, [p.logprobs for p in partials])
    metrics = finalize_metrics([sums for p in partials for sums in p.metric_sums])
    metrics["samples"] = float(batch.num_samples)
    return ForwardBackwardResult(metrics, logprobs, spec.name, spec.resolved())
