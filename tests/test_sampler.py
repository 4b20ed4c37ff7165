"""Sampler zone: log-prob consistency with the policy, seeds, stop conditions, versions."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import DynamicCache

import floe
from floe.models.loading import load_model
from floe.sampler.kv_cache import PreallocatedLayer, preallocated_cache
from tests.conftest import backend_of


def _train_a_little(client: floe.Client, tok) -> None:
    """Move the policy away from the sampler's initial weights."""
    prompt = tok.encode("abc")
    batch = floe.Batch([floe.Group(prompt, [floe.Sample(tok.encode("xyz"))])])
    client.forward_backward(batch, "cross_entropy")
    client.optim_step()


def test_sampler_logprobs_match_policy_after_sync(make_client):
    client = make_client(optimizer={"lr": 1e-2})
    tok = client.tokenizer()
    _train_a_little(client, tok)
    before = client.sample([tok.encode("hello")], n=2, params=floe.SamplingParams(max_tokens=8, seed=0))
    sync = client.sync_weights()
    assert sync.version == 1 and sync.bytes > 0
    prompts = [tok.encode("hello there"), tok.encode("ab"), tok.encode("a much longer prompt here")]
    for temperature in (1.0, 0.7):
        out = client.sample(prompts, n=3, params=floe.SamplingParams(max_tokens=16, temperature=temperature, seed=1))
        batch = floe.Batch([floe.Group(g.prompt, [floe.Sample(s.tokens) for s in g.samples]) for g in out.groups])
        fwd = client.forward(batch, temperature=temperature)
        diffs = [
            abs(a - b)
            for g, fg in zip(out.groups, fwd.logprobs)
            for s, fs in zip(g.samples, fg)
            for a, b in zip(s.logprobs, fs)
        ]
        assert len(diffs) == out.num_tokens > 0
        assert max(diffs) < 1e-4
        assert all(s.weights_version == 1 for g in out.groups for s in g.samples)
        assert all(s.temperature == temperature for g in out.groups for s in g.samples) and out.temperature == temperature
    assert all(s.weights_version == 0 for g in before.groups for s in g.samples)


def test_stale_sampler_differs_from_policy(make_client):
    """Without sync the sampler keeps the old weights: its log-probs differ from the policy's."""
    client = make_client(optimizer={"lr": 1e-2})
    tok = client.tokenizer()
    _train_a_little(client, tok)
    out = client.sample([tok.encode("hello")], n=2, params=floe.SamplingParams(max_tokens=12, seed=2))
    batch = floe.Batch([floe.Group(g.prompt, [floe.Sample(s.tokens) for s in g.samples]) for g in out.groups])
    fwd = client.forward(batch)
    diffs = [abs(a - b) for s, fs in zip(out.groups[0].samples, fwd.logprobs[0]) for a, b in zip(s.logprobs, fs)]
    assert max(diffs) > 1e-3


def test_seeded_sampling_is_reproducible(make_client):
    client = make_client()
    tok = client.tokenizer()
    params = floe.SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=123)
    prompts = [tok.encode("seed test"), tok.encode("x")]
    a = client.sample(prompts, n=4, params=params)
    b = client.sample(prompts, n=4, params=params)
    c = client.sample(prompts, n=4, params=floe.SamplingParams(max_tokens=20, seed=124))
    toks = lambda r: [[s.tokens for s in g.samples] for g in r.groups]
    assert toks(a) == toks(b)
    assert toks(a) != toks(c)
    # Samples within a group differ (they are independent draws sharing one prefill).
    assert len({tuple(s.tokens) for s in a.groups[0].samples}) > 1


def test_max_tokens_stop_tokens_and_stop_strings(make_client):
    client = make_client()
    tok = client.tokenizer()
    prompt = tok.encode("stop test")
    out = client.sample([prompt], n=6, params=floe.SamplingParams(max_tokens=7, seed=3, stop_at_eos=False))
    for s in out.groups[0].samples:
        assert len(s.tokens) == 7 and s.stop_reason == "length"
    # Stop on any of a few frequent tokens: every sample ends exactly at its first one.
    first = out.groups[0].samples[0].tokens
    stops = sorted(set(first[:3]))
    out = client.sample([prompt], n=6, params=floe.SamplingParams(max_tokens=40, seed=3, stop_token_ids=stops, stop_at_eos=False))
    for s in out.groups[0].samples:
        hits = [i for i, t in enumerate(s.tokens) if t in stops]
        if s.stop_reason == "stop_token":
            assert hits == [len(s.tokens) - 1]
        else:
            assert s.stop_reason == "length" and not hits and len(s.tokens) == 40
    assert any(s.stop_reason == "stop_token" for s in out.groups[0].samples)
    # Stop strings are matched on decoded text; generation ends at the token completing it.
    letters = [tok.decode([t]) for t in first[:2]]
    stop_string = letters[0]
    out = client.sample([prompt], n=6, params=floe.SamplingParams(max_tokens=40, seed=3, stop=[stop_string], stop_at_eos=False))
    for s in out.groups[0].samples:
        text = tok.decode(s.tokens)
        if s.stop_reason == "stop_string":
            # the token completing the stop string ends the sample (a special token like "<unk>" may
            # complete "k" without ending the text with it)
            assert stop_string in text and stop_string not in tok.decode(s.tokens[:-1])
        else:
            assert stop_string not in text
    assert any(s.stop_reason == "stop_string" for s in out.groups[0].samples)


def test_top_k_one_is_greedy(make_client):
    client = make_client()
    tok = client.tokenizer()
    prompt = tok.encode("greedy")
    out = client.sample([prompt], n=3, params=floe.SamplingParams(max_tokens=10, top_k=1, seed=9, stop_at_eos=False))
    seqs = {tuple(s.tokens) for s in out.groups[0].samples}
    assert len(seqs) == 1
    model = backend_of(client).sampler.model
    import torch

    ids = list(prompt)
    for t in out.groups[0].samples[0].tokens:
        with torch.no_grad():
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        assert nxt == t
        ids.append(t)


def test_temperature_zero_is_greedy_with_temperature_one_logprobs(make_client):
    """SamplingParams(temperature=0) decodes the argmax chain whatever the seed, records
    temperature 1.0, and reports the temperature-1 log-probs that forward(temperature=1) gives;
    the tokens are those of top_k=1 at temperature 1 (how the OpenAI endpoint mapped 0)."""
    client = make_client()
    tok = client.tokenizer()
    prompts = [tok.encode("greedy"), tok.encode("a longer greedy prompt")]
    greedy = floe.SamplingParams(max_tokens=10, temperature=0.0, stop_at_eos=False)
    out = client.sample(prompts, n=3, params=greedy)
    again = client.sample(prompts, n=1, params=floe.SamplingParams(max_tokens=10, temperature=0, seed=5, top_p=0.5, stop_at_eos=False))
    for g, h in zip(out.groups, again.groups):
        assert len({tuple(s.tokens) for s in g.samples}) == 1 and g.samples[0].tokens == h.samples[0].tokens
    assert out.temperature == 1.0 and all(s.temperature == 1.0 for g in out.groups for s in g.samples)
    model = backend_of(client).sampler.model
    ids = list(prompts[0])
    for t in out.groups[0].samples[0].tokens:
        with torch.no_grad():
            assert int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()) == t
        ids.append(t)
    batch = floe.Batch([floe.Group(g.prompt, [floe.Sample(s.tokens) for s in g.samples]) for g in out.groups])
    fwd = client.forward(batch, temperature=1.0)
    diffs = [abs(a - b) for g, fg in zip(out.groups, fwd.logprobs) for s, fs in zip(g.samples, fg) for a, b in zip(s.logprobs, fs)]
    assert len(diffs) == out.num_tokens == 60 and max(diffs) < 1e-4
    top1 = client.sample(prompts, n=1, params=floe.SamplingParams(max_tokens=10, top_k=1, seed=1, stop_at_eos=False))
    assert [g.samples[0].tokens for g in top1.groups] == [g.samples[0].tokens for g in out.groups]
    for g, t in zip(out.groups, top1.groups):
        assert max(abs(a - b) for a, b in zip(g.samples[0].logprobs, t.samples[0].logprobs)) < 1e-6


def test_preallocated_cache_matches_dynamic_cache(tiny_model):
    """Prefill, repeat per sample, decode, drop rows, decode: same logits as transformers' DynamicCache."""
    torch.manual_seed(0)
    model = load_model(str(tiny_model)).eval()
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.randint(3, model.config.vocab_size, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    n, steps = 3, 5
    runs = []
    for cache in (DynamicCache(config=model.config), preallocated_cache(model.config, capacity=6 + steps)):
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{kw: cache})
            cache.batch_repeat_interleave(n)
            m, pos = mask.repeat_interleave(n, 0), positions[:, -1:].repeat_interleave(n, 0) + 1
            logits = [out.logits[:, -1].repeat_interleave(n, 0)]
            tok = torch.arange(2 * n).unsqueeze(-1) + 5
            for step in range(steps):
                if step == 2:  # rows 0, 3 and 4 finished
                    keep = torch.tensor([1, 2, 5])
                    cache.batch_select_indices(keep)
                    m, pos, tok = m[keep], pos[keep], tok[keep]
                m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
                out = model(input_ids=tok, attention_mask=m, position_ids=pos, use_cache=True, **{kw: cache})
                logits.append(out.logits[:, -1])
                pos, tok = pos + 1, tok + 1
        runs.append(logits)
    assert all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 6 + steps
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_cache_capacity_is_enforced():
    layer = PreallocatedLayer(capacity=4)
    layer.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
    layer.update(torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8))
    assert layer.get_seq_length() == 4 and layer.keys[0, 0, -1, 0] == 1
    with pytest.raises(RuntimeError, match="capacity"):
        layer.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
