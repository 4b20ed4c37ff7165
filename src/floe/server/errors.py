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

    def body(self) -> dict[str, Any]:
        out = {"error": self.error, "message": self.message}
        if self.field is not None:
            out["field"] = self.field
        return out


def to_api_error(exc: BaseException) -> ApiError:
    """The HTTP answer for an exception raised while serving a request (see error_body)."""
    if isinstance(exc, ApiError):
        return exc
    status, body = error_body(exc)
    return ApiError(status, body["error"], body["message"], body.get("field"))
