"""Connections: the bounds uvicorn does not set itself, as its own HTTP protocol class.

* `[server] max_connections`: at the limit, a new connection takes the place of the connection
  that has waited longest for a request head (a stalled one, or an idle keep-alive one, which a
  client reopens); only when every open connection is in the middle of a request is the new one
  closed as soon as it is accepted. So connections that never send a request (no credential is
  checked before a complete head) cannot lock clients out, and the descriptors stay bounded.
* `[server] header_timeout_s`: a connection must send a complete request head within this time
  of opening, and of its previous response ending; otherwise it is closed (a client that opens
  sockets and never finishes a request holds nothing for long). Request bodies are bounded by
  the edge (`body_timeout_s`), idle keep-alive connections by uvicorn's `timeout_keep_alive`.
* `until_disconnected`: a sampling request whose client went away is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["guarded_protocol", "until_disconnected"]

T = TypeVar("T")

log = logging.getLogger("floe.server")


def guarded_protocol(max_connections: int, header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the two bounds of the module docstring."""

    # The connections waiting for a request head, the longest-waiting first (dicts keep
    # insertion order): the ones a new connection may replace at the limit.
    waiting: dict[H11Protocol, None] = {}

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                if not waiting:
                    log.warning("connection refused: [server] max_connections reached, every connection "
                                "mid-request", extra={"limit": max_connections})
                    transport.close()
                    return
                oldest = next(iter(waiting))
                log.warning("connection closed for a new one: [server] max_connections reached, it had sent no "
                            "request head", extra={"limit": max_connections})
                oldest._disarm()  # type: ignore[attr-defined]
                oldest.transport.close()
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._expire)
            waiting[self] = None

        def _disarm(self) -> None:
            waiting.pop(self, None)
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expire(self) -> None:
            self._head_timer = None
            waiting.pop(self, None)
            if self.cycle is None or self.cycle.response_complete:  # no request head arrived in time
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a request is being served: its body is the edge's to bound

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol


async def until_disconnected(request: Any, work: Awaitable[T]) -> T:
    """`await work`, cancelled when the client of `request` (a Starlette Request whose body was
    read) disconnects first. A sample request still waiting for its batch window then never
    runs; one already in the engine finishes there (bounded by its max_tokens) and its answer
    is dropped."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        # After the body, the next ASGI message is the disconnect (Request.is_disconnected's
        # non-blocking peek cannot see it through Starlette's middleware wrappers).
        while not task.done():
            message = await request.receive()
            if message.get("type") == "http.disconnect":
                task.cancel()
                return
            await asyncio.sleep(0.05)  # anything else (nothing is expected): do not spin

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    finally:
        watcher.cancel()
