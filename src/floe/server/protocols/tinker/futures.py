"""Futures and per-run ordering for the Tinker protocol.

`Futures`: every model-touching request is answered at once with a `request_id`; the work runs
on a worker thread and its reply (status, body, media type, headers) is stored under that id
until `retrieve_future` collects it. A future belongs to the principal that made it: another
one's `retrieve_future` finds nothing (404). `wait` long-polls on the event loop (no thread
held) up to a bound the SDK's 45 s read timeout never reaches. The last `max_per_owner` replies
of each principal are kept (a retried retrieve gets the same answer), `max_entries` in all; a
future whose job has not finished is never dropped (its reply would be lost while its work runs).

Fair scheduling: the workers are shared by every principal, so jobs wait in one queue per owner
and a free worker takes the next job round-robin over the owners with work waiting (each
owner's jobs in their order), and the base model's lock is handed round-robin over the owners
waiting for it (`floe.locks.FairRLock`). One key's backlog then delays another key's request by
about one of its jobs, not by the whole backlog. `admit` bounds the jobs an owner has accepted but not
started (queued here or waiting in a `Sequencer` for their turn, each holding its parsed body):
past `max_queued_per_owner` of them, or `max_queued_bytes_per_owner` of their bodies (one request
always fits), a request is refused before any work with 429 `too_many_requests`, which the tinker SDK treats as
back-pressure (a sampling client pauses a second and sends again; other calls retry with backoff).

`Sequencer`: one per training run. Requests carry the client's `seq_id` (1, 2, ... per
TrainingClient); each runs only after every smaller one, so the chunks of a forward_backward
that arrive out of order are applied in `seq_id` order. A gap that stays open longer than
`gap_timeout_s` (a request the client reserved but never sent) is skipped. A re-sent `seq_id`
with the same body gets the original `request_id` (idempotent retries); with a different body
it is refused (400 `sequence_reused`; never 409, which the SDK retries): answering the old result would silently drop the new request.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from floe.errors import StateError
from floe.locks import tenant
from floe.server.errors import ApiError


@dataclass
class Reply:
    status: int
    body: bytes
    media_type: str
    headers: dict[str, str] = field(default_factory=dict)


class _Entry:
    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.reply: Reply | None = None
        self.waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []


T = TypeVar("T")

QUEUE_SETTING = "[server] tinker_max_queued_per_key"
QUEUE_BYTES_SETTING = "[server] tinker_max_queued_mb_per_key"


def answer_of(job: Callable[[], Reply]) -> Reply:
    """`job`'s reply; the last resort when it raises (jobs answer their own errors first): a
    failed future naming only the exception's type, so no future is left without an answer."""
    try:
        return job()
    except BaseException as exc:  # noqa: BLE001 - answered to the caller
        return Reply(200, f'{{"error": "internal error: {type(exc).__name__}", "category": "server"}}'.encode(),
                     "application/json")


class Futures:
    """request_id -> reply, filled by worker threads, awaited by retrieve_future; the workers take
    jobs round-robin over their owners (see the module docstring)."""

    def __init__(self, workers: int = 8, max_entries: int = 20000, max_per_owner: int = 4096,
                 max_queued_per_owner: int = 256, max_queued_bytes_per_owner: int = 1 << 30):
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._by_owner: dict[str, deque[str]] = {}
        self._lock = threading.Lock()
        self._max = max_entries
        self._max_per_owner = max_per_owner
        self.max_queued_per_owner = max_queued_per_owner
        self.max_queued_bytes_per_owner = max_queued_bytes_per_owner
        self._queued: dict[str, tuple[int, int]] = {}  # owner -> (admitted jobs not started yet, their body bytes)
        self._jobs: OrderedDict[str, deque[Callable[[], None]]] = OrderedDict()  # owners with jobs waiting, in turn
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="floe-tinker")

    # -- admission and fair scheduling -----------------------------------------------------------

    def admit(self, owner: str, size: int = 0) -> None:
        """Count one more accepted, not yet started job of `owner` with a body of `size` bytes
        (`release` takes it back when it starts or will not run); ApiError 429 when the owner
        has `max_queued_per_owner` jobs already, or their bodies and this one pass
        `max_queued_bytes_per_owner` (a first job always fits)."""
        with self._lock:
            count, held = self._queued.get(owner, (0, 0))
            if count >= self.max_queued_per_owner:
                raise ApiError(429, "too_many_requests", f"this key has {count} requests waiting to start, the "
                               f"server's limit ({QUEUE_SETTING}); wait for their results before sending more "
                               "(the tinker SDK waits and sends again by itself)")
            if count and held + size > self.max_queued_bytes_per_owner:
                raise ApiError(429, "too_many_requests", f"this key's {count} requests waiting to start hold "
                               f"{held >> 20} MiB of request bodies; with this one's {size >> 20} MiB that passes "
                               f"the server's limit ({QUEUE_BYTES_SETTING}); wait for their results before "
                               "sending more (the tinker SDK waits and sends again by itself)")
            self._queued[owner] = (count + 1, held + size)

    def release(self, owner: str, size: int = 0) -> None:
        """An admitted job (of `size` body bytes) that has just started, or will not run, no
        longer counts."""
        with self._lock:
            count, held = self._queued.get(owner, (1, size))
            if count > 1:
                self._queued[owner] = (count - 1, max(0, held - size))
            else:
                self._queued.pop(owner, None)

    def queued(self, owner: str) -> int:
        """`owner`'s admitted jobs not started yet."""
        with self._lock:
            return self._queued.get(owner, (0, 0))[0]

    def schedule(self, owner: str, work: Callable[[], None]) -> None:
        """Run `work` on a worker when `owner`'s turn comes (after `owner`'s earlier work)."""
        with self._lock:
            self._jobs.setdefault(owner, deque()).append(work)
        self.executor.submit(self._next)

    def _next(self) -> None:
        # One `_next` is submitted per scheduled job, so there is always a job to take: the first
        # owner in turn's oldest one; that owner goes to the back of the turn if it has more.
        with self._lock:
            owner, mine = next(iter(self._jobs.items()))
            work = mine.popleft()
            if mine:
                self._jobs.move_to_end(owner)
            else:
                del self._jobs[owner]
        with tenant(owner):  # the model's lock is handed round-robin over owners too (floe.locks)
            work()

    # -- futures ---------------------------------------------------------------------------------

    def new(self, owner: str) -> str:
        rid = uuid.uuid4().hex
        with self._lock:
            self._entries[rid] = _Entry(owner)
            mine = self._by_owner.setdefault(owner, deque())
            mine.append(rid)
            if len(mine) > self._max_per_owner:
                self._drop_done(mine, len(mine) - self._max_per_owner)
            if len(self._entries) > self._max:
                victims = [r for r, _ in zip(self._done_ids(), range(len(self._entries) - self._max))]
                for old in victims:
                    entry = self._entries.pop(old)
                    with_owner = self._by_owner.get(entry.owner)
                    if with_owner is not None:
                        with_owner.remove(old)
        return rid

    def _drop_done(self, mine: deque[str], count: int) -> None:
        """Drop the oldest `count` finished futures of one owner (pending ones stay, in order)."""
        kept: list[str] = []
        while count and mine:
            old = mine.popleft()
            entry = self._entries.get(old)
            if entry is not None and entry.reply is None:
                kept.append(old)
                continue
            self._entries.pop(old, None)
            count -= 1
        mine.extendleft(reversed(kept))

    def _done_ids(self) -> Iterator[str]:
        return (rid for rid, entry in self._entries.items() if entry.reply is not None)

    def known(self, rid: str, owner: str) -> bool:
        with self._lock:
            entry = self._entries.get(rid)
            return entry is not None and entry.owner == owner

    def complete(self, rid: str, reply: Reply) -> None:
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None:
                return
            entry.reply = reply
            waiters, entry.waiters = entry.waiters, []
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    def run(self, rid: str, owner: str, job: Callable[[], Reply]) -> None:
        """Run `job` (admitted for `owner`) on a worker in `owner`'s turn; store its reply under `rid`."""

        def work() -> None:
            self.release(owner)
            self.complete(rid, answer_of(job))

        self.schedule(owner, work)

    async def call(self, owner: str, fn: Callable[[], T]) -> T:
        """`fn()`'s result, run on a worker in `owner`'s turn like a queued job (admitted first:
        ApiError 429 past the owner's bound), for routes that answer in the same request rather
        than through a future (Tinker's `/oai/api/v1`), so they cannot step around the per-key
        queue. A cancelled await does not stop `fn` once started; `fn` checks for that itself."""
        self.admit(owner)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, error: BaseException | None) -> None:
            if done.cancelled():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)  # type: ignore[arg-type]

        def work() -> None:
            self.release(owner)
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
                loop.call_soon_threadsafe(settle, None, exc)
            else:
                loop.call_soon_threadsafe(settle, result, None)

        self.schedule(owner, work)
        return await done

    async def wait(self, rid: str, timeout_s: float) -> Reply | None:
        """The reply, waiting up to `timeout_s`; None when it is not ready yet."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None:
                raise KeyError(rid)
            if entry.reply is not None:
                return entry.reply
            entry.waiters.append((loop, event))
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        with self._lock:
            entry = self._entries.get(rid)
            if entry is not None and (loop, event) in entry.waiters:
                entry.waiters.remove((loop, event))
            return entry.reply if entry is not None else None

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class Sequencer:
    """Runs one run's requests in seq_id order (see the module docstring)."""

    def __init__(self, futures: Futures, owner: str, gap_timeout_s: float, first_seq: int = 1):
        self.futures = futures
        self.owner = owner
        self.gap_timeout_s = gap_timeout_s
        self.next_seq = first_seq
        self.pending: dict[int, tuple[str, Callable[[], Reply], int]] = {}  # seq_id -> (request_id, job, body bytes)
        self.late: list[tuple[str, Callable[[], Reply], int]] = []
        self.seen: OrderedDict[int, tuple[str, bytes]] = OrderedDict()  # seq_id -> (request_id, body digest)
        self.skipped: set[int] = set()  # seq_ids refused before they were queued: their turn passes at once
        self.running = False
        self.closed = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def submit(self, seq_id: int | None, job: Callable[[], Reply], digest: bytes = b"", size: int = 0) -> str:
        """The request_id of `job` at `seq_id` (the earlier one for a re-sent seq_id with the same
        `digest`; ApiError 400 for one with another; ApiError 429 past the owner's bound on queued
        work, `Futures.admit`). A request without a seq_id, or one whose turn was skipped, runs as
        soon as the run is free. `size`: the request body's bytes (held until it starts)."""
        with self._lock:
            if self.closed:
                raise StateError("this training run was closed (its session ended); start a new one")
            if seq_id is not None and seq_id in self.seen:
                rid, before = self.seen[seq_id]
                if before != digest:
                    raise ApiError(400, "sequence_reused", f"seq_id {seq_id} of this training run was already used for "
                                   "another request; a retry must resend the same request, a new request needs the "
                                   "next seq_id", "seq_id")
                return rid
            # Counted until it starts: a request waiting for its turn (a gapped seq_id holds its
            # parsed body until the gap timeout) is queued work like one waiting for a worker.
            self.futures.admit(self.owner, size)
            rid = self.futures.new(self.owner)
            if seq_id is not None:
                self.seen[seq_id] = (rid, digest)
                while len(self.seen) > 4096:
                    self.seen.popitem(last=False)
            if seq_id is not None:
                self.skipped.discard(seq_id)  # it came after all: it runs in its turn
            if seq_id is None or seq_id < self.next_seq:
                self.late.append((rid, job, size))
            else:
                self.pending[seq_id] = (rid, job, size)
        self._pump()
        return rid

    def skip(self, seq_id: int | None) -> None:
        """`seq_id` was refused before it was queued (a 422 decided from the request): the client
        will not send it again, so the requests after it do not wait the gap timeout for it. Only
        seq_ids within the window of `seen` ahead count (a bounded set)."""
        with self._lock:
            if (seq_id is None or seq_id < self.next_seq or seq_id in self.seen or seq_id in self.pending
                    or seq_id >= self.next_seq + 4096 or len(self.skipped) >= 4096):
                return
            self.skipped.add(seq_id)
        self._pump()

    def _pump(self) -> None:
        with self._lock:
            if self.running or self.closed:
                return
            while self.next_seq in self.skipped:
                self.skipped.discard(self.next_seq)
                self.next_seq += 1
            if self.late:
                rid, job, size = self.late.pop(0)
                advance = False
            elif self.next_seq in self.pending:
                rid, job, size = self.pending.pop(self.next_seq)
                advance = True
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
            else:
                if self.pending and self._timer is None:
                    self._timer = threading.Timer(self.gap_timeout_s, self._skip_gap)
                    self._timer.daemon = True
                    self._timer.start()
                return
            self.running = True
        self.futures.schedule(self.owner, lambda: self._run(rid, job, advance, size))

    def _run(self, rid: str, job: Callable[[], Reply], advance: bool, size: int = 0) -> None:
        self.futures.release(self.owner, size)
        reply = answer_of(job)
        with self._lock:
            self.running = False
            if advance:
                self.next_seq += 1
        self.futures.complete(rid, reply)
        self._pump()

    @property
    def idle(self) -> bool:
        """No request running or waiting."""
        with self._lock:
            return not self.running and not self.pending and not self.late

    def _skip_gap(self) -> None:
        with self._lock:
            self._timer = None
            if not self.running and self.pending and self.next_seq not in self.pending:
                self.next_seq = min(self.pending)
                self.skipped = {s for s in self.skipped if s >= self.next_seq}
        self._pump()

    def close(self, reason: str = "the training run was closed (its session ended)") -> None:
        """No more requests run: the waiting ones fail with `reason` (a user error) and stop counting
        against the owner's queued work."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            waiting = [(rid, size) for rid, _, size in [*self.late, *self.pending.values()]]
            self.late.clear()
            self.pending.clear()
            self.closed = True  # nothing starts after this
        body = json.dumps({"error": reason, "category": "user"}).encode()
        for rid, size in waiting:
            self.futures.release(self.owner, size)
            self.futures.complete(rid, Reply(200, body, "application/json"))
