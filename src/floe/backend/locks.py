"""Locks of the Backend: `SharedLock` (a shared/exclusive lock) and `ModeLock` (colocation modes).

`SharedLock`: many holders of `shared()` at once, or one of `exclusive()`.

The Backend holds the sampler shared for `sample` (several generate together) and
exclusively for a sync or a state load (which wait for running samples). A waiting exclusive
holder blocks new shared ones, so a stream of samples cannot starve a sync. Not reentrant.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
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



class ModeLock:
    """Modes for zones that share devices (colocation): "train", "sync" or "sample".

    Any number of holders of the current mode run together; entering another mode waits until
    every holder of the current one has left, then calls `switch(mode)` once (e.g. the sampler
    sleeps and the policy onloads) before any holder of the new mode proceeds. While another
    mode waits, newcomers of the current one wait too, so no mode starves. When `switch`
    raises, the mode becomes unknown (None) and the next holder of any mode switches again.
    Not reentrant: one operation holds one mode.
    """

    def __init__(self, switch: Callable[[str], None]) -> None:
        self._switch = switch
        self._cond = threading.Condition()
        self._mode: str | None = None
        self._holders = 0
        self._switching = False
        self._waiting: dict[str, int] = {}

    @property
    def mode(self) -> str | None:
        """The mode the zones are in (None before the first operation or after a failed switch)."""
        return self._mode

    def _blocked(self, mode: str) -> bool:
        if self._switching:
            return True
        if self._mode != mode:
            return self._holders > 0
        return any(n for m, n in self._waiting.items() if m != mode)  # another mode goes next

    @contextmanager
    def hold(self, mode: str) -> Iterator[None]:
        with self._cond:
            self._waiting[mode] = self._waiting.get(mode, 0) + 1
            try:
                while self._blocked(mode):
                    self._cond.wait()
            finally:
                self._waiting[mode] -= 1
            must_switch = self._mode != mode
            if must_switch:
                self._switching = True
            else:
                self._holders += 1
        if must_switch:
            try:
                self._switch(mode)
            except BaseException:
                with self._cond:
                    self._mode, self._switching = None, False
                    self._cond.notify_all()
                raise
            with self._cond:
                self._mode, self._switching = mode, False
                self._holders += 1
                self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._holders -= 1
                self._cond.notify_all()
