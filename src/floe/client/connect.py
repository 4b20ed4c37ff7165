"""`floe.connect`: pick a transport from what the caller gives (a config, or a URL)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from floe.client.client import AsyncClient, Client
from floe.client.transport import Transport
from floe.config import BackendConfig
from floe.errors import InvalidInput

_SCHEMES = ("http://", "https://")
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}(/.*)?$")


def _transport(target: BackendConfig | str | dict[str, Any], token: str | None, **options: Any) -> Transport:
    if isinstance(target, str) and target.startswith(_SCHEMES):
        from floe.client.http import HttpTransport  # noqa: PLC0415 - httpx only for remote clients

        return HttpTransport(target, token=token, **options)
    if isinstance(target, str):
        _check_model_id(target)
        target = BackendConfig.model_validate({"model": target})
    elif isinstance(target, dict):
        target = BackendConfig.model_validate(target)
    if options:
        raise TypeError(f"options {sorted(options)} only apply to remote (http) backends")
    from floe.client.inproc import InprocTransport  # noqa: PLC0415 - torch only for embedded backends

    return InprocTransport(target)


def _check_model_id(target: str) -> None:
    """InvalidInput("target") for a string that is a server address, not a model: another
    scheme, or a host:port without one (unless such a path exists)."""
    if "://" in target and not Path(target).exists():
        scheme = target.split("://", 1)[0]
        raise InvalidInput("target", f"scheme {scheme!r} is not supported; use http:// or https:// (or a model path)")
    if _HOST_PORT.match(target) and not Path(target).exists():
        raise InvalidInput("target", f"{target!r} looks like a server address and needs a scheme: http://{target}")


def connect(target: BackendConfig | str | dict[str, Any], token: str | None = None, **options: Any) -> Client:
    """A Client on an embedded backend or a remote one.

    target: a BackendConfig (or its dict), a model path / hub id (embedded, all defaults), or
        an http(s):// URL of a `floe serve` (remote). A host:port without a scheme raises
        InvalidInput("target") suggesting http://host:port.
    token: the remote server's bearer token (default: $FLOE_TOKEN).
    options: HttpTransport settings for remote backends (timeout, connect_timeout,
        backoff_initial, backoff_max); TypeError for an embedded one.
    """
    return Client(_transport(target, token, **options))


def connect_async(target: BackendConfig | str | dict[str, Any], token: str | None = None, **options: Any) -> AsyncClient:
    """An AsyncClient; arguments as for `connect`."""
    return AsyncClient(_transport(target, token, **options))
