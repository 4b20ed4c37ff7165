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

Steps and cancellation: every call runs with a step callback (`Backend.sample_streaming`). It
hands each member's rows' tokens (its own row numbers, cut at its own `max_tokens`) to the
member's `on_step` (a streaming request), and when every member's caller has gone (the request
was cancelled: its client disconnected), it raises `StopGeneration`, so the engine stops at
the next decode step instead of finishing tokens nobody reads.
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
from floe.sampler.engine import OnStep, StepToken, StopGeneration
from floe.types import SampledGroup, SampledSequence, SampleResult, SamplingParams

log = logging.getLogger("floe.server.batching")

SampleFn = Callable[[list[list[int]], int, SamplingParams, OnStep], SampleResult]


@dataclass
class _Request:
    prompts: list[list[int]]
    n: int
    params: SamplingParams
    future: asyncio.Future[SampleResult]
    on_step: OnStep | None = None  # called in the generating thread with this request's own rows
    gone: bool = False  # its caller left (the future was cancelled); read by the generating thread

    def __post_init__(self) -> None:
        self.future.add_done_callback(self._mark)

    def _mark(self, future: asyncio.Future[SampleResult]) -> None:
        if future.cancelled():
            self.gone = True

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


def step_router(members: list[_Request]) -> OnStep:
    """The step callback of one call over `members` (in call order): each step token goes to
    the member owning its row, renumbered to the member's rows and dropped past the member's
    `max_tokens`; StopGeneration once every member is `gone`. Runs in the generating thread."""
    owner: list[tuple[_Request, int]] = []  # call row -> (member, its own row)
    for r in members:
        owner += [(r, k) for k in range(r.rows)]
    counts = [0] * len(owner)

    def on_step(steps: list[StepToken]) -> None:
        if all(r.gone for r in members):
            raise StopGeneration("every client of this sample call has gone")
        per: dict[int, list[StepToken]] = {}
        for st in steps:
            member, row = owner[st.row]
            counts[st.row] += 1
            if member.on_step is not None and not member.gone and counts[st.row] <= member.params.max_tokens:
                per.setdefault(id(member), []).append(dataclasses.replace(st, row=row))
        for r in members:
            if id(r) in per and r.on_step is not None:
                r.on_step(per[id(r)])

    return on_step


class SampleBatcher:
    """Collects concurrent `sample` requests for `window_s` and runs them merged (see module doc).

    `sample_fn` is the blocking sample call with a step callback (`Backend.sample_streaming`);
    it runs in a worker thread. `window_s` = 0 turns batching off (every request is its own call).
    """

    def __init__(self, sample_fn: SampleFn, *, window_s: float, max_sequences: int, max_context: int,
                 on_stopped: Callable[[], None] | None = None):
        self._sample_fn = sample_fn
        self._on_stopped = on_stopped  # told of every call stopped early (metrics)
        self.window_s = window_s
        self.max_sequences = max_sequences
        self.max_context = max_context
        self._pending: list[_Request] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.calls = 0  # sample calls made (a merged call counts once); for tests and benchmarks
        self.stopped = 0  # calls the engine stopped early because every client had gone

    async def sample(self, prompts: list[list[int]], n: int, params: SamplingParams,
                     on_step: OnStep | None = None) -> SampleResult:
        """`sample_fn(prompts, n, params)`'s answer, possibly computed together with other requests.

        `on_step` (optional) gets this request's step tokens as they are generated (rows
        gi * n + k of its own prompts, at most its `max_tokens` per row), in the generating
        thread. Cancelling the awaiting task (the client left) marks the request gone; a call
        whose members are all gone is stopped by the engine at its next step."""
        loop = asyncio.get_running_loop()
        req = _Request(prompts, n, params, loop.create_future(), on_step)
        if self.window_s <= 0 or params.seed is not None:
            self._start(_Batch([req]))
        else:
            self._pending.append(req)
            if self._timer is None:
                self._timer = loop.call_later(self.window_s, self._flush)
        return await req.future

    async def _call(self, members: list[_Request], prompts: list[list[int]], params: SamplingParams) -> SampleResult:
        self.calls += 1
        try:
            return await run_in_threadpool(self._sample_fn, prompts, members[0].n, params, step_router(members))
        except StopGeneration:
            self.stopped += 1
            if self._on_stopped is not None:
                self._on_stopped()
            log.info("sample call stopped: every client left", extra={"requests": len(members)})
            raise

    def _start(self, batch: _Batch) -> None:
        task = asyncio.get_running_loop().create_task(self._run_batch(batch))
        self._tasks.add(task)  # a reference until it ends
        task.add_done_callback(self._tasks.discard)

    def _flush(self) -> None:
        """The window closed: start one call per planned batch."""
        self._timer = None
        waiting = [r for r in self._pending if not r.future.done()]  # drop cancelled requests
        self._pending = []
        for batches in plan(waiting, self.max_sequences, self.max_context).values():
            for batch in batches:
                self._start(batch)

    async def _run_batch(self, batch: _Batch) -> None:
        members = batch.members
        prompts = [p for r in members for p in r.prompts]
        params = dataclasses.replace(members[0].params, max_tokens=batch.max_tokens)
        log.info("sample batch", extra={"requests": len(members), "prompts": len(prompts), "n": members[0].n,
                                        "max_tokens": params.max_tokens})
        try:
            result = await self._call(members, prompts, params)
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
            _settle(req.future, await self._call([req], req.prompts, req.params))
        except Exception as exc:  # noqa: BLE001 - handed to the request's caller (not swallowed)
            _settle(req.future, exc)


def _settle(future: asyncio.Future[SampleResult], outcome: SampleResult | BaseException) -> None:
    if future.done():  # the client went away
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
