"""floe.convert, SkyRL section: left-padded SkyRL batches <-> floe.Batch, property-tested.

Round trips both ways (Batch -> SkyRL tensors -> Batch, and SkyRL tensors -> Batch -> per-token
values back in SkyRL's right-aligned layout), prompt grouping, the forward-pass split (only the
response width known), and the errors for malformed batches.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import floe
from floe.convert import batch_to_skyrl, skyrl_to_batch, skyrl_token_values
from floe.errors import InvalidInput

PAD = 0


@st.composite
def batches(draw: st.DrawFn) -> floe.Batch:
    """Groups with distinct non-empty prompts and 1-4 non-empty samples carrying every field."""
    n_groups = draw(st.integers(1, 4))
    groups = []
    for g in range(n_groups):
        prompt = [g + 1] + draw(st.lists(st.integers(1, 50), min_size=0, max_size=6))  # first token makes it distinct
        samples = []
        for _ in range(draw(st.integers(1, 4))):
            k = draw(st.integers(1, 7))
            tokens = draw(st.lists(st.integers(1, 50), min_size=k, max_size=k))
            floats = st.floats(-5, 5, allow_nan=False, width=32)
            samples.append(floe.Sample(
                tokens=tokens,
                logprobs=draw(st.lists(floats, min_size=k, max_size=k)),
                advantage=draw(st.lists(floats, min_size=k, max_size=k)),
                weights=draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=k, max_size=k)),
                ref_logprobs=draw(st.lists(floats, min_size=k, max_size=k)),
            ))
        groups.append(floe.Group(prompt, samples))
    return floe.Batch(groups)


@settings(max_examples=60, deadline=None)
@given(batches())
def test_batch_to_skyrl_and_back_is_identity(batch: floe.Batch) -> None:
    t = batch_to_skyrl(batch, pad_token_id=PAD)
    layout = skyrl_to_batch(t.sequences, t.attention_mask, t.response_mask, logprobs=t.logprobs,
                            advantages=t.advantages, ref_logprobs=t.ref_logprobs, weights=t.loss_mask)
    assert layout.batch == batch
    assert t.response_mask.shape[1] == max(len(s.tokens) for g in batch.groups for s in g.samples)
    assert layout.positions == [(g, s) for g, grp in enumerate(batch.groups) for s in range(len(grp.samples))]


@settings(max_examples=60, deadline=None)
@given(batches())
def test_skyrl_values_round_trip_through_groups(batch: floe.Batch) -> None:
    """Per-token values leave SkyRL's right-aligned layout and come back to the same places, zeros elsewhere."""
    t = batch_to_skyrl(batch, pad_token_id=PAD)
    layout = skyrl_to_batch(t.sequences, t.attention_mask, t.response_mask, logprobs=t.logprobs)
    values = [[s.logprobs for s in g.samples] for g in layout.batch.groups]
    again = skyrl_token_values(layout, values, t.response_mask.shape[1])
    assert t.logprobs is not None and torch.equal(again, t.logprobs)
    assert torch.equal(again * (1 - t.response_mask), torch.zeros_like(again))


@settings(max_examples=60, deadline=None)
@given(batches())
def test_forward_split_scores_exactly_the_last_r_positions(batch: floe.Batch) -> None:
    """Without a response mask (SkyRL's forward batches), a row's sample is its last min(R, n-1)
    real tokens; prompt + sample is always the row's real tokens."""
    t = batch_to_skyrl(batch, pad_token_id=PAD)
    width = t.response_mask.shape[1]
    layout = skyrl_to_batch(t.sequences, t.attention_mask, response_length=width)
    real_rows = [g.prompt + s.tokens for g in batch.groups for s in g.samples]
    for i, real in enumerate(real_rows):
        g, s = layout.positions[i]
        sample = layout.batch.groups[g].samples[s]
        assert layout.batch.groups[g].prompt + sample.tokens == real
        assert len(sample.tokens) == min(width, len(real) - 1)


def test_rows_with_the_same_prompt_share_one_group_in_first_appearance_order() -> None:
    # rows: prompt A, prompt B, prompt A (different response lengths)
    seq = torch.tensor([[0, 0, 7, 8, 1, 2], [0, 9, 9, 9, 3, 4], [0, 7, 8, 5, 6, 2]])
    att = (seq != 0).long()
    att[2] = torch.tensor([0, 1, 1, 1, 1, 1])
    resp = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1]])
    layout = skyrl_to_batch(seq, att, resp)
    batch = layout.batch
    assert [g.prompt for g in batch.groups] == [[7, 8], [9, 9, 9]]
    assert [[s.tokens for s in g.samples] for g in batch.groups] == [[[1, 2], [5, 6, 2]], [[3, 4]]]
    assert layout.positions == [(0, 0), (1, 0), (0, 1)]
    by_uid = skyrl_to_batch(seq, att, resp, uids=["a", "b", "c"])
    assert len(by_uid.batch.groups) == 3  # different uids are never merged


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"attention_mask": torch.tensor([[1, 0, 1, 1]])}, "attention_mask[0]"),
        ({"response_mask": torch.tensor([[1, 0]])}, "response_mask[0]"),
        ({"response_mask": torch.tensor([[1, 1, 1]])}, "response_mask[0]"),
        ({"response_mask": torch.tensor([[1, 1], [1, 1]])}, "response_mask"),
        ({"logprobs": torch.zeros(1, 5)}, "logprobs"),
        ({"uids": ["a", "b"]}, "uids"),
        ({"response_mask": None}, "response_mask"),
    ],
)
def test_malformed_batches_name_the_field(kwargs: dict, field: str) -> None:
    args = {"sequences": torch.tensor([[0, 5, 6, 7]]), "attention_mask": torch.tensor([[0, 1, 1, 1]]),
            "response_mask": torch.tensor([[1, 1]])}
    args.update(kwargs)
    with pytest.raises(InvalidInput) as err:
        skyrl_to_batch(**args)
    assert err.value.field == field


def test_values_of_the_wrong_length_are_refused() -> None:
    layout = skyrl_to_batch(torch.tensor([[5, 6, 7]]), torch.tensor([[1, 1, 1]]), torch.tensor([[1, 1]]))
    with pytest.raises(InvalidInput) as err:
        skyrl_token_values(layout, [[[0.1]]], 2)
    assert err.value.field == "values[0]"
