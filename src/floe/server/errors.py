"""The server's HTTP refusals: `ApiError` (auth, routing, ordering, limits) and `to_api_error`,
which turns any exception raised while serving into one. How an operation's exception maps to a
status and JSON body (and back, on the client) is the protocol's (floe.protocol.errors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from floe.protocol.errors import error_body


@dataclass
class ApiError(Exception):
    """An HTTP-level refusal raised by the server itself (auth, routing, ordering, limits)."""

    status: int
    error: str
    message: str
    field: str | None = None
    extra: dict[str, Any] | None = None  # further body keys (a WorkerFailed's zone and rank)

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"error": self.error, "message": self.message}
        if self.field is not None:
            out["field"] = self.field
        return {**out, **(self.extra or {})}


def to_api_error(exc: BaseException) -> ApiError:
    """The HTTP answer for an exception raised while serving a request (see error_body)."""
    if isinstance(exc, ApiError):
        return exc
    status, body = error_body(exc)
    extra = {k: v for k, v in body.items() if k not in ("error", "message", "field")}
    return ApiError(status, body["error"], body["message"], body.get("field"), extra or None)
