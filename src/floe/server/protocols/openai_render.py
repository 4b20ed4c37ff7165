"""OpenAI answer objects from sampled token ids: text, finish reasons, log-prob objects, whole
answers and server-sent-event chunks (completions and chat). Pure functions of the sampled
sequences and the tokenizer; the routes are in openai.py.

Text: a stop token is not part of the text (its log-prob is still reported: every generated
token is), and the text is cut before a matched stop string. Streamed text deltas join to
exactly the non-streamed text: each token's delta is what it adds to the decoded text, held
back while it ends in an incomplete character. A completion's `text_offset` indexes that same
text: token i starts at the sum of the earlier deltas, so `text[offset_i:offset_(i+1)]` is token
i's delta, and a token that adds no text (a special token, one past a stop string) has the
offset of the next character.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from floe.types import SampledSequence, SampleResult


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

    def __init__(self, tokenizer: Any, stop: list[str]):
        self.tok = tokenizer
        self.stop = stop

    def _text_tokens(self, seq: SampledSequence) -> list[int]:
        return seq.tokens[:-1] if seq.stop_reason == "stop_token" else seq.tokens

    def text(self, seq: SampledSequence) -> str:
        text = self.tok.decode(self._text_tokens(seq), skip_special_tokens=True)
        if seq.stop_reason == "stop_string":
            cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=len(text))
            text = text[:cut]
        return text

    def piece(self, token: int) -> str:
        return self.tok.decode([token])

    def deltas(self, seq: SampledSequence) -> list[str]:
        """One text delta per token of `seq`; they join to exactly `text(seq)`."""
        final, tokens = self.text(seq), self._text_tokens(seq)
        out: list[str] = []
        emitted, blocked = 0, False
        prefix_at = read_at = 0  # tokens[prefix_at:read_at] decode to the text already given
        for i in range(len(seq.tokens)):
            delta = ""
            if i < len(tokens) and not blocked:
                before = self.tok.decode(tokens[prefix_at:read_at], skip_special_tokens=True)
                after = self.tok.decode(tokens[prefix_at : i + 1], skip_special_tokens=True)
                if len(after) > len(before) and not after.endswith("\ufffd"):
                    delta = after[len(before) :]
                    prefix_at, read_at = read_at, i + 1
                if not final.startswith(delta, emitted):  # past a stop string, or a detokenizer quirk
                    delta, blocked = "", True
            emitted += len(delta)
            out.append(delta)
        if out:
            out[-1] += final[emitted:]
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
