"""One conformance suite for every sampler engine (floe.sampler.engine's contract), run on the
torch engine in the core suite and on vLLM under the `vllm` marker.

Reference values come from the policy's own model in the same backend (its weights equal the
sampler's until a test trains; the training test syncs before it compares)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import floe
from tests.conftest import backend_of


def _tokens(result: floe.SampleResult) -> list[list[list[int]]]:
    return [[s.tokens for s in g.samples] for g in result.groups]


def _policy_logits(client: floe.Client, ids: list[int]) -> torch.Tensor:
    """The policy's next-token logits (float32) after `ids`."""
    model = backend_of(client).policy.model
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def test_seeded_sampling_is_reproducible(engine_client):
    tok = engine_client.tokenizer()
    prompts = [tok.encode("seed test"), tok.encode("x"), tok.encode("seed test")]
    params = floe.SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, top_k=40, seed=123, stop_at_eos=False)
    a = engine_client.sample(prompts, n=4, params=params)
    b = engine_client.sample(prompts, n=4, params=params)
    c = engine_client.sample(prompts, n=4, params=floe.SamplingParams(max_tokens=16, seed=124, stop_at_eos=False))
    assert _tokens(a) == _tokens(b)
    assert [[s.logprobs for s in g.samples] for g in a.groups] == [[s.logprobs for s in g.samples] for g in b.groups]
    assert _tokens(a) != _tokens(c)
    # Independent draws: samples of a group differ, and so do two groups with the same prompt.
    assert len({tuple(t) for t in _tokens(a)[0]}) > 1
    assert _tokens(a)[0] != _tokens(a)[2]


def test_a_call_split_in_parts_with_their_prompt_seeds_gives_the_same_samples(engine_client):
    """Per-prompt seeds (the replica contract): the parts of a call, each with its prompts'
    seeds, give the whole call's tokens; log-probs agree within 1e-5 (the forward's float
    rounding may depend on the batch)."""
    from floe.backend.sampler import merge_results, prompt_seeds, split_prompts

    tok = engine_client.tokenizer()
    sampler = backend_of(engine_client).sampler
    prompts = [tok.encode(f"split {'x' * i}") for i in range(5)]
    params = floe.SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, stop_at_eos=False)
    seeds = prompt_seeds(77, len(prompts))
    whole = sampler.generate(prompts, 3, params, seeds)
    merged = merge_results([sampler.generate(prompts[r.start:r.stop], 3, params, seeds[r.start:r.stop])
                            for r in split_prompts(len(prompts), 3, 2)])
    assert _tokens(merged) == _tokens(whole)
    assert _tokens(whole) == _tokens(engine_client.sample(prompts, n=3, params=replace(params, seed=77)))
    flat = [(a, b) for gw, gm in zip(whole.groups, merged.groups) for sw, sm in zip(gw.samples, gm.samples)
            for a, b in zip(sw.logprobs, sm.logprobs)]
    assert max(abs(a - b) for a, b in flat) <= 1e-5


def test_weights_received_bucket_by_bucket(engine_client):
    """A streamed receive (buckets of a few tensors, as a cross-process broadcast delivers
    them) leaves the engine holding exactly the sent weights; a missing tensor is caught at
    the end and the sampler refuses to sample until a full sync."""
    from floe.backend.sync.base import fingerprints
    from floe.backend.sync.broadcast import bucketed

    backend = backend_of(engine_client)
    sampler, snapshot = backend.sampler, backend.policy.publish()
    new = {k: v * 1.01 for k, v in snapshot.tensors.items()}
    try:
        sampler.begin_receive()
        buckets = list(bucketed(new.items(), 20_000))
        assert len(buckets) > 3
        for bucket in buckets:
            sampler.receive_bucket(bucket)
        assert sampler.end_receive() == fingerprints(new) and sampler.weights_complete
        sampler.begin_receive()
        for bucket in buckets[1:]:
            sampler.receive_bucket(bucket)
        with pytest.raises(floe.StateError, match="missed"):
            sampler.end_receive()
        with pytest.raises(floe.StateError, match="incomplete"):
            engine_client.sample([[10, 11]], n=1, params=floe.SamplingParams(max_tokens=2, seed=0))
    finally:
        assert sampler.receive(snapshot.tensors) == snapshot.fingerprints  # back to the policy's weights,
        sampler.set_version(sampler.version)  # verified (what the Backend does after such a check)
    assert len(engine_client.sample([[10, 11]], n=1, params=floe.SamplingParams(max_tokens=2, seed=0)).groups) == 1


def test_n_samples_per_prompt_in_order(engine_client):
    tok = engine_client.tokenizer()
    prompts = [tok.encode("one"), tok.encode("a longer second prompt"), tok.encode("3")]
    out = engine_client.sample(prompts, n=5, params=floe.SamplingParams(max_tokens=6, seed=5))
    assert [g.prompt for g in out.groups] == prompts
    assert [len(g.samples) for g in out.groups] == [5, 5, 5]
    assert all(len(s.tokens) == len(s.logprobs) >= 1 for g in out.groups for s in g.samples)
    assert all(s.weights_version == out.weights_version for g in out.groups for s in g.samples)
    assert out.num_tokens == sum(len(s.tokens) for g in out.groups for s in g.samples)


def test_max_tokens(engine_client):
    tok = engine_client.tokenizer()
    out = engine_client.sample([tok.encode("length test")], n=4,
                               params=floe.SamplingParams(max_tokens=7, seed=3, stop_at_eos=False))
    assert all(len(s.tokens) == 7 and s.stop_reason == "length" for s in out.groups[0].samples)
    one = engine_client.sample([tok.encode("length test")], n=1,
                               params=floe.SamplingParams(max_tokens=1, seed=3, stop_at_eos=False))
    assert len(one.groups[0].samples[0].tokens) == 1


def test_stop_tokens_and_stop_strings_end_with_the_stopping_token(engine_client):
    """A stop token, or the token completing a stop string, is the sample's last token."""
    tok = engine_client.tokenizer()
    prompt = tok.encode("stop test")
    greedy = floe.SamplingParams(max_tokens=24, temperature=1.0, top_k=1, stop_at_eos=False, seed=0)
    (free,) = engine_client.sample([prompt], n=1, params=greedy).groups
    tokens = free.samples[0].tokens
    assert len(tokens) == 24
    # A printable single-character token from the middle of the free run.
    pick = next(t for t in tokens[3:] if len(tok.decode([t])) == 1 and tok.decode([t]).strip())
    first = tokens.index(pick)

    by_id = replace(greedy, stop_token_ids=[pick])
    (s,) = engine_client.sample([prompt], n=1, params=by_id).groups[0].samples
    assert s.tokens == tokens[: first + 1] and s.stop_reason == "stop_token"

    by_string = replace(greedy, stop=[tok.decode([pick])])
    (s,) = engine_client.sample([prompt], n=1, params=by_string).groups[0].samples
    assert s.tokens == tokens[: first + 1] and s.stop_reason == "stop_string"

    # Two characters spanning two tokens: the second one completes the string.
    pair = tok.decode(tokens[first + 1 : first + 3])
    start = next(i for i in range(len(tokens) - 1) if tok.decode(tokens[i : i + 2]) == pair)
    by_pair = replace(greedy, stop=[pair])
    (s,) = engine_client.sample([prompt], n=1, params=by_pair).groups[0].samples
    assert s.tokens == tokens[: start + 2] and s.stop_reason == "stop_string"

    # stop_at_eos: the tokenizer's eos is a stop token (the sample ends with it, included).
    eos = tok.eos_token_id
    with_eos = engine_client.sample([prompt], n=8, params=floe.SamplingParams(max_tokens=40, seed=9))
    for s in with_eos.groups[0].samples:
        assert eos not in s.tokens[:-1]
        assert (s.stop_reason == "stop_token") == (s.tokens[-1] == eos)


def test_top_k_and_top_p_keep_samples_inside_the_filter(engine_client):
    """Every token lies in the top-k / nucleus of the policy's temperature-scaled distribution;
    log-probs are of the distribution before the filter (so not 0 for top_k=1)."""
    tok = engine_client.tokenizer()
    prompt = tok.encode("filters")
    cases = [
        floe.SamplingParams(max_tokens=10, temperature=0.8, top_k=1, seed=1, stop_at_eos=False),
        floe.SamplingParams(max_tokens=10, temperature=0.8, top_k=3, seed=2, stop_at_eos=False),
        floe.SamplingParams(max_tokens=10, temperature=1.2, top_p=0.3, seed=3, stop_at_eos=False),
    ]
    for params in cases:
        out = engine_client.sample([prompt], n=3, params=params)
        for s in out.groups[0].samples:
            ids = list(prompt)
            for token, logp in zip(s.tokens, s.logprobs):
                scaled = _policy_logits(engine_client, ids) / params.temperature
                logp_all = torch.log_softmax(scaled, dim=-1)
                assert logp == pytest.approx(float(logp_all[token]), abs=1e-4)
                if params.top_k:
                    assert int((scaled > scaled[token]).sum()) < params.top_k
                if params.top_p < 1.0:
                    probs = logp_all.exp()
                    mass_before = float(probs[probs > probs[token]].sum())
                    assert mass_before < params.top_p + 1e-4
                ids.append(token)
        if params.top_k == 1:
            assert len({tuple(s.tokens) for s in out.groups[0].samples}) == 1  # greedy
            assert max(lp for s in out.groups[0].samples for lp in s.logprobs) < -1e-4


def test_logprobs_agree_with_the_policy_after_training_and_syncs(engine_client):
    """Three rounds of forward_backward + optim_step + sync_weights; then sampler log-probs
    equal the policy's forward(temperature) within 1e-4 (fp32) at temperatures 0.7 and 1.0."""
    tok = engine_client.tokenizer()
    backend = backend_of(engine_client)
    start_version = backend.sampler.version
    prompts = [tok.encode("hello there"), tok.encode("ab"), tok.encode("a much longer prompt here")]
    before = engine_client.sample(prompts, n=2, params=floe.SamplingParams(max_tokens=8, seed=0))
    for round_ in range(3):
        batch = floe.Batch([floe.Group(tok.encode("abc"), [floe.Sample(tok.encode(f"xyz{round_}"))])])
        engine_client.forward_backward(batch, "cross_entropy")
        engine_client.optim_step()
        sync = engine_client.sync_weights()  # verified by fingerprints of what the engine holds
        assert sync.version == start_version + round_ + 1 and sync.bytes > 0
    for temperature, top_p in ((0.7, 0.9), (1.0, 1.0)):
        params = floe.SamplingParams(max_tokens=16, temperature=temperature, top_p=top_p, seed=1, stop_at_eos=False)
        out = engine_client.sample(prompts, n=3, params=params)
        batch = floe.Batch([floe.Group(g.prompt, [floe.Sample(s.tokens) for s in g.samples]) for g in out.groups])
        fwd = engine_client.forward(batch, temperature=temperature)
        diffs = [abs(a - b) for g, fg in zip(out.groups, fwd.logprobs) for s, fs in zip(g.samples, fg)
                 for a, b in zip(s.logprobs, fs)]
        assert len(diffs) == out.num_tokens > 0
        assert max(diffs) < 1e-4
        assert {s.weights_version for g in out.groups for s in g.samples} == {start_version + 3}
    # The old samples came from other weights: their log-probs no longer match.
    batch = floe.Batch([floe.Group(g.prompt, [floe.Sample(s.tokens) for s in g.samples]) for g in before.groups])
    fwd = engine_client.forward(batch)
    stale = [abs(a - b) for g, fg in zip(before.groups, fwd.logprobs) for s, fs in zip(g.samples, fg)
             for a, b in zip(s.logprobs, fs)]
    assert max(stale) > 1e-3


def test_info_reports_the_engine_and_its_start_time(engine_client):
    caps = engine_client.info().capabilities
    assert caps["sampler_engine"] == backend_of(engine_client).config.sampler.engine.name
    assert isinstance(caps["sampler_engine_start_seconds"], float) and caps["sampler_engine_start_seconds"] > 0


def test_greedy_is_the_argmax_with_temperature_one_logprobs(engine_client):
    """temperature=0: every token is the policy's argmax (n equal samples; the seed changes
    nothing), log-probs are those of the temperature-1 distribution, and every sample records
    temperature 1.0; a sampled call records its own temperature."""
    tok = engine_client.tokenizer()
    prompts = [tok.encode("greedy"), tok.encode("a second prompt")]
    greedy = floe.SamplingParams(max_tokens=12, temperature=0.0, stop_at_eos=False, seed=1)
    out = engine_client.sample(prompts, n=3, params=greedy)
    again = engine_client.sample(prompts, n=3, params=replace(greedy, seed=2, top_k=5, top_p=0.5))
    assert _tokens(again) == _tokens(out)
    assert out.temperature == 1.0
    for prompt, group in zip(prompts, out.groups):
        assert len(group.samples) == 3 and len({tuple(s.tokens) for s in group.samples}) == 1
        s = group.samples[0]
        assert len(s.tokens) == 12 and s.stop_reason == "length" and s.temperature == 1.0
        ids = list(prompt)
        for token, logp in zip(s.tokens, s.logprobs):
            logits = _policy_logits(engine_client, ids)
            assert token == int(logits.argmax())
            assert logp == pytest.approx(float(torch.log_softmax(logits, dim=-1)[token]), abs=1e-4)
            ids.append(token)
    # The samples carry their temperature into forward: scoring them as they are agrees.
    batch = floe.Batch([floe.Group(g.prompt, [floe.Sample(s.tokens, temperature=s.temperature) for s in g.samples])
                        for g in out.groups])
    fwd = engine_client.forward(batch)
    assert max(abs(a - b) for g, fg in zip(out.groups, fwd.logprobs) for s, fs in zip(g.samples, fg)
               for a, b in zip(s.logprobs, fs)) < 1e-4
    sampled = engine_client.sample(prompts, n=2, params=floe.SamplingParams(max_tokens=3, temperature=0.7, seed=1))
    assert sampled.temperature == 0.7 and all(s.temperature == 0.7 for g in sampled.groups for s in g.samples)


def test_top_logprobs_are_the_policys_most_likely_tokens(engine_client):
    """top_logprobs=k: per token, the k most likely (id, log-prob) of the distribution the
    sample's log-probs are from (temperature-scaled, before top-k/top-p; temperature 1 when
    greedy), most likely first; asking for them changes no draw."""
    tok = engine_client.tokenizer()
    prompt = tok.encode("alternatives")
    for params in (floe.SamplingParams(max_tokens=6, temperature=0.8, top_k=4, seed=7, stop_at_eos=False),
                   floe.SamplingParams(max_tokens=6, temperature=0.0, stop_at_eos=False)):
        out = engine_client.sample([prompt], n=2, params=replace(params, top_logprobs=5))
        plain = engine_client.sample([prompt], n=2, params=params)
        assert _tokens(out) == _tokens(plain)
        assert all(s.top_logprobs is None for s in plain.groups[0].samples)
        temperature = params.temperature or 1.0
        for s in out.groups[0].samples:
            assert len(s.top_logprobs) == len(s.tokens)
            ids = list(prompt)
            for token, logp, tops in zip(s.tokens, s.logprobs, s.top_logprobs):
                expected = torch.log_softmax(_policy_logits(engine_client, ids) / temperature, dim=-1)
                values, best = torch.topk(expected, 5)
                assert [t for t, _ in tops] == best.tolist()
                assert [v for _, v in tops] == pytest.approx(values.tolist(), abs=1e-4)
                if token in dict(tops):
                    assert dict(tops)[token] == pytest.approx(logp, abs=1e-6)
                ids.append(token)
