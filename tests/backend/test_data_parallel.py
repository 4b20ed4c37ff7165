"""Driver-side data parallelism: split a batch into rank shares and merge the answers back.

Pure functions: no ranks here (tests/backend/test_fsdp.py runs real ones)."""

from __future__ import annotations

import pytest

import floe
from floe.backend.data_parallel import (
    RankPartial,
    batch_scales,
    merge_forward,
    merge_forward_backward,
    split_batch,
)
from floe.compute.losses import SampleScales, aggregation_scales, finalize_metrics, resolve_loss
from floe.types import ForwardResult


def _group(plen: int, slens: list[int], tag: int) -> floe.Group:
    return floe.Group([tag] * plen, [floe.Sample([tag + k] * n, weights=[1.0] * (n - 1) + [0.5]) for k, n in enumerate(slens)])


def _batch() -> floe.Batch:
    return floe.Batch([
        _group(4, [3, 5], 1),     # 12 tokens
        _group(2, [20], 2),       # 22
        _group(1, [1, 1, 1], 3),  # 4
        _group(6, [4, 4], 4),     # 14
        _group(3, [2], 5),        # 5
    ])


def _tokens(g: floe.Group) -> int:
    return len(g.prompt) + sum(len(s.tokens) for s in g.samples)


def test_groups_stay_whole_and_every_group_goes_to_exactly_one_rank():
    batch = _batch()
    shares = split_batch(batch, 2, None)
    assert sorted(i for s in shares for i in s.group_indices) == list(range(5))
    for share in shares:
        assert share.batch is not None
        assert share.group_indices == sorted(share.group_indices)  # batch order kept within a rank
        assert [g is batch.groups[i] for g, i in zip(share.batch.groups, share.group_indices)] == [True] * len(share.group_indices)
        assert len(share.scales) == 0  # forward: no loss scales


def test_balanced_by_tokens_largest_first():
    batch = _batch()
    shares = split_batch(batch, 2, None)
    # Largest first onto the lighter rank: 22 -> r0; 14 -> r1; 12 -> r1 (26); 5 -> r0 (27); 4 -> r1 (30).
    assert [s.group_indices for s in shares] == [[1, 4], [0, 2, 3]]
    loads = [sum(_tokens(batch.groups[i]) for i in s.group_indices) for s in shares]
    assert loads == [27, 30]
    assert split_batch(batch, 2, None)[0].group_indices == [1, 4]  # deterministic


def test_fewer_groups_than_ranks_leaves_empty_shares():
    batch = floe.Batch(_batch().groups[:2])
    shares = split_batch(batch, 4, resolve_loss("cross_entropy", None))
    assert [s.group_indices for s in shares] == [[1], [0], [], []]
    assert shares[2].batch is None and len(shares[2].scales) == 0
    with pytest.raises(ValueError, match="world_size"):
        split_batch(batch, 0, None)


@pytest.mark.parametrize("aggregation", ["sum", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_shares_carry_the_global_scales(aggregation):
    batch = _batch()
    spec = resolve_loss("cross_entropy", {"aggregation": aggregation})
    samples = [s for g in batch.groups for s in g.samples]
    expected = aggregation_scales(
        [len(s.tokens) for s in samples], [sum(s.weights) for s in samples], aggregation, None
    )
    assert batch_scales(batch, spec) == SampleScales(expected, expected, expected)
    first = [0]
    for g in batch.groups:
        first.append(first[-1] + len(g.samples))
    for share in split_batch(batch, 3, spec):
        assert share.scales.policy == [expected[k] for i in share.group_indices for k in range(first[i], first[i + 1])]


@pytest.mark.parametrize(("kl", "entropy"), [("seq_mean_token_mean", "sum"), ("sum", None)])
def test_shares_carry_each_terms_global_scales(kl, entropy):
    """kl.aggregation / entropy.aggregation: each term's scales are its own aggregation's over
    the whole batch (None: the policy term's), cut with the samples into the shares."""
    batch = _batch()
    spec = resolve_loss("ppo", {"aggregation": "token_mean", "kl": {"coef": 0.1, "aggregation": kl},
                                "entropy": {"coef": 0.01, "aggregation": entropy}})
    samples = [s for g in batch.groups for s in g.samples]
    lengths, sums = [len(s.tokens) for s in samples], [sum(s.weights) for s in samples]
    policy = aggregation_scales(lengths, sums, "token_mean", None)
    expected = SampleScales(policy, aggregation_scales(lengths, sums, kl, None),
                            policy if entropy is None else aggregation_scales(lengths, sums, entropy, None))
    assert expected.kl != expected.policy
    assert batch_scales(batch, spec) == expected
    first = [0]
    for g in batch.groups:
        first.append(first[-1] + len(g.samples))
    for share in split_batch(batch, 3, spec):
        picked = [k for i in share.group_indices for k in range(first[i], first[i + 1])]
        assert share.scales == expected.pick(picked)


def _values(batch: floe.Batch, scale: float) -> list[list[list[float]]]:
    return [[[scale * (gi + 1) + 0.01 * t for t in range(len(s.tokens))] for s in g.samples] for gi, g in enumerate(batch.groups)]


def test_merge_forward_restores_batch_order():
    batch = _batch()
    shares = split_batch(batch, 3, None)
    full_lp, full_ent = _values(batch, -1.0), _values(batch, 2.0)
    results = []
    for s in shares:
        results.append(ForwardResult([full_lp[i] for i in s.group_indices], [full_ent[i] for i in s.group_indices]))
    merged = merge_forward(len(batch.groups), shares, results)
    assert merged.logprobs == full_lp and merged.entropy == full_ent
    no_entropy = merge_forward(len(batch.groups), shares, [ForwardResult(r.logprobs, None) for r in results])
    assert no_entropy.entropy is None
    with pytest.raises(ValueError, match="groups"):
        merge_forward(len(batch.groups), shares, [ForwardResult(r.logprobs[:-1]) for r in results])


def test_merge_forward_backward_sums_metric_parts_like_one_process():
    batch = floe.Batch(_batch().groups[:1])
    spec = resolve_loss("cross_entropy", None)
    shares = split_batch(batch, 2, spec)  # rank 1 gets nothing
    lp = _values(batch, -1.0)
    sums_a = {"loss": 1.5, "policy_loss": 1.25, "tokens": 6.0, "weight_sum": 5.0, "clipped_tokens": 0.0,
              "exp_bounded_tokens": 0.0}
    sums_b = {"loss": 0.25, "policy_loss": 0.5, "tokens": 2.0, "weight_sum": 2.0, "clipped_tokens": 0.0,
              "exp_bounded_tokens": 0.0}
    partials = [RankPartial(lp, [sums_a, sums_b]), RankPartial([], [])]
    merged = merge_forward_backward(batch, shares, partials, spec)
    assert merged.logprobs == lp
    assert merged.metrics == {**finalize_metrics([sums_a, sums_b]), "samples": 2.0}
    assert merged.metrics["loss"] == 1.75 and merged.metrics["policy_loss"] == 1.75 and merged.loss == "cross_entropy"
    assert merged.loss_config == spec.resolved()
