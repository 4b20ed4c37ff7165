"""OpenAI answer objects from sampled token ids: text, finish reasons, log-prob objects, whole
answers and server-sent-event chunks (completions and chat). Functions of the sampled
sequences and the tokenizer; the routes are in openai.py.

Text comes from one incremental `Detokenizer` per sample, for streamed and whole answers alike:
a stop token is not part of the text (its log-prob is still reported: every generated token
is), and the text is cut before a matched stop string. Each token's delta is what it adds to
the decoded text, held back while it ends in an incomplete (multi-byte) character or while the
text ends in what could be the start of a stop string. So streamed deltas join to exactly the
non-streamed text. A completion's `text_offset` indexes that same text: token i starts at the
sum of the earlier deltas, and a token that adds no text (a special token, one past a stop
string) has the offset of the next character.

Two ways to stream: `stream` renders a finished answer as events; `LiveStream` renders tokens
as the engine reports them (`floe.sampler.engine.StepToken`), then the finish reasons and usage
from the final result. Both send one chunk per generated token (with `token_ids`), and a chunk
that carries a choice's finish reason.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from floe.sampler.engine import StepToken
from floe.types import SampledSequence, SampleResult


class Detokenizer:
    """Token ids -> text, one token at a time, for one sample.

    `push(token)` returns the text the token adds that is safe to give out now; `finish()`
    returns what was held back (an incomplete character at the very end, or a partial stop
    string the sample did not complete). The pieces join to the sample's text. Tokens in
    `stop_ids` add no text and end it (the engine ends a sample at its stop token); a stop
    string ends the text just before it. Decoding skips special tokens, over a sliding window
    (the tokens since the last complete character and the ones before them), so a token that
    completes a multi-byte character gives the whole character at once."""

    def __init__(self, tokenizer: Any, stop: list[str], stop_ids: set[int] | frozenset[int] = frozenset()):
        self.tok = tokenizer
        self.stop = [s for s in stop if s]
        self.stop_ids = stop_ids
        self.tokens: list[int] = []
        self.text = ""  # decoded so far (complete characters), cut at a stop string
        self.emitted = 0  # characters of `text` given out
        self.ended = False  # a stop token or stop string was reached: no more text
        self._prefix_at = self._read_at = 0  # tokens[prefix_at:read_at] decode to the tail of `text`

    def _decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """The text `token` adds that can be given out now (possibly "")."""
        if self.ended:
            return ""
        if token in self.stop_ids:
            self.ended = True
            return self._release(final=True)
        self.tokens.append(token)
        before = self._decode(self.tokens[self._prefix_at : self._read_at])
        after = self._decode(self.tokens[self._prefix_at :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix_at, self._read_at = self._read_at, len(self.tokens)
        return self._release(final=False)

    def finish(self) -> str:
        """What is still held back, now that the sample has ended."""
        if not self.ended and self._read_at < len(self.tokens):  # ends inside a character: as decoded
            before = self._decode(self.tokens[self._prefix_at : self._read_at])
            self.text += self._decode(self.tokens[self._prefix_at :])[len(before) :]
            self._read_at = len(self.tokens)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        cut = min((i for i in (self.text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.ended, final = self.text[:cut], True, True
        hold = 0
        if not final and not self.ended:  # the longest tail that may begin a stop string
            for s in self.stop:
                for k in range(min(len(s) - 1, len(self.text) - self.emitted), hold, -1):
                    if self.text.endswith(s[:k]):
                        hold = k
                        break
        out = self.text[self.emitted : len(self.text) - hold]
        self.emitted += len(out)
        return out


@dataclass
class Answer:
    """What the routes render: the request's kind and options, the sampled result."""

    kind: str  # "completion" | "chat"
    model: str
    result: SampleResult
    stop: list[str]
    logprobs: bool  # report the sampled tokens' log-probs
    top_logprobs: int  # alternatives per token (0 = none)
    include_usage: bool = True  # streaming only: the final usage chunk
    id: str = field(init=False)
    created: int = field(init=False)  # unix seconds

    def __post_init__(self) -> None:
        self.id = f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())


class Renderer:
    """Token ids -> OpenAI text, finish reasons and log-prob objects."""

    def __init__(self, tokenizer: Any, stop: list[str], stop_ids: set[int] | frozenset[int] = frozenset()):
        self.tok = tokenizer
        self.stop = stop
        self.stop_ids = stop_ids

    def detokenizer(self) -> Detokenizer:
        """A fresh `Detokenizer` for one sample of this answer."""
        return Detokenizer(self.tok, self.stop, self.stop_ids)

    def text(self, seq: SampledSequence) -> str:
        return "".join(self.deltas(seq))

    def piece(self, token: int) -> str:
        return self.tok.decode([token])

    def deltas(self, seq: SampledSequence) -> list[str]:
        """One text delta per token of `seq` (the last one with what `finish` releases); they
        join to exactly `text(seq)`, and to what `LiveStream` sends for the same tokens."""
        det = self.detokenizer()
        tokens = seq.tokens[:-1] if seq.stop_reason == "stop_token" else seq.tokens
        out = [det.push(t) for t in tokens] + ([""] if len(tokens) < len(seq.tokens) else [])
        if out:
            out[-1] += det.finish()
        return out

    @staticmethod
    def text_offsets(deltas: list[str]) -> list[int]:
        """Where each token's delta starts in the text they join to (`deltas(seq)`)."""
        offsets, at = [], 0
        for delta in deltas:
            offsets.append(at)
            at += len(delta)
        return offsets

    @staticmethod
    def finish_reason(seq: SampledSequence) -> str:
        return "length" if seq.stop_reason == "length" else "stop"

    # -- log-prob objects, per token ----------------------------------------------------------

    def completion_top(self, seq: SampledSequence, t: int) -> dict[str, float] | None:
        if seq.top_logprobs is None:
            return None
        return {self.piece(tok): lp for tok, lp in seq.top_logprobs[t]}

    def chat_entry(self, seq: SampledSequence, t: int) -> dict[str, Any]:
        piece = self.piece(seq.tokens[t])
        alts = seq.top_logprobs[t] if seq.top_logprobs is not None else []
        return {
            "token": piece, "logprob": seq.logprobs[t], "bytes": list(piece.encode()),
            "top_logprobs": [
                {"token": (p := self.piece(tok)), "logprob": lp, "bytes": list(p.encode())} for tok, lp in alts
            ],
        }


def usage(result: SampleResult) -> dict[str, int]:
    prompt_tokens = sum(len(g.prompt) for g in result.groups)  # each prompt once, as OpenAI counts
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": result.num_tokens,
        "total_tokens": prompt_tokens + result.num_tokens,
    }


def _choices(answer: Answer) -> Iterator[tuple[int, list[int], SampledSequence]]:
    index = 0
    for group in answer.result.groups:
        for seq in group.samples:
            yield index, group.prompt, seq
            index += 1


def _envelope(answer: Answer, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": answer.id, "object": obj, "created": answer.created, "model": answer.model, "choices": choices,
        "system_fingerprint": f"floe-weights-v{answer.result.weights_version}",
    }


def render(answer: Answer, rn: Renderer) -> dict[str, Any]:
    """The whole (non-streamed) answer object."""
    choices = []
    for index, prompt, seq in _choices(answer):
        choice: dict[str, Any] = {"index": index}
        if answer.kind == "chat":
            choice["message"] = {"role": "assistant", "content": rn.text(seq)}
            choice["logprobs"] = (
                {"content": [rn.chat_entry(seq, t) for t in range(len(seq.tokens))]} if answer.logprobs else None
            )
        else:
            choice["text"] = rn.text(seq)
            offsets = rn.text_offsets(rn.deltas(seq)) if answer.logprobs else []
            choice["logprobs"] = _completion_logprobs(answer, rn, seq, 0, len(seq.tokens), offsets)
        choice.update(finish_reason=rn.finish_reason(seq), token_ids=seq.tokens, prompt_token_ids=prompt)
        choices.append(choice)
    obj = "chat.completion" if answer.kind == "chat" else "text_completion"
    return {**_envelope(answer, obj, choices), "usage": usage(answer.result)}


def _completion_logprobs(
    answer: Answer, rn: Renderer, seq: SampledSequence, start: int, end: int, offsets: list[int]
) -> dict[str, Any] | None:
    """The completions `logprobs` object for tokens [start, end) of `seq`; `offsets` are every
    token's text offsets (`Renderer.text_offsets`), of which [start, end) are reported."""
    if not answer.logprobs:
        return None
    pieces = [rn.piece(t) for t in seq.tokens[start:end]]
    tops = [rn.completion_top(seq, t) for t in range(start, end)] if answer.top_logprobs else None
    return {"tokens": pieces, "token_logprobs": seq.logprobs[start:end], "top_logprobs": tops, "text_offset": offsets[start:end]}


def stream(answer: Answer, rn: Renderer) -> Iterator[str]:
    """The answer as server-sent events: one chunk per generated token (the last one carries
    the finish reason), choice after choice; then, with `include_usage`, a chunk with no
    choices and the usage; then `data: [DONE]`."""
    chat = answer.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if answer.include_usage else {}

    def event(choices: list[dict[str, Any]]) -> str:
        return f"data: {json.dumps({**_envelope(answer, obj, choices), **extra}, separators=(',', ':'))}\n\n"

    for index, _prompt, seq in _choices(answer):
        if chat:
            yield event([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
        last = len(seq.tokens) - 1
        deltas = rn.deltas(seq)
        offsets = rn.text_offsets(deltas)
        for t, delta in enumerate(deltas):
            choice: dict[str, Any] = {"index": index}
            if chat:
                choice["delta"] = {"content": delta}
                choice["logprobs"] = {"content": [rn.chat_entry(seq, t)]} if answer.logprobs else None
            else:
                choice["text"] = delta
                choice["logprobs"] = _completion_logprobs(answer, rn, seq, t, t + 1, offsets)
            choice["finish_reason"] = rn.finish_reason(seq) if t == last else None
            choice["token_ids"] = [seq.tokens[t]]
            yield event([choice])
    if answer.include_usage:
        data = {**_envelope(answer, obj, []), "usage": usage(answer.result)}
        yield f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
    yield "data: [DONE]\n\n"


class LiveStream:
    """An answer's server-sent events while it is generated.

    Steps (lists of `StepToken`, rows numbered as the answer's choices) arrive on a queue
    (`put_steps`, from any thread); `events(result)` yields one chunk per token as it comes,
    then, once the sample call ends, each choice's finish chunk (any text held back, the
    finish reason), the usage chunk (with `include_usage`) and `data: [DONE]`. The text of
    every choice comes from its own `Detokenizer`, so the deltas join to the whole answer's
    text. A call that fails after the stream began ends it with an `{"error": ...}` event."""

    _END = object()

    def __init__(self, kind: str, model: str, prompts: list[list[int]], n: int, rn: Renderer, logprobs: bool,
                 top_logprobs: int, include_usage: bool):
        self.answer_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.kind, self.model, self.prompts, self.n, self.rn = kind, model, prompts, n, rn
        self.logprobs, self.top_logprobs, self.include_usage = logprobs, top_logprobs, include_usage
        self.rows = len(prompts) * n
        self.dets = [rn.detokenizer() for _ in range(self.rows)]
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.tokens_sent = 0

    def put_steps(self, steps: list[StepToken]) -> None:
        """The sample call's step callback (`OnStep`): hands the steps to the event loop."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, steps)

    def end(self) -> None:
        """No more steps (call from the event loop once the sample call ended)."""
        self.queue.put_nowait(self._END)

    async def first(self) -> bool:
        """Wait for the first step or the end; True when a step came (the call is under way)."""
        item = await self.queue.get()
        self._peeked = item
        return item is not self._END

    def _event(self, choices: list[dict[str, Any]], usage_: dict[str, int] | None = None) -> str:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body: dict[str, Any] = {"id": self.answer_id, "object": obj, "created": self.created, "model": self.model,
                                "choices": choices}
        if self.include_usage:
            body["usage"] = usage_
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def _token_chunk(self, st: StepToken) -> dict[str, Any]:
        det, rn = self.dets[st.row], self.rn
        at = det.emitted
        delta = det.push(st.token)
        choice: dict[str, Any] = {"index": st.row}
        if self.kind == "chat":
            choice["delta"] = {"content": delta}
            choice["logprobs"] = {"content": [_chat_entry(rn, st.token, st.logprob, st.top_logprobs)]} \
                if self.logprobs else None
        else:
            choice["text"] = delta
            choice["logprobs"] = None if not self.logprobs else {
                "tokens": [rn.piece(st.token)], "token_logprobs": [st.logprob],
                "top_logprobs": [{rn.piece(t): lp for t, lp in (st.top_logprobs or ())}] if self.top_logprobs else None,
                "text_offset": [at]}
        choice["finish_reason"] = None
        choice["token_ids"] = [st.token]
        return choice

    async def events(self, result: asyncio.Future[SampleResult]) -> AsyncIterator[str]:
        """The events, ending when `result` (the sample call) is settled and reported."""
        if self.kind == "chat":
            for row in range(self.rows):
                yield self._event([{"index": row, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}])
        item = getattr(self, "_peeked", None)
        if item is None:
            item = await self.queue.get()
        while item is not self._END:
            for st in item:
                self.tokens_sent += 1
                yield self._event([self._token_chunk(st)])
            item = await self.queue.get()
        try:
            final = result.result()
        except Exception as exc:  # noqa: BLE001 - the client is told, in OpenAI's in-stream error shape
            yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'server_error', 'param': None, 'code': None}})}\n\n"
            return
        rows = [s for g in final.groups for s in g.samples]
        for row, seq in enumerate(rows):
            rest = self.dets[row].finish()
            choice: dict[str, Any] = {"index": row}
            if self.kind == "chat":
                choice["delta"] = {"content": rest} if rest else {}
            else:
                choice["text"] = rest
            none: dict[str, Any] | None = None
            if self.logprobs and self.kind != "chat":  # a completion chunk's logprobs for its (no) tokens
                none = {"tokens": [], "token_logprobs": [], "top_logprobs": [] if self.top_logprobs else None,
                        "text_offset": []}
            choice.update(logprobs=none, finish_reason=Renderer.finish_reason(seq), token_ids=[])
            yield self._event([choice])
        if self.include_usage:
            yield self._event([], usage(final))
        yield "data: [DONE]\n\n"


def _chat_entry(rn: Renderer, token: int, logprob: float, alts: tuple[tuple[int, float], ...] | None) -> dict[str, Any]:
    piece = rn.piece(token)
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode()),
            "top_logprobs": [{"token": (p := rn.piece(t)), "logprob": lp, "bytes": list(p.encode())}
                             for t, lp in (alts or ())]}
