"""floe's error types. Every input error names the offending field and says how to fix it.

Every error here survives `pickle` (Ray moves exceptions between processes): each class
rebuilds itself from the arguments its constructor takes (`__reduce__`). Nothing is pickled
on floe's own wire; HTTP errors travel as JSON (floe.protocol.errors).
"""

from __future__ import annotations

from typing import Any


class FloeError(Exception):
    """Base class of floe's own errors."""


class InvalidInput(FloeError, ValueError):
    """A request or config value is wrong. Raised before any state changes.

    `field` is a path such as ``batch.groups[0].samples[2].logprobs`` or
    ``loss_config.clip_low``; the message says what is wrong and what would be accepted.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.message))

    def to_dict(self) -> dict[str, str]:
        return {"error": "invalid_input", "field": self.field, "message": self.message}


class NotFound(InvalidInput):
    """The thing a request names does not exist, or the requester may not see it (a shared
    server answers both the same way, so ids of others' resources cannot be probed). HTTP 404."""


class StateError(FloeError, RuntimeError):
    """An operation is not possible in the backend's current state (e.g. unknown checkpoint)."""


class WorkerFailed(StateError):
    """A zone's worker process died, hung past its call bound, or raised outside floe's own
    errors (placements that run zones in other processes, e.g. Ray). `zone` is "policy",
    "sampler" or "reference", `rank` the worker's rank (policy) or replica index (sampler).
    The backend that raised it should be closed; a fresh one resumes from the last saved
    state (`floe serve --resume-latest`, `floe train --resume`)."""

    def __init__(self, zone: str, rank: int, message: str):
        self.zone = zone
        self.rank = rank
        self.message = message
        super().__init__(f"{zone} worker {rank}: {message}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.zone, self.rank, self.message))
