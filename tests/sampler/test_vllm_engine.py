"""vLLM-only behaviour: colocation's sleep / wake on a CPU build, and settings this
machine cannot honour. Every test carries the `vllm` marker (scripts/ci/vllm.sh runs them)."""

from __future__ import annotations

import threading

import pytest
import torch

import floe
from floe.config import VllmEngineConfig
from floe.errors import StateError
from floe.models import load_model, load_tokenizer
from floe.sampler import EngineSource, build_engine
from tests.conftest import backend_of

from .conftest import VLLM_ENGINE

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_client(engine_model, tmp_path_factory):
    client = floe.connect(floe.BackendConfig(model=str(engine_model), state_dir=str(tmp_path_factory.mktemp("s")),
                                             sampler={"engine": VLLM_ENGINE}))
    yield client
    client.close()


def test_sleep_mode_needs_cuda_and_is_refused_clearly_on_cpu(engine_model):

    source = EngineSource(load_model(str(engine_model)), str(engine_model), load_tokenizer(str(engine_model)))
    with pytest.raises(floe.InvalidInput) as e:
        build_engine(VllmEngineConfig(**{**VLLM_ENGINE, "enable_sleep_mode": True}), source)
    assert e.value.field == "config.sampler.engine.enable_sleep_mode" and "needs CUDA" in e.value.message


def test_sleep_without_sleep_mode_is_a_state_error_and_changes_nothing(vllm_client):
    engine = backend_of(vllm_client).sampler.engine
    tok = vllm_client.tokenizer()
    params = floe.SamplingParams(max_tokens=5, seed=4)
    before = vllm_client.sample([tok.encode("zz")], n=2, params=params)
    for call in (engine.sleep, engine.wake):
        with pytest.raises(StateError, match="enable_sleep_mode"):
            call()
    after = vllm_client.sample([tok.encode("zz")], n=2, params=params)
    assert [s.tokens for s in after.groups[0].samples] == [s.tokens for s in before.groups[0].samples]


def test_tensor_parallel_above_one_is_refused_before_starting(engine_model):

    source = EngineSource(load_model(str(engine_model)), str(engine_model), load_tokenizer(str(engine_model)))
    with pytest.raises(floe.InvalidInput) as e:
        build_engine(VllmEngineConfig(**{**VLLM_ENGINE, "tensor_parallel_size": 2}), source)
    assert e.value.field == "config.sampler.engine.tensor_parallel_size"


def test_temperature_below_vllms_greedy_threshold_is_refused_but_zero_is_greedy(vllm_client):
    """vLLM decodes greedily below 1e-5: such a temperature is refused (it would not be what
    was asked), while 0 is floe's greedy decoding and is served."""
    version = backend_of(vllm_client).sampler.version
    with pytest.raises(floe.InvalidInput) as e:
        vllm_client.sample([[10, 11]], n=1, params=floe.SamplingParams(max_tokens=2, temperature=1e-6))
    assert e.value.field == "params.temperature" and "temperature 0 (greedy)" in e.value.message
    assert backend_of(vllm_client).sampler.version == version
    out = vllm_client.sample([[10, 11]], n=2, params=floe.SamplingParams(max_tokens=2, temperature=0.0))
    assert [len(s.tokens) for s in out.groups[0].samples] == [2, 2] and out.temperature == 1.0


def test_prompt_plus_max_tokens_beyond_max_model_len_is_refused(vllm_client):
    with pytest.raises(floe.InvalidInput) as e:
        vllm_client.sample([[10] * 500], n=1, params=floe.SamplingParams(max_tokens=20))
    assert e.value.field == "params.max_tokens" and "max_model_len (512)" in e.value.message


def test_a_seeded_batch_larger_than_one_prefill_step_is_served(vllm_client):
    """40 prompts of 300 tokens exceed vLLM's per-step token budget (4096): with chunked
    prefill, a seeded request cut mid-prompt made vLLM rewind a CPU generator, which crashes;
    the engine prefills whole prompts on CPU. Same call twice, same tokens."""
    prompts = [[10 + i % 50] * 300 for i in range(40)]
    params = floe.SamplingParams(max_tokens=3, seed=1, stop_at_eos=False)
    a = vllm_client.sample(prompts, n=4, params=params)
    b = vllm_client.sample(prompts, n=4, params=params)
    assert a.num_tokens == 40 * 4 * 3
    assert [[s.tokens for s in g.samples] for g in a.groups] == [[s.tokens for s in g.samples] for g in b.groups]


def test_sampling_from_a_new_thread_with_other_torch_threads(vllm_client):
    """A sampler thread whose OpenMP default differs from torch's thread count (the RL loop's
    producer thread when backend.num_threads is set) samples with the engine's thread count."""
    engine = backend_of(vllm_client).sampler.engine
    before = torch.get_num_threads()
    torch.set_num_threads(1 if engine.threads > 1 else 2)
    errors: list[BaseException] = []
    results: list[floe.SampleResult] = []

    def run() -> None:
        try:
            results.append(vllm_client.sample([[10, 11, 12]], n=2, params=floe.SamplingParams(max_tokens=4, seed=1)))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        t = threading.Thread(target=run)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(before)
    assert errors == [] and len(results[0].groups[0].samples) == 2


def test_an_fp32_policy_syncs_into_a_bf16_vllm_engine(engine_model, tmp_path):
    """Issue 23 item 2 (OpenRLHF #1348): fp32 policy, vLLM at bfloat16. Every sync casts the
    published weights to bf16, so vLLM holds exactly the policy's weights rounded to bf16, the
    fingerprints verify, and samples carry the new version (before: the first sync failed its
    check after vLLM had taken the new weights, and it then served them as the old version)."""
    from floe.backend.weights import fingerprints  # noqa: PLC0415

    client = floe.connect(floe.BackendConfig(model=str(engine_model), state_dir=str(tmp_path), optimizer={"lr": 1e-2},
                                             sampler={"engine": {**VLLM_ENGINE, "dtype": "bfloat16"}}))
    try:
        backend = backend_of(client)
        assert set(backend.sampler.held_dtypes().values()) == {"bfloat16"}
        assert backend.policy.describe()["dtype"] == "float32"
        tok = client.tokenizer()
        for version in (1, 2):
            batch = [floe.Group(tok.encode("ab"), [floe.Sample(tok.encode("cde"))])]
            client.forward_backward(batch, "cross_entropy")
            client.optim_step()
            result = client.sync_weights()
            assert result.version == version
            want = {k: v.to(torch.bfloat16) for k, v in backend.policy.model.state_dict().items()}
            assert backend.sampler.engine.fingerprints() == fingerprints(want)
            assert result.bytes == sum(t.numel() * t.element_size() for t in want.values())
            out = client.sample([tok.encode("zz")], n=2, params=floe.SamplingParams(max_tokens=4, seed=3))
            assert out.weights_version == version
    finally:
        client.close()
