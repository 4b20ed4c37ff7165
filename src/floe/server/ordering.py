"""Per-client ordering and idempotent retries.

Each client sends `X-Floe-Client` (an id) and `X-Floe-Seq` (1, 2, 3, ...). The `Ledger` runs a
client's requests in sequence order: request k starts only after k-1 has finished (waiting at
most `gap_timeout` seconds, then 425). The first request seen from a client sets its starting
point, so a client keeps working across a server restart. A request whose seq was already
used returns the first run's reply without running again (while it is in the window of kept
results, else 409); the same seq with a different body (by SHA-256) gets 409. The work of a
request runs in its own task, so a client that disconnects never leaves a retry hanging.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from floe.server.errors import ApiError


@dataclass(frozen=True)
class Reply:
    """A finished HTTP answer, kept so that a retried request gets the very same bytes."""

    status: int
    body: bytes
    media_type: str
    seconds: float = 0.0  # time spent running the operation (the Server-Timing header)


@dataclass
class _Entry:
    digest: bytes
    done: asyncio.Event = field(default_factory=asyncio.Event)
    reply: Reply | None = None


class _ClientLog:
    def __init__(self, next_seq: int):
        self.next_seq = next_seq  # the seq allowed to start once nothing is running
        self.entries: OrderedDict[int, _Entry] = OrderedDict()
        self.changed = asyncio.Condition()


class Ledger:
    def __init__(self, window: int, max_clients: int, gap_timeout: float):
        self.window = window
        self.max_clients = max_clients
        self.gap_timeout = gap_timeout
        self._clients: OrderedDict[str, _ClientLog] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()

    def _log(self, client: str, seq: int) -> _ClientLog:
        log = self._clients.get(client)
        if log is None:
            log = self._clients[client] = _ClientLog(seq)
            while len(self._clients) > self.max_clients:
                self._clients.popitem(last=False)
        self._clients.move_to_end(client)
        return log

    async def run(self, client: str, seq: int, digest: bytes, produce: Callable[[], Awaitable[Reply]]) -> tuple[Reply, bool]:
        """The reply for request (client, seq) and whether it is a replay of an earlier run."""
        log = self._log(client, seq)
        async with log.changed:
            try:
                await asyncio.wait_for(
                    log.changed.wait_for(lambda: seq in log.entries or seq <= log.next_seq), self.gap_timeout
                )
            except TimeoutError:
                raise ApiError(
                    425, "sequence_gap",
                    f"request {seq} waited {self.gap_timeout:g}s for request {log.next_seq} of this client, which never came",
                ) from None
            entry = log.entries.get(seq)
            owner = entry is None
            if entry is None:
                if seq < log.next_seq:
                    raise ApiError(409, "sequence_expired", f"request {seq} is older than the {self.window} results kept")
                entry = log.entries[seq] = _Entry(digest)
        if entry.digest != digest:
            raise ApiError(409, "sequence_reused", f"request id {seq} was already used for a different request")
        if owner:
            task = asyncio.ensure_future(self._complete(log, seq, entry, produce))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        await entry.done.wait()
        assert entry.reply is not None
        return entry.reply, not owner

    async def _complete(self, log: _ClientLog, seq: int, entry: _Entry, produce: Callable[[], Awaitable[Reply]]) -> None:
        try:
            entry.reply = await produce()
        except BaseException as exc:  # produce() returns error replies itself; this is a last resort
            entry.reply = Reply(500, f'{{"error":"internal_error","message":"{type(exc).__name__}"}}'.encode(), "application/json")
            raise
        finally:
            entry.done.set()
            async with log.changed:
                log.next_seq = max(log.next_seq, seq + 1)
                while len(log.entries) > self.window and next(iter(log.entries.values())).done.is_set():
                    log.entries.popitem(last=False)
                log.changed.notify_all()
