"""Window batching of the OpenAI routes' sample calls: requests that arrive together are
decoded together, as ONE `Backend.sample` call, and each gets its own slice of the result.

A request waits at most `window_s` for company. When the window closes, pending requests are
grouped: requests merge when they ask for the same `n` and the same `SamplingParams` except
`max_tokens`. A merged call runs with the largest `max_tokens` of its members and each
member's samples are cut back to its own `max_tokens` (a sample that ran past it ends with
stop reason "length"). That is exact: tokens are drawn one at a time, so the first m tokens of
a longer sample are distributed like a sample of at most m tokens. To bound the extra decoding,
members' `max_tokens` lie within a factor of 2 of each other; a merged call also keeps its
longest prompt + `max_tokens` within the model's context and its rows (prompts x n) within
`max_sequences`.

Seeded requests are never merged: a seed fixes every draw of its own call, so a seeded request
gives the same tokens whatever else arrives. Calls run as soon as their window closes, also
while earlier calls still run (the backend runs sample calls concurrently; holding requests
back until a running call ends was measured slower: closed-loop clients then lock into a small
and a large batch that alternate). If a merged call is refused as invalid (one member's
prompt, say), every member is retried alone so each gets its own answer or error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from floe.errors import InvalidInput
from floe.types import SampledGroup, SampledSequence, SampleResult, SamplingParams

log = logging.getLogger("floe.server.batching")

SampleFn = Callable[[list[list[int]], int, SamplingParams], SampleResult]


@dataclass
class _Request:
    prompts: list[list[int]]
    n: int
    params: SamplingParams
    future: asyncio.Future[SampleResult]

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n

    @property
    def longest(self) -> int:
        return max((len(p) for p in self.prompts), default=0)


@dataclass
class _Batch:
    """Requests that run as one sample call."""

    members: list[_Request] = field(default_factory=list)

    @property
    def max_tokens(self) -> int:
        return max(r.params.max_tokens for r in self.members)

    def admits(self, req: _Request, max_sequences: int, max_context: int) -> bool:
        if not self.members:
            return True
        limits = [r.params.max_tokens for r in self.members] + [req.params.max_tokens]
        longest = max([r.longest for r in self.members] + [req.longest])
        return (
            sum(r.rows for r in self.members) + req.rows <= max_sequences
            and max(limits) <= 2 * min(limits)
            and longest + max(limits) <= max_context
        )


def merge_key(n: int, params: SamplingParams) -> str:
    """Requests with equal keys may share a sample call: same n, same params but max_tokens."""
    fields = dataclasses.asdict(params)
    fields.pop("max_tokens")
    return json.dumps([n, fields], sort_keys=True)


def plan(requests: list[_Request], max_sequences: int, max_context: int) -> dict[str, list[_Batch]]:
    """Arrival-ordered requests -> batches per merge key (first fit, arrival order kept)."""
    batches: dict[str, list[_Batch]] = {}
    for req in requests:
        open_batches = batches.setdefault(merge_key(req.n, req.params), [])
        target = next((b for b in open_batches if b.admits(req, max_sequences, max_context)), None)
        if target is None:
            target = _Batch()
            open_batches.append(target)
        target.members.append(req)
    return batches


def cut(seq: SampledSequence, max_tokens: int) -> SampledSequence:
    """`seq` as a call with `max_tokens` would have ended it."""
    if len(seq.tokens) <= max_tokens:
        return seq
    top = seq.top_logprobs[:max_tokens] if seq.top_logprobs is not None else None
    return dataclasses.replace(
        seq, tokens=seq.tokens[:max_tokens], logprobs=seq.logprobs[:max_tokens], stop_reason="length", top_logprobs=top
    )


def split(result: SampleResult, shapes: list[tuple[int, int]]) -> list[SampleResult]:
    """One merged call's result -> each member's, in member order; `shapes` holds each
    member's (number of prompts, max_tokens)."""
    out, start = [], 0
    for prompts, max_tokens in shapes:
        groups = [SampledGroup(g.prompt, [cut(s, max_tokens) for s in g.samples]) for g in result.groups[start : start + prompts]]
        start += prompts
        tokens = sum(len(s.tokens) for g in groups for s in g.samples)
        out.append(SampleResult(groups, result.weights_version, tokens, result.seconds))
    return out


class SampleBatcher:
    """Collects concurrent `sample` requests for `window_s` and runs them merged (see module doc).

    `sample_fn` is the blocking sample call (`Backend.sample`); it runs in a worker thread.
    `window_s` = 0 turns batching off (every request is its own call).
    """

    def __init__(self, sample_fn: SampleFn, *, window_s: float, max_sequences: int, max_context: int):
        self._sample_fn = sample_fn
        self.window_s = window_s
        self.max_sequences = max_sequences
        self.max_context = max_context
        self._pending: list[_Request] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.calls = 0  # sample calls made (a merged call counts once); for tests and benchmarks

    async def sample(self, prompts: list[list[int]], n: int, params: SamplingParams) -> SampleResult:
        """`sample_fn(prompts, n, params)`'s answer, possibly computed together with other requests."""
        if self.window_s <= 0 or params.seed is not None:
            return await self._call(prompts, n, params)
        loop = asyncio.get_running_loop()
        req = _Request(prompts, n, params, loop.create_future())
        self._pending.append(req)
        if self._timer is None:
            self._timer = loop.call_later(self.window_s, self._flush)
        return await req.future

    async def _call(self, prompts: list[list[int]], n: int, params: SamplingParams) -> SampleResult:
        self.calls += 1
        return await run_in_threadpool(self._sample_fn, prompts, n, params)

    def _flush(self) -> None:
        """The window closed: start one call per planned batch."""
        self._timer = None
        waiting = [r for r in self._pending if not r.future.done()]  # drop cancelled requests
        self._pending = []
        for batches in plan(waiting, self.max_sequences, self.max_context).values():
            for batch in batches:
                task = asyncio.get_running_loop().create_task(self._run_batch(batch))
                self._tasks.add(task)  # a reference until it ends
                task.add_done_callback(self._tasks.discard)

    async def _run_batch(self, batch: _Batch) -> None:
        members = batch.members
        prompts = [p for r in members for p in r.prompts]
        params = dataclasses.replace(members[0].params, max_tokens=batch.max_tokens)
        log.info("sample batch", extra={"requests": len(members), "prompts": len(prompts), "n": members[0].n,
                                        "max_tokens": params.max_tokens})
        try:
            result = await self._call(prompts, members[0].n, params)
        except InvalidInput as exc:
            if len(members) == 1:
                _settle(members[0].future, exc)
            else:  # someone's input was bad: answer each on its own
                await asyncio.gather(*(self._run_alone(r) for r in members))
            return
        except Exception as exc:  # noqa: BLE001 - the same failure, handed to every member (not swallowed)
            for r in members:
                _settle(r.future, exc)
            return
        for r, own in zip(members, split(result, [(len(r.prompts), r.params.max_tokens) for r in members])):
            _settle(r.future, own)

    async def _run_alone(self, req: _Request) -> None:
        try:
            _settle(req.future, await self._call(req.prompts, req.n, req.params))
        except Exception as exc:  # noqa: BLE001 - handed to the request's caller (not swallowed)
            _settle(req.future, exc)


def _settle(future: asyncio.Future[SampleResult], outcome: SampleResult | BaseException) -> None:
    if future.done():  # the client went away
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
