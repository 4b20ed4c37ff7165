"""A shared/exclusive lock: many holders of `shared()` at once, or one of `exclusive()`.

The Backend holds the sampler shared for `sample` (several generate together) and
exclusively for a sync or a state load (which wait for running samples). A waiting exclusive
holder blocks new shared ones, so a stream of samples cannot starve a sync. Not reentrant.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class SharedLock:
    """Readers-writer lock with writer preference."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0  # exclusive holders waiting

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                if not self._shared:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            except BaseException:  # interrupted while waiting: let blocked shared holders in
                self._waiting -= 1
                self._cond.notify_all()
                raise
            self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()
