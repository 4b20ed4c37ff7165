"""Authentication: one bearer token, compared in constant time; and the rule that a server
listening beyond loopback must have one."""

from __future__ import annotations

import hmac
import ipaddress

from floe.errors import InvalidInput
from floe.server.errors import ApiError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname: assume it is reachable from elsewhere


def check_exposure(host: str, token: str | None) -> None:
    """Refuse to serve on a non-loopback address without a token."""
    if not token and not is_loopback(host):
        raise InvalidInput(
            "token",
            f"listening on {host!r} (not loopback) needs a bearer token: pass --token or set FLOE_TOKEN, "
            "or listen on 127.0.0.1",
        )


def check_bearer(authorization: str | None, token: str | None) -> None:
    """Raise 401 unless `authorization` is `Bearer <token>` (no-op when no token is set)."""
    if not token:
        return
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise ApiError(401, "unauthorized", "missing or wrong bearer token (Authorization: Bearer <token>)")
