"""Errors on the wire, both directions, shared by client and server.

An operation's exception becomes an HTTP status and a JSON body on the server
(`error_body`), and that status and body become the same exception again on the client
(`raise_remote_error`), so remote code fails exactly like in-process code. Every error body is
`{"error": code, "message": text, "field"?: path}`; a WorkerFailed's 409 adds `"zone"` and `"rank"`,
and the client raises WorkerFailed again. Also here: `WireError` (a malformed floe
message) and the client-side `RemoteError` / `RemoteUnavailable` for refusals that have no
in-process equivalent. Every class survives pickle with the same type, str and attributes.
"""

from __future__ import annotations

from typing import Any, NoReturn

from floe.errors import FloeError, InvalidInput, NotFound, StateError, WorkerFailed


class WireError(InvalidInput):
    """A body that is not a well-formed floe message. The server answers 400."""


class RemoteError(FloeError):
    """The server refused or failed a request for a reason with no in-process equivalent
    (auth, ordering, payload size, server fault). `status` is the HTTP status, `error` the
    body's error code, `message` its text."""

    def __init__(self, status: int, error: str, message: str):
        self.status, self.error, self.message = status, error, message
        super().__init__(f"HTTP {status} {error}: {message}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.status, self.error, self.message))


class RemoteUnavailable(RemoteError, ConnectionError):
    """The server could not be reached (or kept answering 502/503/504) until the call's deadline."""

    def __init__(self, message: str):
        super().__init__(503, "unavailable", message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message,))


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and JSON body for an exception an operation raised.

    WireError -> 400 "bad_request", NotFound -> 404 "not_found", InvalidInput -> 422 "invalid_input"
    (all with `field`),
    StateError -> 409 "state_error" (a WorkerFailed also carries "zone" and "rank"),
    anything else -> 500 "internal_error".
    """
    if isinstance(exc, WireError):
        return 400, _body("bad_request", exc.message, exc.field)
    if isinstance(exc, NotFound):
        return 404, _body("not_found", exc.message, exc.field)
    if isinstance(exc, InvalidInput):
        return 422, _body("invalid_input", exc.message, exc.field)
    if isinstance(exc, WorkerFailed):
        return 409, {**_body("state_error", str(exc)), "zone": exc.zone, "rank": exc.rank}
    if isinstance(exc, StateError):
        return 409, _body("state_error", str(exc))
    return 500, _body("internal_error", f"{type(exc).__name__}: {exc}")


def _body(error: str, message: str, field: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"error": error, "message": message}
    if field is not None:
        out["field"] = field
    return out


UNAUTHORIZED_FIX = "set $FLOE_TOKEN or pass token= to floe.connect (backend.token in a recipe) to the server's token"


def raise_remote_error(status: int, body: Any) -> NoReturn:
    """Re-raise a server's error body as the exception the in-process backend would raise:
    InvalidInput / NotFound (same field and message), WorkerFailed (a state_error with zone and rank: same
    zone, rank and message), StateError, else RemoteError(status, code, message).
    A 401's message ends with the fix (UNAUTHORIZED_FIX)."""
    if not isinstance(body, dict):
        body = {}
    error, message, field = str(body.get("error", "http_error")), str(body.get("message", "")), body.get("field")
    if status == 401:
        message = f"{message or 'unauthorized'}; {UNAUTHORIZED_FIX}"
    if error in ("invalid_input", "bad_request") and isinstance(field, str):
        raise InvalidInput(field, message)
    if error == "not_found" and isinstance(field, str):
        raise NotFound(field, message)
    if error == "state_error":
        zone, rank = body.get("zone"), body.get("rank")
        if isinstance(zone, str) and type(rank) is int:
            prefix = f"{zone} worker {rank}: "
            raise WorkerFailed(zone, rank, message.removeprefix(prefix))
        raise StateError(message)
    raise RemoteError(status, error, message or f"HTTP {status}")
