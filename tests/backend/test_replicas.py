"""Sampler replicas: per-prompt seeds make a split of a call across replicas invisible.

Real SamplerZones on real torch engines (tiny Qwen3); the counter-based noise is checked
against SplitMix64's published reference outputs and the engine's draws against the exact
categorical probabilities.
"""

from __future__ import annotations

import random

import pytest
import torch

import floe
from floe.backend.sampler import SamplerZone, merge_results, prompt_seeds, split_prompts
from floe.config import TorchEngineConfig
from floe.errors import InvalidInput, StateError
from floe.models import load_model, load_tokenizer
from floe.sampler import EngineSource, build_engine
from floe.sampler.noise import MASK64, derive, derive_tensor, splitmix64, splitmix64_tensor, uniforms
from floe.sampler.torch_engine import draw_tokens, filter_logits
from floe.types import SampleResult


@pytest.fixture(scope="module")
def source(tiny_model) -> EngineSource:
    return EngineSource(load_model(str(tiny_model)), str(tiny_model), load_tokenizer(str(tiny_model)))


def zone(source: EngineSource, max_batch_sequences: int = 64, seed: int = 0) -> SamplerZone:
    engine = build_engine(TorchEngineConfig(max_batch_sequences=max_batch_sequences), source)
    return SamplerZone(engine, "torch", seed)


def prompts_of(source: EngineSource, k: int) -> list[list[int]]:
    """k prompts of different lengths, so chunk-mates pad each other differently."""
    return [source.tokenizer.encode("x" * (1 + 3 * i) + f"prompt {i}") for i in range(k)]


def tokens(result: SampleResult) -> list[list[list[int]]]:
    return [[s.tokens for s in g.samples] for g in result.groups]


def logprobs(result: SampleResult) -> list[list[list[float]]]:
    return [[s.logprobs for s in g.samples] for g in result.groups]


# -- the noise ----------------------------------------------------------------------------------


def test_splitmix64_matches_the_reference_outputs_in_python_and_torch():
    # Vigna's splitmix64.c seeded 1234567: its first five outputs.
    expected = [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
                16408922859458223821]
    x, got = 1234567, []
    for _ in range(5):
        got.append(splitmix64(x))
        x = (x + 0x9E3779B97F4A7C15) & MASK64
    assert got == expected
    rng = random.Random(0)
    xs = [rng.getrandbits(63) for _ in range(2000)] + [0, 1, 2**63 - 1]
    t = torch.tensor(xs, dtype=torch.int64)
    assert [v & MASK64 for v in splitmix64_tensor(t).tolist()] == [splitmix64(x) for x in xs]
    assert derive_tensor(t, 5).tolist() == [derive(x, 5) for x in xs]
    assert derive_tensor(t, torch.arange(len(xs))).tolist() == [derive(x, i) for i, x in enumerate(xs)]
    u = uniforms(t[:50], 1000)
    assert u.dtype == torch.float64 and 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01  # 50,000 uniforms: the standard error is 0.0013


def test_draws_follow_the_filtered_categorical():
    """40,000 draws from one row of logits (temperature 0.7, top-k 6, top-p 0.9) against the
    exact probabilities of the filtered, temperature-scaled softmax: tokens outside the filter
    are never drawn and the total-variation distance is below 0.015 (its expected size at this
    many draws is about 0.005)."""
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(3)) * 2
    params = floe.SamplingParams(temperature=0.7, top_k=6, top_p=0.9)
    draws = 40_000
    keys = derive_tensor(torch.tensor([derive(99, i) for i in range(draws)]), 0)
    chosen, chosen_logp = draw_tokens(logits.expand(draws, -1), params, keys)
    exact = torch.softmax(filter_logits(logits / 0.7, 6, 0.9), dim=-1)[0].double()
    counts = torch.bincount(chosen, minlength=12).double()
    assert counts[exact == 0].sum() == 0 and (exact > 0).sum() >= 3
    tv = 0.5 * float((counts / draws - exact).abs().sum())
    assert tv < 0.015, tv
    unfiltered = torch.log_softmax(logits / 0.7, dim=-1)[0]
    # The log-probs come from the draw's one max/logsumexp pass, not log_softmax: equal to its
    # rounding (fp32), so within 1e-6 rather than bit for bit.
    torch.testing.assert_close(chosen_logp, unfiltered[chosen], rtol=0, atol=1e-6)


# -- seeds and splits ---------------------------------------------------------------------------


def test_prompt_seeds_are_deterministic_distinct_and_independent_of_the_prompt_count():
    seeds = prompt_seeds(7, 100)
    assert seeds == prompt_seeds(7, 100) and prompt_seeds(7, 10) == seeds[:10]
    assert len(set(seeds)) == 100 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [derive(7, i) for i in range(100)]
    assert not set(seeds) & set(prompt_seeds(8, 100))


def test_split_prompts_is_contiguous_balanced_and_complete():
    assert split_prompts(7, 4, 3) == [range(3), range(3, 5), range(5, 7)]
    assert split_prompts(2, 1, 4) == [range(1), range(1, 2), range(2, 2), range(2, 2)]
    for k in range(12):
        for replicas in range(1, 6):
            parts = split_prompts(k, 2, replicas)
            assert len(parts) == replicas and [i for r in parts for i in r] == list(range(k))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    for args, field in (((3, 1, 0), "replicas"), ((3, 0, 2), "n"), ((-1, 1, 2), "num_prompts")):
        with pytest.raises(InvalidInput) as e:
            split_prompts(*args)
        assert e.value.field == field


def test_a_call_split_across_replicas_gives_the_same_samples(source):
    """Prompts [0, 7) in one call equal, token for token, three replicas' calls on their parts
    with their seeds, merged, although the replicas chunk their rows differently
    (max_batch_sequences 64, 4 = one prompt per chunk, 8). Log-probs agree within 1e-5: the
    float32 forward rounds differently for different batch shapes and paddings (measured
    difference ≈ 5e-7); the draws themselves never depend on the batch."""
    prompts, n = prompts_of(source, 7), 3
    params = floe.SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, stop_at_eos=False)
    seeds = prompt_seeds(11, len(prompts))
    whole = zone(source).generate(prompts, n, params, seeds)
    replicas = [zone(source), zone(source, max_batch_sequences=4), zone(source, max_batch_sequences=8)]
    parts = [rep.generate(prompts[r.start:r.stop], n, params, seeds[r.start:r.stop])
             for rep, r in zip(replicas, split_prompts(len(prompts), n, len(replicas)), strict=True)]
    merged = merge_results(parts)
    assert [g.prompt for g in merged.groups] == prompts
    assert tokens(merged) == tokens(whole)
    assert len({tuple(map(tuple, t)) for t in tokens(whole)}) == 7  # really different samples
    flat = [lp for g in logprobs(merged) for s in g for lp in s]
    assert flat == pytest.approx([lp for g in logprobs(whole) for s in g for lp in s], abs=1e-5, rel=0)
    assert merged.num_tokens == whole.num_tokens == 7 * 3 * 12 and merged.weights_version == 0


def test_sample_is_generate_with_prompt_seeds_and_unseeded_calls_advance_the_generator(source):
    prompts = prompts_of(source, 3)
    params = floe.SamplingParams(max_tokens=8, stop_at_eos=False)
    a, b = zone(source, seed=5), zone(source, seed=123)
    seeded = a.sample(prompts, 2, floe.SamplingParams(max_tokens=8, stop_at_eos=False, seed=42))
    assert tokens(seeded) == tokens(b.generate(prompts, 2, params, prompt_seeds(42, 3)))
    assert tokens(seeded) == tokens(b.sample(prompts, 2, floe.SamplingParams(max_tokens=8, stop_at_eos=False, seed=42)))
    assert tokens(seeded) != tokens(b.generate(prompts, 2, params, prompt_seeds(43, 3)))
    # Unseeded: each call draws its call seed from the zone's generator (seeded 5), as before.
    gen = torch.Generator(device="cpu").manual_seed(5)
    for _ in range(2):
        call_seed = int(torch.randint(0, 2**62, (1,), generator=gen))
        assert tokens(a.sample(prompts, 2, params)) == tokens(b.generate(prompts, 2, params, prompt_seeds(call_seed, 3)))


def test_generate_checks_its_seeds(source):
    z = zone(source)
    prompts = prompts_of(source, 2)
    for seeds in ([1], [1, 2, 3], [1, -1], [1, 2**63], [1, 2.0]):
        with pytest.raises(InvalidInput) as e:
            z.generate(prompts, 1, floe.SamplingParams(max_tokens=2), seeds)  # type: ignore[arg-type]
        assert e.value.field == "seeds"


def test_merge_results_checks_versions_and_parts(source):
    z = zone(source)
    params = floe.SamplingParams(max_tokens=2, seed=1)
    first = z.sample([[10]], 1, params)
    z.set_version(1)
    second = z.sample([[11]], 1, params)
    with pytest.raises(StateError, match="different weights versions"):
        merge_results([first, second])
    with pytest.raises(InvalidInput) as e:
        merge_results([])
    assert e.value.field == "parts"
    one = merge_results([second])
    assert one.groups == second.groups and one.weights_version == 1


# -- streamed receive ---------------------------------------------------------------------------


def test_streamed_receive_loads_bucket_by_bucket_and_checks_completeness(source):
    z, other = zone(source), zone(source)
    new = {k: v + 0.01 for k, v in source.model.state_dict().items()}
    names = sorted(new)
    z.begin_receive()
    assert not z.weights_complete
    with pytest.raises(StateError, match="incomplete"):
        z.sample([[10]], 1, floe.SamplingParams(max_tokens=2, seed=0))
    for i in range(0, len(names), 3):  # buckets of 3 tensors
        z.receive_bucket({k: new[k] for k in names[i:i + 3]})
    held = z.end_receive()
    assert z.weights_complete and held == other.receive(new)
    assert all(torch.equal(z.engine.model.state_dict()[k], new[k]) for k in names)


def test_a_streamed_receive_that_fails_midway_leaves_the_zone_incomplete(source):
    z = zone(source)
    state = source.model.state_dict()
    names = sorted(state)
    z.begin_receive()
    z.receive_bucket({names[0]: state[names[0]] * 2})
    before = {k: v.clone() for k, v in z.engine.model.state_dict().items()}
    with pytest.raises(StateError, match="differ in tensors"):
        z.receive_bucket({"no.such.weight": state[names[1]]})
    with pytest.raises(StateError, match="differ in shape"):
        z.receive_bucket({names[1]: torch.zeros(3)})
    assert all(torch.equal(before[k], v) for k, v in z.engine.model.state_dict().items())  # nothing copied
    with pytest.raises(StateError, match="missed"):
        z.end_receive()
    assert not z.weights_complete
    with pytest.raises(StateError, match="incomplete"):
        z.sample([[10]], 1, floe.SamplingParams(max_tokens=2, seed=0))
    with pytest.raises(StateError, match="begin_receive"):
        z.receive_bucket({names[0]: state[names[0]]})
    z.receive(state)  # a full sync repairs it: complete, and once verified (set_version) it samples again
    assert z.weights_complete and not z.weights_match_version
    with pytest.raises(StateError, match="not those of its version"):
        z.sample([[10]], 1, floe.SamplingParams(max_tokens=2, seed=0))
    z.set_version(1)
    assert len(z.sample([[10]], 1, floe.SamplingParams(max_tokens=2, seed=0)).groups) == 1
