"""The one place the Ray placement waits for its workers (`ray.get`), always within a bound.

Every zone call is a `Call` (zone name, rank, Ray object ref). `gather` waits for a batch of
calls together with one deadline (`placement.call_timeout_s`) and turns every Ray failure into a
floe error naming the zone and the rank:
* the worker died (`ray.kill`, a crash, a lost node: RayActorError) → WorkerFailed, one line
  (the pid and Ray's exit type; Ray's full text goes to this module's debug log);
* no answer within the bound (a hung worker, a collective that never completes) → WorkerFailed
  naming the worker(s) that do not answer: every pending call's actor registered with `track`
  is pinged (`ping`, through its "ping" concurrency group, so a healthy peer blocked in a
  collective still answers) within PING_S; the silent or dead ones are named first, the peers
  that answered are named as "waiting". Actors not tracked cannot be told apart: then every
  pending worker is named;
* the worker raised one of floe's own errors (InvalidInput, StateError, ...) → that same error
  (the zones' contracts hold across processes);
* the worker raised anything else → WorkerFailed with the exception's type and text.
A failed call does not wait for the others of its batch: the first failure is raised as soon as
it is known, so a dead sampler is reported while its peers are still blocked in a collective.
The calls it abandons are drained in the background (`_drain`): their late errors never
surface as Ray's "Unhandled error" tracebacks.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from floe.errors import FloeError, WorkerFailed

__all__ = ["PING_GROUPS", "Call", "fetch", "gather", "one", "track", "untrack"]

log = logging.getLogger(__name__)

# Actor-class option (`ray.remote(concurrency_groups=PING_GROUPS)`) that lets `gather` ping a
# worker while its main thread is busy; such actors are registered with `track`.
PING_GROUPS = {"ping": 1}
PING_S = 5.0  # how long a ping may take before its worker counts as not answering

_tracked: dict[str, tuple[str, int, Any]] = {}  # actor id (hex) -> (zone, rank, handle)
_tracked_lock = threading.Lock()


@dataclass(frozen=True)
class Call:
    """One zone call in flight: `ref` is what `actor.method.remote(...)` returned."""

    zone: str
    rank: int
    ref: Any


def track(zone: str, rank: int, actor: Any) -> None:
    """Register `actor` (created with `concurrency_groups=PING_GROUPS` and a `pid()` method) as
    the worker of `zone` `rank`, so a timeout can ping it."""
    with _tracked_lock:
        _tracked[actor._actor_id.hex()] = (zone, rank, actor)


def untrack(actors: list[Any]) -> None:
    """Forget actors (their backend closed)."""
    with _tracked_lock:
        for actor in actors:
            _tracked.pop(actor._actor_id.hex(), None)


def _actor_of(ref: Any) -> Any | None:
    with contextlib.suppress(Exception):  # a ref that is not an actor task's (e.g. ray.put)
        with _tracked_lock:
            entry = _tracked.get(ref.task_id().actor_id().hex())
        return entry[2] if entry is not None else None
    return None


def _died(error: BaseException) -> str:
    """One line for a dead worker: its pid and Ray's exit type and detail (first sentence)."""
    log.debug("Ray's report of a dead worker: %s", error)
    if getattr(error, "actor_init_failed", False):  # its constructor raised: that exception's line
        lines = str(error).splitlines()
        last = max((i for i, line in enumerate(lines) if line.startswith("  File ")), default=-1)
        rest = [line for line in lines[last + 1:] if line.strip() and not line.startswith(" ")]
        return f"the worker failed to start: {(rest[0] if rest else lines[-1]).strip()[:300]}"
    text = " ".join(str(error).split())
    pid = text.split(" pid: ", 1)[1].split(" ", 1)[0] if " pid: " in text else "?"
    reason = ""
    if "Worker exit type:" in text:
        reason = text.split("Worker exit type:", 1)[1]
        reason = reason.split(" Some common causes", 1)[0].split(". ", 1)[0].strip()
        reason = reason.replace(" Worker exit detail:", ":")
    elif "ray.kill" in text or "killed" in text:
        reason = "killed"
    return f"the worker (pid {pid}) died ({reason or type(error).__name__}); " + RESUME


RESUME = "close this backend and start a fresh one from the last saved state"


def _floe_error(call: Call, error: BaseException, timeout_s: float) -> BaseException:
    if isinstance(error, RayTaskError):
        cause = error.cause
        if isinstance(cause, FloeError):
            return cause
        if isinstance(cause, RayActorError):
            return WorkerFailed(call.zone, call.rank, f"a worker it called died: {_died(cause)}")
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        log.debug("%s worker %d raised: %s", call.zone, call.rank, cause)
        return WorkerFailed(call.zone, call.rank, f"{type(cause).__name__}: {first[:300]}; {RESUME}")
    if isinstance(error, RayActorError):
        return WorkerFailed(call.zone, call.rank, _died(error))
    if isinstance(error, FloeError):
        return error
    return WorkerFailed(call.zone, call.rank, f"{type(error).__name__}: {error}")


def _silent(pending: list[Call], timeout_s: float) -> WorkerFailed:
    """WorkerFailed for calls still pending at the deadline, naming the workers that do not answer."""
    handles: dict[int, Any] = {}
    pings: dict[Any, int] = {}
    for i, call in enumerate(pending):
        actor = _actor_of(call.ref)
        if actor is not None:
            handles[i] = actor
            with contextlib.suppress(Exception):
                pings[actor.pid.options(concurrency_group="ping").remote()] = i
    answered: set[int] = set()
    dead: set[int] = set()
    deadline = time.monotonic() + min(PING_S, timeout_s)
    waiting = dict(pings)
    while waiting:
        ready, _ = ray.wait(list(waiting), num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
        if not ready:
            break
        for ref in ready:
            i = waiting.pop(ref)
            try:
                ray.get(ref, timeout=0)
                answered.add(i)
            except Exception:  # noqa: BLE001 - a ping that fails: the worker is gone
                dead.add(i)
    _drain(list(waiting))
    name = [f"{c.zone} {c.rank}" for c in pending]
    if not handles:  # nothing to ping: every pending worker is a suspect
        return WorkerFailed(pending[0].zone, pending[0].rank,
                            f"no answer within call_timeout_s = {timeout_s:g} s from {', '.join(name)} "
                            "(one of them hangs or is lost; the others may be waiting for it in a collective); " + RESUME)
    silent = [i for i in range(len(pending)) if i not in answered]
    culprit = pending[silent[0]] if silent else pending[0]
    parts = [f"no answer within call_timeout_s = {timeout_s:g} s"]
    hung = [name[i] for i in silent if i not in dead]
    gone = [name[i] for i in silent if i in dead]
    if hung:
        parts.append(f"not answering (hung or lost): {', '.join(hung)}")
    if gone:
        parts.append(f"dead: {', '.join(gone)}")
    alive = [name[i] for i in sorted(answered)]
    if alive:
        parts.append(f"alive but waiting (e.g. in a collective): {', '.join(alive)}")
    return WorkerFailed(culprit.zone, culprit.rank, "; ".join(parts) + "; " + RESUME)


def _drain(refs: list[Any]) -> None:
    """Wait for abandoned calls in a daemon thread and drop their results, so Ray never prints
    their late errors as "Unhandled error" (it does for a failed ref nobody got)."""
    if not refs:
        return

    def wait() -> None:
        left = list(refs)
        while left and ray.is_initialized():
            with contextlib.suppress(BaseException):  # its error is already reported, or Ray is going
                done, left = ray.wait(left, num_returns=len(left), timeout=1.0)
                for ref in done:
                    with contextlib.suppress(BaseException):
                        ray.get(ref, timeout=0)
                continue
            return

    threading.Thread(target=wait, name="floe-ray-drain", daemon=True).start()


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
            error = _silent([calls[i] for i in sorted(pending.values())], timeout_s)
            _drain(list(pending))
            raise error
        for ref in ready:
            index = pending.pop(ref)
            try:
                results[index] = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
            except Exception as e:  # noqa: BLE001 - every Ray failure becomes a floe error
                _drain(list(pending))
                raise _floe_error(calls[index], e, timeout_s) from None
    return [results[i] for i in range(len(calls))]


def one(call: Call, timeout_s: float) -> Any:
    """The result of one call (as `gather`)."""
    return gather([call], timeout_s)[0]


def fetch(refs: list[Any], zone: str, rank: int, timeout_s: float) -> list[Any]:
    """Objects from Ray's object store (inside a worker: the buckets of an object-store sync),
    within `timeout_s`; failures as `gather`."""
    return gather([Call(zone, rank, r) for r in refs], timeout_s)
