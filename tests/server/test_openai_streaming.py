"""Live token streaming on the OpenAI routes, with the real `openai` SDK against a real
`floe serve` process: streamed tokens (ids, log-probs, text) equal the whole answer of the same
seeded request, for completions and chat, n > 1 and stop strings; the header says the tokens
are live; a client that disconnects mid-stream stops the engine. Plus the `Detokenizer` on a
byte-level tokenizer (characters split over several tokens)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from floe.server.protocols.openai_render import Detokenizer

from .conftest import ServerProcess, openai_sdk, own_server

TOKEN = "stream-token"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_model: Path):
    yield from own_server(tmp_path_factory, server_model, "openai-stream", TOKEN)


@pytest.fixture(scope="module")
def sdk(server: ServerProcess):
    yield from openai_sdk(server, TOKEN)


def _streamed(chunks: list, kind: str, n: int) -> dict[int, dict]:
    """Per choice: text, token ids, log-probs and finish reason gathered from the chunks."""
    out = {i: {"text": "", "ids": [], "logprobs": [], "finish": None} for i in range(n)}
    for c in chunks:
        for ch in c.choices:
            got = out[ch.index]
            got["ids"] += ch.model_extra.get("token_ids") or []
            if kind == "chat":
                got["text"] += ch.delta.content or ""
                got["logprobs"] += [e.logprob for e in (ch.logprobs.content if ch.logprobs else [])]
            else:
                got["text"] += ch.text
                got["logprobs"] += ch.logprobs.token_logprobs if ch.logprobs else []
            got["finish"] = ch.finish_reason or got["finish"]
    return out


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("stop", [None, ["a"]])
def test_streamed_tokens_equal_the_whole_answer(sdk: openai.OpenAI, kind: str, stop: list[str] | None) -> None:
    args = {"model": "tiny", "max_tokens": 24, "n": 3, "seed": 11, "temperature": 1.0, "stop": stop}
    if kind == "chat":
        whole = sdk.chat.completions.create(messages=HI, logprobs=True, **args)
        raw = sdk.chat.completions.with_raw_response.create(messages=HI, logprobs=True, stream=True,
                                                            stream_options={"include_usage": True}, **args)
        texts = [c.message.content for c in whole.choices]
        lps = [[e.logprob for e in c.logprobs.content] for c in whole.choices]
    else:
        whole = sdk.completions.create(prompt="ab", logprobs=1, **args)
        raw = sdk.completions.with_raw_response.create(prompt="ab", logprobs=1, stream=True,
                                                       stream_options={"include_usage": True}, **args)
        texts = [c.text for c in whole.choices]
        lps = [c.logprobs.token_logprobs for c in whole.choices]
    assert raw.headers["x-floe-token-streaming"] == "live"
    chunks = list(raw.parse())
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    got = _streamed(chunks[:-1], kind, 3)
    for i, choice in enumerate(whole.choices):
        assert got[i]["ids"] == choice.model_extra["token_ids"]
        assert got[i]["logprobs"] == lps[i]
        assert got[i]["text"] == texts[i]
        assert got[i]["finish"] == choice.finish_reason
    if stop:
        assert any(c.finish_reason == "stop" for c in whole.choices)
        assert all("a" not in t for t in texts)


def test_tokens_arrive_before_the_call_ends(sdk: openai.OpenAI) -> None:
    """Live, not replayed: the first token chunk is read while the engine still has hundreds of
    steps to go (the final chunk, with the finish reason, comes later)."""
    stream = sdk.completions.create(model="tiny", prompt="ab", max_tokens=600, extra_body={"ignore_eos": True},
                                    stream=True, seed=1)
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None and len(first.choices[0].model_extra["token_ids"]) == 1
    rest = list(stream)
    assert rest[-1].choices[0].finish_reason == "length"
    assert 1 + sum(len(c.choices[0].model_extra["token_ids"]) for c in rest) == 600


def _metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    return values[0] if values else 0.0


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_client_that_disconnects_mid_stream_stops_the_engine(sdk: openai.OpenAI, server: ServerProcess,
                                                               kind: str) -> None:
    stopped = _metric(server, "floe_sample_calls_stopped_total")
    sampled = _metric(server, "floe_tokens_sampled_total")
    args = {"model": "tiny", "max_tokens": 1000, "n": 16, "extra_body": {"ignore_eos": True}, "stream": True}
    if kind == "chat":
        stream = sdk.chat.completions.create(messages=HI, **args)
    else:
        stream = sdk.completions.create(prompt="ab", **args)
    for seen, _chunk in enumerate(stream, start=1):
        if seen == 20:
            break
    stream.close()  # the connection goes: the server sees the disconnect
    deadline = time.monotonic() + 120  # a hang guard only; the engine stops within a step
    while _metric(server, "floe_sample_calls_stopped_total") == stopped:
        assert time.monotonic() < deadline, "the engine did not stop after the client left"
        time.sleep(0.1)
    # The stopped call's 16 x 1000 tokens never completed (a finished call counts its tokens).
    assert _metric(server, "floe_tokens_sampled_total") == sampled
    # The server still answers.
    assert sdk.completions.create(model="tiny", prompt="ab", max_tokens=2).choices[0].finish_reason in ("length", "stop")


# -- the Detokenizer --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ASCII only: every non-ASCII character is several byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    tok.train_from_iterator(["hello world, the stop word is STOP"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.mark.parametrize("text", ["héllo wörld", "emoji 🙂 and 中文 here", "ends in é"])
def test_detokenizer_never_splits_a_character(byte_tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    ids = byte_tokenizer.encode(text)
    assert len(ids) > len(text.encode()) // 2  # really split into byte tokens
    det = Detokenizer(byte_tokenizer, [])
    deltas = [det.push(t) for t in ids]
    deltas.append(det.finish())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == byte_tokenizer.decode(ids) == text


def test_detokenizer_cuts_at_a_stop_string_and_holds_its_prefix(byte_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = byte_tokenizer.encode("hello STOP world")
    det = Detokenizer(byte_tokenizer, ["STOP"])
    deltas = [det.push(t) for t in ids]
    assert "".join(deltas) + det.finish() == "hello "
    # A partial stop string is held back, then released when the sample ends without it.
    det = Detokenizer(byte_tokenizer, ["STOP"])
    part = "".join(det.push(t) for t in byte_tokenizer.encode("hello ST"))
    assert part == "hello " and det.finish() == "ST"
    # A stop token ends the text; nothing after it is added.
    eos = byte_tokenizer.eos_token_id
    det = Detokenizer(byte_tokenizer, [], frozenset({eos}))
    assert "".join(det.push(t) for t in [*byte_tokenizer.encode("hi"), eos, *byte_tokenizer.encode("x")]) == "hi"
