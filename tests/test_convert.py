"""floe.convert, verl section: verl's rows and padded tensors <-> floe.Batch (property tests),
log-probs put back in verl's alignment, and a real forward through the rebuilt groups."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import floe
from floe.convert import (
    pad_rows,
    unpad_rows,
    verl_padded_to_batch,
    verl_response_values,
    verl_sequence_values,
    verl_to_batch,
)

tokens = st.lists(st.integers(1, 60), min_size=1, max_size=6)
floats = st.floats(-5, 5, allow_nan=False, width=32)


@st.composite
def verl_rows(draw):
    """Rows as verl's trainer holds them: a few prompts (uids), each repeated n times with its
    own response and per-token fields; rows shuffled like verl's balance step does."""
    n_prompts = draw(st.integers(1, 4))
    rows = []
    for u in range(n_prompts):
        prompt = draw(tokens)
        for _ in range(draw(st.integers(1, 3))):
            resp = draw(tokens)
            k = len(resp)
            rows.append({
                "uid": f"uid-{u}", "prompt": prompt, "response": resp,
                "mask": draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=k, max_size=k)),
                "old": draw(st.lists(floats, min_size=k, max_size=k)),
                "adv": draw(st.lists(floats, min_size=k, max_size=k)),
                "ref": draw(st.lists(floats, min_size=k, max_size=k)),
            })
    return draw(st.permutations(rows))


def _from_rows(rows):
    return verl_to_batch(
        [r["prompt"] for r in rows], [r["response"] for r in rows], [r["uid"] for r in rows],
        response_mask=[r["mask"] for r in rows], old_log_probs=[r["old"] for r in rows],
        advantages=[r["adv"] for r in rows], ref_log_probs=[r["ref"] for r in rows],
    )


@settings(max_examples=60, deadline=None)
@given(verl_rows())
def test_rows_round_trip_and_groups_follow_uids(rows):
    layout = _from_rows(rows)
    batch = layout.batch
    # One group per uid (each uid has one prompt here), every row exactly once.
    assert len(batch.groups) == len({r["uid"] for r in rows})
    assert batch.num_samples == len(rows)
    assert sorted(layout.positions) == sorted({p for p in layout.positions})
    for row, (g, s) in zip(rows, layout.positions):
        group, sample = batch.groups[g], batch.groups[g].samples[s]
        assert group.prompt == row["prompt"]
        assert sample.tokens == row["response"]
        assert sample.weights == row["mask"] and sample.advantage == row["adv"]
        assert sample.logprobs == row["old"] and sample.ref_logprobs == row["ref"]
    # Per-row read-back of a [group][sample][token] result is the identity on the rows.
    nested = [[s.tokens for s in g.samples] for g in batch.groups]
    assert layout.per_row(nested) == [r["response"] for r in rows]


@settings(max_examples=60, deadline=None)
@given(verl_rows())
def test_padded_layout_gives_the_same_batch_as_the_rows(rows):
    seqs = [r["prompt"] + r["response"] for r in rows]
    lengths = [len(r["response"]) for r in rows]
    input_ids = pad_rows(seqs, dtype=torch.long)
    attention_mask = pad_rows([[1] * len(s) for s in seqs], dtype=torch.long)
    responses = pad_rows([r["response"] for r in rows], dtype=torch.long)
    layout = verl_padded_to_batch(
        input_ids, attention_mask, responses, pad_rows([r["mask"] for r in rows]), [r["uid"] for r in rows],
        response_lengths=lengths,
        old_log_probs=pad_rows([r["old"] for r in rows]), advantages=pad_rows([r["adv"] for r in rows]),
        ref_log_probs=pad_rows([r["ref"] for r in rows]),
    )
    expected = _from_rows(rows)
    assert layout.positions == expected.positions
    for g_got, g_want in zip(layout.batch.groups, expected.batch.groups):
        assert g_got.prompt == g_want.prompt
        for a, b in zip(g_got.samples, g_want.samples):
            assert a.tokens == b.tokens and a.weights == b.weights
            for name in ("logprobs", "advantage", "ref_logprobs"):  # float32 padding: compare as float32
                assert torch.equal(torch.tensor(getattr(a, name)), torch.tensor(getattr(b, name)))


def _verl_response_from_nested(full_rows, response_lengths):
    """verl.workers.utils.padding.response_from_nested, on lists: values[end-R-1 : end-1]."""
    return [row[len(row) - r - 1 : len(row) - 1] for row, r in zip(full_rows, response_lengths)]


@settings(max_examples=60, deadline=None)
@given(verl_rows())
def test_values_go_back_in_verls_alignment(rows):
    layout = _from_rows(rows)
    values = [[s.logprobs for s in g.samples] for g in layout.batch.groups]  # any per-token result
    full = verl_sequence_values(layout, values)
    assert [len(f) for f in full] == [len(r["prompt"]) + len(r["response"]) for r in rows]
    assert _verl_response_from_nested(full, [len(r["response"]) for r in rows]) == [r["old"] for r in rows]
    padded = verl_response_values(layout, values, width=8)
    assert padded.shape == (len(rows), 8)
    back = unpad_rows(padded, [len(r["response"]) for r in rows])
    assert all(torch.allclose(torch.tensor(b), torch.tensor(r["old"])) for b, r in zip(back, rows))


def test_response_lengths_default_to_the_last_unmasked_token():
    input_ids = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 9, 0, 0]])
    attention_mask = (input_ids != 0).long()
    responses = torch.tensor([[7, 8], [9, 0]])
    response_mask = torch.tensor([[1, 1], [1, 0]])
    layout = verl_padded_to_batch(input_ids, attention_mask, responses, response_mask, ["a", "a"])
    assert len(layout.batch.groups) == 1 and layout.batch.groups[0].prompt == [5, 6]
    assert [s.tokens for s in layout.batch.groups[0].samples] == [[7, 8], [9]]


def test_same_uid_with_different_prompts_stays_apart():
    layout = verl_to_batch([[1, 2], [1, 3], [1, 2]], [[4], [5], [6]], ["u", "u", "u"])
    assert [g.prompt for g in layout.batch.groups] == [[1, 2], [1, 3]]
    assert layout.positions == [(0, 0), (1, 0), (0, 1)]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompts": [[1]], "responses": [[2]], "uids": ["a", "b"]}, "uids"),
        ({"prompts": [[]], "responses": [[2]], "uids": ["a"]}, "prompts[0]"),
        ({"prompts": [[1]], "responses": [[]], "uids": ["a"]}, "responses[0]"),
        ({"prompts": [[1]], "responses": [[2.5]], "uids": ["a"]}, "responses[0]"),
        ({"prompts": [[1]], "responses": [[2, 3]], "uids": ["a"], "old_log_probs": [[0.1]]}, "old_log_probs[0]"),
        ({"prompts": [[1]], "responses": [[2]], "uids": ["a"], "advantages": [[0.1], [0.2]]}, "advantages"),
    ],
)
def test_bad_rows_name_the_field(kwargs, field):
    with pytest.raises(floe.InvalidInput) as info:
        verl_to_batch(kwargs.pop("prompts"), kwargs.pop("responses"), kwargs.pop("uids"), **kwargs)
    assert info.value.field == field


def test_padded_response_that_does_not_match_input_ids_is_refused():
    input_ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(floe.InvalidInput) as info:
        verl_padded_to_batch(input_ids, torch.ones_like(input_ids), torch.tensor([[7, 9]]), torch.ones(1, 2), ["a"])
    assert info.value.field == "responses[0]"
    with pytest.raises(floe.InvalidInput) as info:
        verl_padded_to_batch(input_ids, torch.tensor([[1, 0, 1, 1]]), torch.tensor([[7, 8]]), torch.ones(1, 2), ["a"])
    assert info.value.field == "attention_mask[0]"


def test_grouped_forward_matches_one_row_at_a_time(make_client):
    """The point of rebuilding groups: the policy scores each prompt once, and the log-probs
    verl gets back are the same as scoring every row on its own."""
    client = make_client()
    prompts = [[3, 4, 5, 6], [3, 4, 5, 6], [7, 8, 9], [3, 4, 5, 6], [7, 8, 9]]
    responses = [[10, 11], [12, 13, 14], [15], [16, 17], [18, 19, 20]]
    uids = ["p", "p", "q", "p", "q"]
    layout = verl_to_batch(prompts, responses, uids)
    assert [len(g.samples) for g in layout.batch.groups] == [3, 2]
    grouped = verl_sequence_values(layout, client.forward(layout.batch, temperature=0.7).logprobs)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        alone = client.forward([floe.Group(p, [floe.Sample(r)])], temperature=0.7).logprobs[0][0]
        got = _verl_response_from_nested([grouped[i]], [len(r)])[0]
        assert torch.allclose(torch.tensor(got), torch.tensor(alone), atol=1e-5)
