"""`FairRLock`: a reentrant lock that threads acquire in the order they asked for it.

`threading.RLock` hands a released lock to whichever waiting thread wakes first, so one tenant
with many requests waiting on a shared model can keep another tenant's single request waiting
indefinitely. With first-come-first-served order a request waits for at most the holders that
asked before it (the Tinker service bounds how many those are: its workers).
"""

from __future__ import annotations

import threading
from collections import deque
from types import TracebackType


class FairRLock:
    """A reentrant FIFO lock (`with lock:` like `threading.RLock`)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._waiting: deque[int] = deque()  # thread idents, in arrival order

    def acquire(self) -> bool:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            self._waiting.append(me)
            while self._owner is not None or self._waiting[0] != me:
                self._cond.wait()
            self._waiting.popleft()
            self._owner, self._depth = me, 1
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
