"""The rule that a server listening beyond loopback must have a credential. Who a request is
(the bearer token, a Tinker key, or the local user) is resolved by server/principals.py at the
edge (server/edge.py)."""

from __future__ import annotations

import ipaddress

from floe.errors import InvalidInput


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname: assume it is reachable from elsewhere


def check_exposure(host: str, token: str | None, tinker_keys: list[str] | None = None) -> None:
    """Refuse to serve on a non-loopback address without any credential."""
    if not token and not tinker_keys and not is_loopback(host):
        raise InvalidInput(
            "token",
            f"listening on {host!r} (not loopback) needs a credential: pass --token or set FLOE_TOKEN "
            "(and/or [server] tinker_api_keys), or listen on 127.0.0.1",
        )
