"""`floe.connect`: pick a transport from what the caller gives (a config, or a URL)."""

from __future__ import annotations

from typing import Any

from floe.client.client import AsyncClient, Client
from floe.client.transport import Transport
from floe.config import BackendConfig


def _transport(target: BackendConfig | str | dict[str, Any], token: str | None, **options: Any) -> Transport:
    if isinstance(target, str) and target.startswith(("http://", "https://")):
        from floe.client.http import HttpTransport

        return HttpTransport(target, token=token, **options)
    if isinstance(target, str):
        target = BackendConfig(model=target)
    elif isinstance(target, dict):
        target = BackendConfig.model_validate(target)
    if options:
        raise TypeError(f"options {sorted(options)} only apply to remote (http) backends")
    from floe.client.inproc import InprocTransport

    return InprocTransport(target)


def connect(target: BackendConfig | str | dict[str, Any], token: str | None = None, **options: Any) -> Client:
    """An embedded backend (BackendConfig, dict, or model path) or a remote one (http URL)."""
    return Client(_transport(target, token, **options))


def connect_async(target: BackendConfig | str | dict[str, Any], token: str | None = None, **options: Any) -> AsyncClient:
    return AsyncClient(_transport(target, token, **options))
