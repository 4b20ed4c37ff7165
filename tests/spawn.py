"""Spawned torch.distributed ranks for tests, bounded in time.

`run_ranks(fn, world, args, timeout_s)` starts `world` processes (torch.multiprocessing spawn,
`fn(rank, world, *args)` in each) and waits for all of them at most `timeout_s` seconds. A rank
that raises fails the call with its traceback; ranks still running at the deadline are killed
and the call fails saying how long they ran and how loaded the machine was, instead of hanging
until pytest's own timeout hides which step was slow.

`join_all(processes)` is the same bound for tests that start their own processes.

A rank killed by a signal (a native abort, e.g. gloo's TCP transport calling std::terminate,
which a CI run saw once on a loaded machine: "terminate called without an active exception"
at the first collective of test_fsdp) gets the whole spawn retried once, after a warning with
that rank's Python stack (faulthandler is on in every rank) and with the callers' rendezvous
files removed so the retry meets afresh; a rank that raises, a second abort, or a hang fails.

`RANK_TIMEOUT_S` is the bound the spawned-rank tests use: generous, so a loaded shared machine
(load average about 10 on 2 cores runs these processes about 5x slower) still finishes, and
scaled by $FLOE_TEST_SLOWDOWN for slower machines. `collective_timeout()` is the timeout the
ranks give torch.distributed, so a rank whose peer died fails instead of waiting forever.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessExitedException

SLOWDOWN = float(os.environ.get("FLOE_TEST_SLOWDOWN", "1"))
RANK_TIMEOUT_S = 600.0 * SLOWDOWN


def collective_timeout() -> timedelta:
    """What spawned ranks pass to init_process_group(timeout=...): a dead peer ends a collective."""
    return timedelta(seconds=RANK_TIMEOUT_S / 2)


def _traced(rank: int, fn: Callable[..., Any], *args: Any) -> None:
    """A spawned rank: faulthandler on (a native abort prints the rank's Python stack), then fn."""
    faulthandler.enable(file=sys.stderr, all_threads=True)
    fn(rank, *args)


def _run_once(fn: Callable[..., Any], world: int, args: tuple[Any, ...], timeout_s: float) -> None:
    began = time.monotonic()
    context = mp.start_processes(_traced, args=(fn, world, *args), nprocs=world, join=False, start_method="spawn")
    try:
        while not context.join(timeout=max(0.0, min(5.0, began + timeout_s - time.monotonic()))):
            if time.monotonic() - began >= timeout_s:
                load = os.getloadavg()[0]
                raise AssertionError(f"{world} spawned ranks of {getattr(fn, '__name__', fn)} still running after "
                                     f"{timeout_s:.0f} s (load average {load:.1f}); set FLOE_TEST_SLOWDOWN on a slow machine")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(10)


def run_ranks(fn: Callable[..., Any], world: int, args: tuple[Any, ...], timeout_s: float = RANK_TIMEOUT_S,
              rendezvous: Sequence[Path | str] = ()) -> float:
    """Run `fn(rank, world, *args)` on `world` spawned ranks; returns the seconds they took.
    AssertionError when a rank fails or the ranks are not done within `timeout_s` (each attempt).
    `rendezvous`: the files the ranks' `file://` init methods use, removed before a retry."""
    began = time.monotonic()
    try:
        _run_once(fn, world, args, timeout_s)
    except ProcessExitedException as e:
        if e.signal_name is None:  # a Python exception in a rank (its traceback is in e): a real failure
            raise
        warnings.warn(f"rank {e.error_index} of {getattr(fn, '__name__', fn)} was killed by {e.signal_name} "
                      "(its Python stack is in the captured stderr); retrying the spawn once", stacklevel=2)
        for path in rendezvous:
            Path(path).unlink(missing_ok=True)
        _run_once(fn, world, args, timeout_s)
    return time.monotonic() - began


def join_all(processes: list[Any], timeout_s: float = RANK_TIMEOUT_S) -> None:
    """Wait for started processes (multiprocessing.Process) within one deadline of `timeout_s`
    for all of them; the ones still alive then are killed (the caller asserts on exit codes
    and on `is_alive`)."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))


def run_all(processes: list[Any], what: str, timeout_s: float = RANK_TIMEOUT_S) -> None:
    """Start `processes`, wait for them (`join_all`), and assert none hung ("`what` hung") and
    every one exited 0."""
    for process in processes:
        process.start()
    join_all(processes, timeout_s)
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"{what} hung"
    assert [p.exitcode for p in processes] == [0] * len(processes)
