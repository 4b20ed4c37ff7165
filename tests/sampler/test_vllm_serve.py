"""The OpenAI-compatible endpoints of a real `floe serve` whose sampler is the vLLM engine,
driven by the real `openai` SDK: tokens, log-probs and top alternatives agree with the
policy's own forward pass (read through floe's client on the same server). `vllm` marker."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

import floe
from tests.server.conftest import ServerProcess, free_port

pytestmark = pytest.mark.vllm

TOKEN = "vllm-serve-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, engine_model: Path) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("vllm-serve")
    config = tmp / "serve.toml"
    config.write_text(
        f'[backend]\nmodel = "{engine_model}"\nstate_dir = "{tmp / "states"}"\nseed = 0\n\n'
        '[backend.sampler.engine]\nname = "vllm"\nenforce_eager = true\nkv_cache_memory_gib = 0.25\n'
        "max_model_len = 512\n\n[server]\n"
    )
    proc = ServerProcess(config, free_port(), tmp / "server.log", token=TOKEN).wait_ready(timeout=600)
    yield proc
    proc.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def sdk(server: ServerProcess) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=TOKEN, max_retries=0, timeout=300)
    yield client
    client.close()


@pytest.fixture(scope="module")
def native(server: ServerProcess) -> Iterator[floe.Client]:
    client = server.client(timeout=300)
    yield client
    client.close()


def _policy_logprobs(native: floe.Client, context: list[int], temperature: float) -> torch.Tensor:
    """log p(v | context) for every vocabulary token v, from the policy's forward."""
    vocab = native.info().vocab_size
    batch = floe.Batch([floe.Group(context, [floe.Sample([v]) for v in range(vocab)])])
    return torch.tensor([s[0] for s in native.forward(batch, temperature=temperature).logprobs[0]])


def test_the_server_samples_with_vllm(native: floe.Client) -> None:
    caps = native.info().capabilities
    assert caps["sampler_engine"] == "vllm" and caps["sampler_engine_start_seconds"] > 0


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_completion_tokens_and_logprobs_agree_with_the_policy(sdk: openai.OpenAI, native: floe.Client,
                                                             temperature: float) -> None:
    model = sdk.models.list().data[0].id
    out = sdk.completions.create(model=model, prompt="abc", max_tokens=6, logprobs=3, temperature=temperature,
                                 seed=7, n=2)
    scored_at = temperature or 1.0  # greedy reports temperature-1 log-probs
    for choice in out.choices:
        ids, prompt = choice.model_extra["token_ids"], choice.model_extra["prompt_token_ids"]
        lp = choice.logprobs
        assert len(ids) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
        for t, token in enumerate(ids):
            expected = _policy_logprobs(native, prompt + ids[:t], scored_at)
            assert lp.token_logprobs[t] == pytest.approx(float(expected[token]), abs=1e-4)
            assert sorted(lp.top_logprobs[t].values(), reverse=True) == pytest.approx(
                torch.topk(expected, 3).values.tolist(), abs=1e-4)
            if temperature == 0:
                assert token == int(expected.argmax())
    if temperature == 0:
        assert out.choices[0].model_extra["token_ids"] == out.choices[1].model_extra["token_ids"]
    # The same seed gives the same tokens.
    again = sdk.completions.create(model=model, prompt="abc", max_tokens=6, temperature=temperature, seed=7, n=2)
    assert [c.model_extra["token_ids"] for c in again.choices] == [c.model_extra["token_ids"] for c in out.choices]


def test_chat_logprobs_agree_with_the_policy(sdk: openai.OpenAI, native: floe.Client) -> None:
    model = sdk.models.list().data[0].id
    out = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                      logprobs=True, top_logprobs=2, temperature=0.7, seed=3)
    choice = out.choices[0]
    ids, prompt = choice.model_extra["token_ids"], choice.model_extra["prompt_token_ids"]
    content = choice.logprobs.content
    assert len(content) == len(ids) >= 1
    for t, (token, entry) in enumerate(zip(ids, content)):
        expected = _policy_logprobs(native, prompt + ids[:t], 0.7)
        assert entry.logprob == pytest.approx(float(expected[token]), abs=1e-4)
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(torch.topk(expected, 2).values.tolist(), abs=1e-4)
    assert out.usage.completion_tokens == len(ids)
