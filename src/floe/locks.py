"""`FairRLock`: a reentrant lock handed round-robin over the tenants waiting for it.

`threading.RLock` hands a released lock to whichever waiting thread wakes first, so one tenant
with many requests waiting on a shared model can keep another tenant's single request waiting
indefinitely. `FairRLock` hands it to the waiter whose tenant held it least recently (ties, and
each tenant's own waiters, first come first served): a tenant's call waits for the holder and
at most one call of each other tenant waiting, however many calls those tenants queued.

The tenant of a thread is set by `tenant(name)` around its work (the Tinker service's workers
set their job's owner); threads without one share the tenant None.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

_local = threading.local()


@contextmanager
def tenant(name: str | None) -> Iterator[None]:
    """`FairRLock`s acquired inside count for tenant `name` (see the module docstring)."""
    before = getattr(_local, "tenant", None)
    _local.tenant = name
    try:
        yield
    finally:
        _local.tenant = before


class FairRLock:
    """A reentrant lock, fair across tenants (`with lock:` like `threading.RLock`)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._arrivals = itertools.count()
        self._waiting: list[tuple[int, str | None, int]] = []  # (arrival, tenant, thread ident)
        self._served: dict[str | None, int] = {}  # tenant -> when it last took the lock
        self._turns = itertools.count()

    def _next(self) -> int:
        """The thread ident whose turn is next among the waiters."""
        return min(self._waiting, key=lambda w: (self._served.get(w[1], -1), w[0]))[2]

    def acquire(self) -> bool:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            who = getattr(_local, "tenant", None)
            entry = (next(self._arrivals), who, me)
            self._waiting.append(entry)
            while self._owner is not None or self._next() != me:
                self._cond.wait()
            self._waiting.remove(entry)
            self._owner, self._depth = me, 1
            self._served[who] = next(self._turns)
            return True

    def release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("cannot release a FairRLock this thread does not hold")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()
