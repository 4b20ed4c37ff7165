"""Errors across HTTP, both directions: exception -> (status, JSON body) on the server, and
(status, JSON body) -> the same exception on the client, so remote code fails exactly like
in-process code. Every error body is `{"error": code, "message": text, "field"?: path}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

from floe.errors import FloeError, InvalidInput, StateError
from floe.server.wire import WireError


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


class RemoteError(FloeError):
    """The server refused or failed a request for a reason with no in-process equivalent
    (auth, ordering, payload size, server fault). `status` is the HTTP status."""

    def __init__(self, status: int, error: str, message: str):
        self.status, self.error, self.message = status, error, message
        super().__init__(f"HTTP {status} {error}: {message}")


class RemoteUnavailable(RemoteError, ConnectionError):
    """The server could not be reached (or kept answering 503) until the call's deadline."""

    def __init__(self, message: str):
        super().__init__(503, "unavailable", message)


def to_api_error(exc: BaseException) -> ApiError:
    """The HTTP answer for an exception raised while serving a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, WireError):
        return ApiError(400, "bad_request", exc.message, exc.field)
    if isinstance(exc, InvalidInput):
        return ApiError(422, "invalid_input", exc.message, exc.field)
    if isinstance(exc, StateError):
        return ApiError(409, "state_error", str(exc))
    return ApiError(500, "internal_error", f"{type(exc).__name__}: {exc}")


def raise_remote_error(status: int, body: Any) -> NoReturn:
    """Re-raise a server's error body as the exception the in-process backend would raise."""
    if not isinstance(body, dict):
        body = {}
    error, message, field = str(body.get("error", "http_error")), str(body.get("message", "")), body.get("field")
    if error in ("invalid_input", "bad_request") and isinstance(field, str):
        raise InvalidInput(field, message)
    if error == "state_error":
        raise StateError(message)
    raise RemoteError(status, error, message or f"HTTP {status}")
