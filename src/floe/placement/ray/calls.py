"""The one place the Ray placement waits for its workers (`ray.get`), always within a bound.

Every zone call is a `Call` (zone name, rank, Ray object ref). `gather` waits for a batch of
calls together with one deadline (`placement.call_timeout_s`) and turns every Ray failure into a
floe error naming the zone and the rank:
* the worker died (`ray.kill`, a crash, a lost node: RayActorError) → WorkerFailed;
* no answer within the bound (a hung worker, a collective that never completes) → WorkerFailed;
* the worker raised one of floe's own errors (InvalidInput, StateError, ...) → that same error
  (the zones' contracts hold across processes);
* the worker raised anything else → WorkerFailed with the exception's type and text.
A failed call does not wait for the others of its batch: the first failure is raised as soon as
it is known, so a dead sampler is reported while its peers are still blocked in a collective.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from floe.errors import FloeError, WorkerFailed

__all__ = ["Call", "fetch", "gather", "one"]


@dataclass(frozen=True)
class Call:
    """One zone call in flight: `ref` is what `actor.method.remote(...)` returned."""

    zone: str
    rank: int
    ref: Any


def _floe_error(call: Call, error: BaseException, timeout_s: float) -> BaseException:
    if isinstance(error, RayTaskError):
        cause = error.cause
        if isinstance(cause, FloeError):
            return cause
        if isinstance(cause, RayActorError):
            return WorkerFailed(call.zone, call.rank, f"a worker it called died: {cause}")
        return WorkerFailed(call.zone, call.rank, f"{type(cause).__name__}: {cause}")
    if isinstance(error, RayActorError):
        reason = " ".join(str(error).split())[:1500]
        return WorkerFailed(call.zone, call.rank, f"the worker died ({type(error).__name__}: {reason}); "
                            "close this backend and start a fresh one from the last saved state")
    if isinstance(error, GetTimeoutError):
        return WorkerFailed(call.zone, call.rank, f"no answer within call_timeout_s = {timeout_s:g} s (hung or lost)")
    if isinstance(error, FloeError):
        return error
    return WorkerFailed(call.zone, call.rank, f"{type(error).__name__}: {error}")


def gather(calls: list[Call], timeout_s: float) -> list[Any]:
    """The results of `calls`, in their order, waited for together within `timeout_s` seconds
    (from now). Raises the first failure as the module docstring says."""
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    pending = {c.ref: i for i, c in enumerate(calls)}
    while pending:
        left = deadline - time.monotonic()
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(left, 0.0))
        if not ready:
            late = calls[next(iter(pending.values()))]
            raise _floe_error(late, GetTimeoutError(), timeout_s)
        for ref in ready:
            index = pending.pop(ref)
            try:
                results[index] = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
            except Exception as e:  # noqa: BLE001 - every Ray failure becomes a floe error
                raise _floe_error(calls[index], e, timeout_s) from None
    return [results[i] for i in range(len(calls))]


def one(call: Call, timeout_s: float) -> Any:
    """The result of one call (as `gather`)."""
    return gather([call], timeout_s)[0]


def fetch(refs: list[Any], zone: str, rank: int, timeout_s: float) -> list[Any]:
    """Objects from Ray's object store (inside a worker: the buckets of an object-store sync),
    within `timeout_s`; failures as `gather`."""
    return gather([Call(zone, rank, r) for r in refs], timeout_s)
