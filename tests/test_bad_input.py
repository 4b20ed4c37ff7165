"""Every bad input raises InvalidInput naming the field, and leaves all state unchanged."""

from __future__ import annotations

import math

import pytest

import floe
from tests.conftest import assert_same_state, state_snapshot


def good_batch(tok) -> floe.Batch:
    return floe.Batch([
        floe.Group(tok.encode("abc"), [
            floe.Sample(tok.encode("xy"), logprobs=[-1.0, -2.0], advantage=1.0, weights=[1.0, 1.0], ref_logprobs=[-1.0, -1.5]),
            floe.Sample(tok.encode("z"), logprobs=[-1.0], advantage=[0.5]),
        ])
    ])


def mutate(tok, fn) -> floe.Batch:
    b = good_batch(tok)
    fn(b)
    return b


CASES = [
    # (description, mutation, loss, loss_config, expected field)
    ("token id too large", lambda b: b.groups[0].samples[0].tokens.__setitem__(0, 10**6), "ppo", {}, "batch.groups[0].samples[0].tokens"),
    ("negative prompt token", lambda b: b.groups[0].prompt.__setitem__(1, -3), "ppo", {}, "batch.groups[0].prompt"),
    ("float token", lambda b: b.groups[0].prompt.__setitem__(0, 1.5), "ppo", {}, "batch.groups[0].prompt"),
    ("empty groups", lambda b: b.groups.clear(), "ppo", {}, "batch.groups"),
    ("empty samples", lambda b: b.groups[0].samples.clear(), "ppo", {}, "batch.groups[0].samples"),
    ("empty sample tokens", lambda b: b.groups[0].samples[1].tokens.clear(), "ppo", {}, "batch.groups[0].samples[1].tokens"),
    ("empty prompt", lambda b: b.groups[0].prompt.clear(), "ppo", {}, "batch.groups[0].prompt"),
    ("logprobs length", lambda b: b.groups[0].samples[0].logprobs.append(-1.0), "ppo", {}, "batch.groups[0].samples[0].logprobs"),
    ("weights length", lambda b: setattr(b.groups[0].samples[0], "weights", [1.0]), "ppo", {}, "batch.groups[0].samples[0].weights"),
    ("negative weight", lambda b: setattr(b.groups[0].samples[0], "weights", [1.0, -1.0]), "ppo", {}, "batch.groups[0].samples[0].weights"),
    ("nan advantage", lambda b: setattr(b.groups[0].samples[0], "advantage", math.nan), "ppo", {}, "batch.groups[0].samples[0].advantage"),
    ("inf per-token advantage", lambda b: b.groups[0].samples[1].advantage.__setitem__(0, math.inf), "ppo", {}, "batch.groups[0].samples[1].advantage[0]"),
    ("nan logprob", lambda b: b.groups[0].samples[0].logprobs.__setitem__(1, math.nan), "ppo", {}, "batch.groups[0].samples[0].logprobs[1]"),
    ("positive logprobs", lambda b: setattr(b.groups[0].samples[1], "logprobs", [1.0]), "ppo", {}, "batch.groups[0].samples[1].logprobs[0]"),
    ("logprob just past the tolerance", lambda b: b.groups[0].samples[0].logprobs.__setitem__(1, 2e-4), "ppo", {}, "batch.groups[0].samples[0].logprobs[1]"),
    ("positive ref logprob", lambda b: b.groups[0].samples[0].ref_logprobs.__setitem__(1, 0.5), "ppo", {"kl": {"coef": 0.1}}, "batch.groups[0].samples[0].ref_logprobs[1]"),
    ("huge int advantage", lambda b: setattr(b.groups[0].samples[0], "advantage", 10**400), "ppo", {}, "batch.groups[0].samples[0].advantage"),
    ("missing logprobs for ppo", lambda b: setattr(b.groups[0].samples[1], "logprobs", None), "ppo", {}, "batch.groups[0].samples[1].logprobs"),
    ("missing advantage", lambda b: setattr(b.groups[0].samples[1], "advantage", None), "importance_sampling", {}, "batch.groups[0].samples[1].advantage"),
    ("kl without ref logprobs", lambda b: None, "ppo", {"kl": {"coef": 0.1}}, "batch.groups[0].samples[1].ref_logprobs"),
    ("too long for context", lambda b: setattr(b.groups[0].samples[0], "tokens", [10] * 5000), "cross_entropy", {}, "batch.groups[0].samples[0].tokens"),
    ("unknown loss", lambda b: None, "grpo", {}, "loss"),
    ("unknown config key", lambda b: None, "ppo", {"clip_ratio": 0.2}, "loss_config.clip_ratio"),
    ("unknown nested key", lambda b: None, "ppo", {"kl": {"beta": 0.1}}, "loss_config.kl.beta"),
    ("bad aggregation", lambda b: None, "ppo", {"aggregation": "mean"}, "loss_config.aggregation"),
    ("dual clip <= 1", lambda b: None, "ppo", {"dual_clip": 0.5}, "loss_config.dual_clip"),
    ("cispo has no dual clip", lambda b: None, "cispo", {"dual_clip": 3.0}, "loss_config.dual_clip"),
    ("norm_length with token_mean", lambda b: None, "ppo", {"norm_length": 10}, "loss_config"),
    ("advantage given to cross_entropy", lambda b: None, "cross_entropy", {}, "batch.groups[0].samples[0].advantage"),
]


@pytest.mark.parametrize("desc,fn,loss,cfg,field", CASES, ids=[c[0] for c in CASES])
def test_forward_backward_rejects_and_changes_nothing(make_client, desc, fn, loss, cfg, field):
    client = make_client()
    tok = client.tokenizer()
    # Leave some accumulated gradient in place: a rejected call must not touch it either.
    client.forward_backward(good_batch(tok), "ppo")
    before = state_snapshot(client)
    with pytest.raises(floe.InvalidInput) as err:
        client.forward_backward(mutate(tok, fn), loss, cfg)
    assert err.value.field == field, str(err.value)
    assert_same_state(before, state_snapshot(client))


def test_sample_and_forward_reject_bad_input(make_client):
    client = make_client()
    tok = client.tokenizer()
    before = state_snapshot(client)
    bad_calls = [
        (lambda: client.sample([], n=1), "prompts"),
        (lambda: client.sample([[10**6]], n=1), "prompts[0]"),
        (lambda: client.sample([tok.encode("a")], n=0), "n"),
        (lambda: client.sample([tok.encode("a")], params=floe.SamplingParams(temperature=-0.5)), "params.temperature"),
        (lambda: client.sample([tok.encode("a")], params=floe.SamplingParams(top_p=1.5)), "params.top_p"),
        (lambda: client.sample([tok.encode("a")], params=floe.SamplingParams(top_k=-1)), "params.top_k"),
        (lambda: client.sample([tok.encode("a")], params=floe.SamplingParams(max_tokens=0)), "params.max_tokens"),
        (lambda: client.sample([tok.encode("a")], params=floe.SamplingParams(max_tokens=5000)), "params.max_tokens"),
        (lambda: client.sample([tok.encode("a")], params=floe.SamplingParams(stop_token_ids=[999])), "params.stop_token_ids"),
        (lambda: client.sample([tok.encode("a")], params=floe.SamplingParams(stop=[""])), "params.stop"),
        (lambda: client.sample([tok.encode("a")], n=1000), "n"),
        (lambda: client.sample([[5]], n=2**70), "n"),
        (lambda: client.sample([[5]], params=floe.SamplingParams(max_tokens=2, seed=2**70)), "params.seed"),
        (lambda: client.sample([[5]], params=floe.SamplingParams(max_tokens=2, seed=2**63)), "params.seed"),
        (lambda: client.sample([[5]], params=floe.SamplingParams(max_tokens=2, seed=-1)), "params.seed"),
        (lambda: client.sample([[5]], params=floe.SamplingParams(max_tokens=2, top_k=2**70)), "params.top_k"),
        (lambda: client.sample([[5]], params=floe.SamplingParams(max_tokens=2**70)), "params.max_tokens"),
        (lambda: client.sample([[5]], params=floe.SamplingParams(max_tokens=2, stop_token_ids=[2**70])), "params.stop_token_ids"),
        (lambda: client.sample([[5]], params=floe.SamplingParams(max_tokens=2, top_logprobs=2**70)), "params.top_logprobs"),
        (lambda: client.sample([[5]], params=floe.SamplingParams(max_tokens=2, temperature=10**400)), "params.temperature"),
        (lambda: client.sample([[5, 2**70]]), "prompts[0]"),
        # a prompt that alone fills the context is the prompt's fault, not max_tokens'
        (lambda: client.sample([[5] * 1100], params=floe.SamplingParams(max_tokens=2)), "prompts[0]"),
        (lambda: client.sample([[5], [5] * 1024], params=floe.SamplingParams(max_tokens=2)), "prompts[1]"),
        (lambda: client.sample([[5] * 1023], params=floe.SamplingParams(max_tokens=2)), "params.max_tokens"),
        (lambda: client.sample([tok.encode("a")], params=floe.SamplingParams(stop_at_eos="no")), "params.stop_at_eos"),
        (lambda: client.forward(good_batch(tok), with_entropy="false"), "with_entropy"),
        (lambda: client.forward(good_batch(tok), zone="critic"), "zone"),
        (lambda: client.forward(good_batch(tok), temperature=-1.0), "temperature"),
        (lambda: client.forward(mutate(tok, lambda b: b.groups[0].samples.clear())), "batch.groups[0].samples"),
        (lambda: client.forward("not a batch"), "batch"),
    ]
    for call, field in bad_calls:
        with pytest.raises(floe.InvalidInput) as err:
            call()
        assert err.value.field == field, str(err.value)
    assert_same_state(before, state_snapshot(client))


def test_errors_say_how_to_fix(make_client):
    client = make_client()
    tok = client.tokenizer()
    with pytest.raises(floe.InvalidInput, match="choose one of") as err:
        client.forward_backward(good_batch(tok), "grpo")
    with pytest.raises(floe.InvalidInput, match=r"outside the vocabulary \[0, 105\)"):
        client.forward_backward(mutate(tok, lambda b: b.groups[0].samples[0].tokens.__setitem__(0, 999)), "ppo")
    with pytest.raises(floe.InvalidInput, match="zone='reference'"):
        client.forward_backward(mutate(tok, lambda b: setattr(b.groups[0].samples[0], "ref_logprobs", None)), "ppo", {"kl": {"coef": 1.0}})
    assert "unknown key" in str(err.value) or "choose" in str(err.value)


def test_integer_fields_at_their_bounds_are_accepted(make_client):
    """The largest seed and a top_k past the vocabulary sample; the same seed repeats its tokens;
    a prompt one token short of the context still gets its one token."""
    client = make_client()
    top = floe.SamplingParams(max_tokens=3, seed=2**63 - 1, top_k=2**31 - 1)
    a, b = client.sample([[5]], params=top), client.sample([[5]], params=top)
    assert a.groups[0].samples[0].tokens == b.groups[0].samples[0].tokens
    assert len(client.sample([[5]], params=floe.SamplingParams(max_tokens=3, seed=0)).groups[0].samples[0].tokens) >= 1
    long = client.sample([[5] * 1023], params=floe.SamplingParams(max_tokens=1, seed=1))
    assert len(long.groups[0].samples[0].tokens) == 1


def test_logprobs_within_float_noise_of_zero_are_accepted(make_client):
    """A log-prob of a token with probability ~1 can round a hair above 0: up to 1e-4 passes."""
    client = make_client()
    tok = client.tokenizer()
    batch = mutate(tok, lambda b: b.groups[0].samples[0].logprobs.__setitem__(0, 5e-5))
    out = client.forward_backward(batch, "ppo")
    assert out.loss == "ppo" and math.isfinite(out.metrics["loss"])
