"""The real `openai` SDK against a real `floe serve` process: streaming (with usage), top
log-probs (checked against the policy's own forward pass), and errors the SDK raises with
floe's message, field and code."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

import floe

from .conftest import ServerProcess, openai_sdk, own_server

TOKEN = "sdk-token"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_model: Path):
    """A fresh server of its own: policy and sampler weights are still equal (no training)."""
    yield from own_server(tmp_path_factory, server_model, "openai-sdk", TOKEN)


@pytest.fixture(scope="module")
def sdk(server: ServerProcess):
    yield from openai_sdk(server, TOKEN)


def test_model_id_is_short(sdk: openai.OpenAI) -> None:
    assert [m.id for m in sdk.models.list()] == ["tiny"]


def test_completion_top_logprobs_match_the_policy_forward(sdk: openai.OpenAI, server: ServerProcess, server_model: Path) -> None:
    out = sdk.completions.create(model="tiny", prompt="abc", max_tokens=4, logprobs=5, temperature=0.8, seed=7)
    choice = out.choices[0]
    ids = choice.model_extra["token_ids"]
    prompt = choice.model_extra["prompt_token_ids"]
    lp = choice.logprobs
    assert len(lp.top_logprobs) == len(ids) == len(lp.token_logprobs) == 4
    # Same seed without alternatives: the same tokens (asking for them changes no draw).
    plain = sdk.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0.8, seed=7)
    assert plain.choices[0].model_extra["token_ids"] == ids and plain.choices[0].logprobs is None

    # The policy scores every vocabulary token after prompt + ids[:t] at the same temperature:
    # the top 5 are exactly the reported alternatives (the char tokenizer's pieces are unique).
    tokenizer = AutoTokenizer.from_pretrained(server_model)
    client = server.client(timeout=60)
    try:
        vocab = client.info().vocab_size
        for t, alternatives in enumerate(lp.top_logprobs):
            batch = floe.Batch([floe.Group(prompt + ids[:t] if t else prompt, [floe.Sample([v]) for v in range(vocab)])])
            scores = [s[0] for s in client.forward(batch, temperature=0.8).logprobs[0]]
            best = sorted(range(vocab), key=lambda v: -scores[v])[:5]
            pieces = [tokenizer.decode([v]) for v in best]
            assert list(alternatives) == pieces
            for v, piece in zip(best, pieces):
                assert alternatives[piece] == pytest.approx(scores[v], abs=1e-4)
            assert lp.token_logprobs[t] == pytest.approx(scores[ids[t]], abs=1e-4)
            assert lp.token_logprobs[t] <= max(alternatives.values())
    finally:
        client.close()


def test_chat_logprobs_with_top_logprobs(sdk: openai.OpenAI) -> None:
    out = sdk.chat.completions.create(model="tiny", messages=HI, max_tokens=5, logprobs=True, top_logprobs=3, seed=2)
    content = out.choices[0].logprobs.content
    assert len(content) == len(out.choices[0].model_extra["token_ids"])
    for entry in content:
        alts = [a.logprob for a in entry.top_logprobs]
        assert len(alts) == 3 and alts == sorted(alts, reverse=True)
        assert entry.logprob <= alts[0] + 1e-6
        assert entry.bytes == list(entry.token.encode())


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streaming_joins_to_the_same_answer_with_usage(sdk: openai.OpenAI, server_model: Path, kind: str) -> None:
    args = {"model": "tiny", "max_tokens": 12, "seed": 5, "n": 2}
    first = (sdk.chat.completions.create(messages=HI, **args) if kind == "chat"
             else sdk.completions.create(prompt="ab", **args)).choices[0]
    free = first.message.content if kind == "chat" else first.text
    # A stop string sample 0 is sure to meet: two adjacent ordinary tokens from its 5th token on
    # (stop strings are matched on the decoded tokens, special ones included, while the text
    # shown skips special tokens: a pair of ordinary tokens reads the same in both).
    tok = AutoTokenizer.from_pretrained(server_model)
    ids = first.model_extra["token_ids"]
    k = next(k for k in range(4, len(ids) - 1) if not {ids[k], ids[k + 1]} & set(tok.all_special_ids))
    args["stop"] = [tok.decode(ids[k : k + 2])]
    if kind == "chat":
        whole = sdk.chat.completions.create(messages=HI, logprobs=True, **args)
        chunks = list(sdk.chat.completions.create(messages=HI, logprobs=True, stream=True,
                                                  stream_options={"include_usage": True}, **args))
        texts = [c.message.content for c in whole.choices]
        pieces = {0: "", 1: ""}
        tokens: dict[int, int] = {0: 0, 1: 0}
        for c in chunks[:-1]:
            for ch in c.choices:
                pieces[ch.index] += ch.delta.content or ""
                tokens[ch.index] += len(ch.logprobs.content) if ch.logprobs else 0
    else:
        whole = sdk.completions.create(prompt="ab", logprobs=2, **args)
        chunks = list(sdk.completions.create(prompt="ab", logprobs=2, stream=True,
                                             stream_options={"include_usage": True}, **args))
        texts = [c.text for c in whole.choices]
        pieces, tokens = {0: "", 1: ""}, {0: 0, 1: 0}
        for c in chunks[:-1]:
            for ch in c.choices:
                pieces[ch.index] += ch.text
                tokens[ch.index] += len(ch.logprobs.tokens)
    assert [pieces[0], pieces[1]] == texts  # same seed: same samples, streamed text joins exactly
    assert whole.choices[0].finish_reason == "stop" and len(texts[0]) < len(free)  # cut before the stop string
    assert [tokens[0], tokens[1]] == [len(c.model_extra["token_ids"]) for c in whole.choices]
    finishes = [ch.finish_reason for c in chunks[:-1] for ch in c.choices if ch.finish_reason]
    assert sorted(finishes) == sorted(c.finish_reason for c in whole.choices)
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_usage_has_no_usage_chunk(sdk: openai.OpenAI) -> None:
    chunks = list(sdk.completions.create(model="tiny", prompt="ab", max_tokens=3, stream=True))
    assert chunks and all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_sdk_errors_carry_message_field_and_code(sdk: openai.OpenAI, server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model="tiny", messages=HI, presence_penalty=1.0)
    assert e.value.param == "presence_penalty" and e.value.code == "unsupported_parameter"
    assert "presence_penalty is not supported" in str(e.value)

    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model="tiny", prompt="ab", max_tokens=4000)
    assert e.value.param == "max_tokens" and "exceeds the context of 1024" in str(e.value)

    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model="tiny", prompt=["ab", [3, 99999]], max_tokens=2)
    assert e.value.param == "prompt[1]" and "vocabulary" in str(e.value)

    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model="tiny", messages=HI, extra_body={"min_p": 0.1})
    assert e.value.param == "min_p" and "not supported" in str(e.value)

    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model="tiny", messages=HI, extra_body={"top_kk": 3})
    assert e.value.param == "top_kk" and e.value.code == "unknown_parameter"

    with pytest.raises(openai.NotFoundError) as e:
        sdk.chat.completions.create(model="gpt-4o", messages=HI)
    assert e.value.param == "model" and "serves 'tiny'" in str(e.value)

    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    bad.close()


def test_temperature_zero_is_floes_greedy_path(sdk: openai.OpenAI, server: ServerProcess) -> None:
    out = sdk.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=6, temperature=0, logprobs=2)
    client = server.client(timeout=60)
    try:
        native = client.sample([[5, 6, 7]], 1, floe.SamplingParams(max_tokens=6, temperature=0, top_logprobs=2))
    finally:
        client.close()
    seq = native.groups[0].samples[0]
    assert out.choices[0].model_extra["token_ids"] == seq.tokens
    assert out.choices[0].logprobs.token_logprobs == seq.logprobs  # exactly: float32 values through JSON
    assert [list(d.values()) for d in out.choices[0].logprobs.top_logprobs] == [[lp for _, lp in t] for t in seq.top_logprobs]
