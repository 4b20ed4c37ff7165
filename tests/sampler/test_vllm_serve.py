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


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streamed_tokens_equal_the_whole_answer_on_vllm(sdk: openai.OpenAI, native: floe.Client, kind: str) -> None:
    """vLLM streams live (its own DELTA step loop): the streamed ids, log-probs and text of a
    seeded request equal the whole answer's, n > 1 and a stop string included."""
    assert native.info().capabilities["sampler_streams_tokens"] is True
    args = {"model": next(m.id for m in sdk.models.list()), "max_tokens": 16, "n": 2, "seed": 3, "stop": ["a"]}
    if kind == "chat":
        msgs = [{"role": "user", "content": "hi"}]
        whole = sdk.chat.completions.create(messages=msgs, logprobs=True, **args)
        raw = sdk.chat.completions.with_raw_response.create(messages=msgs, logprobs=True, stream=True, **args)
    else:
        whole = sdk.completions.create(prompt="ab", logprobs=0, **args)
        raw = sdk.completions.with_raw_response.create(prompt="ab", logprobs=0, stream=True, **args)
    assert raw.headers["x-floe-token-streaming"] == "live"
    got: dict[int, dict] = {i: {"ids": [], "lps": [], "text": ""} for i in range(2)}
    for chunk in raw.parse():
        for ch in chunk.choices:
            g = got[ch.index]
            g["ids"] += ch.model_extra.get("token_ids") or []
            if kind == "chat":
                g["text"] += ch.delta.content or ""
                g["lps"] += [e.logprob for e in ch.logprobs.content] if ch.logprobs else []
            else:
                g["text"] += ch.text
                g["lps"] += ch.logprobs.token_logprobs if ch.logprobs else []
    for c in whole.choices:
        text = c.message.content if kind == "chat" else c.text
        lps = [e.logprob for e in c.logprobs.content] if kind == "chat" else c.logprobs.token_logprobs
        assert (got[c.index]["ids"], got[c.index]["lps"], got[c.index]["text"]) == \
            (c.model_extra["token_ids"], lps, text)
