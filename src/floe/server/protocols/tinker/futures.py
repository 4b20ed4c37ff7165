"""Futures and per-run ordering for the Tinker protocol.

`Futures`: every model-touching request is answered at once with a `request_id`; the work runs
on a worker thread and its reply (status, body, media type, headers) is stored under that id
until `retrieve_future` collects it. A future belongs to the principal that made it: another
one's `retrieve_future` finds nothing (404). `wait` long-polls on the event loop (no thread
held) up to a bound the SDK's 45 s read timeout never reaches. The last `max_per_owner` replies
of each principal are kept (a retried retrieve gets the same answer), `max_entries` in all.

`Sequencer`: one per training run. Requests carry the client's `seq_id` (1, 2, ... per
TrainingClient); each runs only after every smaller one, so the chunks of a forward_backward
that arrive out of order are applied in `seq_id` order. A gap that stays open longer than
`gap_timeout_s` (a request the client reserved but never sent) is skipped. A re-sent `seq_id`
with the same body gets the original `request_id` (idempotent retries); with a different body
it is refused (409 `sequence_reused`): answering the old result would silently drop the new request.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

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


class Futures:
    """request_id -> reply, filled by worker threads, awaited by retrieve_future."""

    def __init__(self, workers: int = 8, max_entries: int = 20000, max_per_owner: int = 4096):
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._by_owner: dict[str, deque[str]] = {}
        self._lock = threading.Lock()
        self._max = max_entries
        self._max_per_owner = max_per_owner
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="floe-tinker")

    def new(self, owner: str) -> str:
        rid = uuid.uuid4().hex
        with self._lock:
            self._entries[rid] = _Entry(owner)
            mine = self._by_owner.setdefault(owner, deque())
            mine.append(rid)
            while len(mine) > self._max_per_owner:
                self._entries.pop(mine.popleft(), None)
            while len(self._entries) > self._max:
                old, entry = self._entries.popitem(last=False)
                with_owner = self._by_owner.get(entry.owner)
                if with_owner and with_owner[0] == old:
                    with_owner.popleft()
        return rid

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

    def run(self, rid: str, job: Callable[[], Reply]) -> None:
        """Run `job` on a worker thread and store its reply under `rid`."""
        self.executor.submit(lambda: self.complete(rid, job()))

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
        self.pending: dict[int, tuple[str, Callable[[], Reply]]] = {}
        self.late: list[tuple[str, Callable[[], Reply]]] = []
        self.seen: OrderedDict[int, tuple[str, bytes]] = OrderedDict()  # seq_id -> (request_id, body digest)
        self.running = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def submit(self, seq_id: int | None, job: Callable[[], Reply], digest: bytes = b"") -> str:
        """The request_id of `job` at `seq_id` (the earlier one for a re-sent seq_id with the same
        `digest`; ApiError 409 for one with another). A request without a seq_id, or one whose turn
        was skipped, runs as soon as the run is free."""
        with self._lock:
            if seq_id is not None and seq_id in self.seen:
                rid, before = self.seen[seq_id]
                if before != digest:
                    raise ApiError(409, "sequence_reused", f"seq_id {seq_id} of this training run was already used for "
                                   "another request; a retry must resend the same request, a new request needs the "
                                   "next seq_id", "seq_id")
                return rid
            rid = self.futures.new(self.owner)
            if seq_id is not None:
                self.seen[seq_id] = (rid, digest)
                while len(self.seen) > 4096:
                    self.seen.popitem(last=False)
            if seq_id is None or seq_id < self.next_seq:
                self.late.append((rid, job))
            else:
                self.pending[seq_id] = (rid, job)
        self._pump()
        return rid

    def _pump(self) -> None:
        with self._lock:
            if self.running:
                return
            if self.late:
                rid, job = self.late.pop(0)
                advance = False
            elif self.next_seq in self.pending:
                rid, job = self.pending.pop(self.next_seq)
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
        self.futures.executor.submit(self._run, rid, job, advance)

    def _run(self, rid: str, job: Callable[[], Reply], advance: bool) -> None:
        try:
            reply = job()
        except BaseException as exc:  # noqa: BLE001 - answered to the caller (jobs answer their own errors first)
            reply = Reply(200, f'{{"error": "internal error: {type(exc).__name__}", "category": "server"}}'.encode(),
                          "application/json")
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
        self._pump()

    def close(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
