"""The edge: what every request passes before any route sees it (an ASGI middleware, outermost).

In order, each step answering at once when it refuses:
1. **Host** (DNS rebinding): the `Host` header must name this server: a loopback name
   (`localhost`, `*.localhost`, `127.0.0.1`, `::1`), the address it listens on, or one of
   `[server] allowed_hosts` (`"*"` = any). A server listening on a wildcard address (`0.0.0.0`,
   `::`) with no `allowed_hosts` accepts any Host: it must have a credential (auth.check_exposure),
   which a rebinding page cannot send.
2. **Origin** (cross-site requests): a request that can change state (any method but GET, HEAD,
   OPTIONS) from a browser page of another origin is refused: `Origin` present and not this
   server's own origin or one of `[server] allowed_origins`, or `Sec-Fetch-Site: cross-site`.
3. **Principal** (server/principals.py): from `Authorization` / `X-API-Key`, before the body is
   read; `/health` and `/ready` need none, and signed download links (`/api/v1/download/...`)
   carry their own credential. Routes of the shared backend need the operator; the
   Tinker routes (`/api/v1`) take any principal and keep tenants apart themselves.
4. **Body**: larger than `[server] max_request_mb` (declared or streamed) is 413 without reading
   past the limit; a body that does not arrive within `[server] body_timeout_s` is 408. The body
   is then handed to the route whole (routes read it with `await request.body()` as before).

The principal is left in `scope["state"]["principal"]` (`request.state.principal`).
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import anyio
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from floe.server.errors import ApiError
from floe.server.principals import Credentials, Principal
from floe.server.settings import ServerConfig

__all__ = ["OPEN_PATHS", "TINKER_PREFIX", "Edge", "principal_of"]

OPEN_PATHS = frozenset({"/health", "/ready"})
TINKER_PREFIX = "/api/v1"
TINKER_OAI_PREFIX = "/oai/api/v1"  # Tinker's OpenAI-compatible routes (tinker/oai.py): tenants too
SIGNED_PREFIX = "/api/v1/download/"  # signed, expiring URLs: the signature is the credential (tinker/routes.py)
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_WILDCARDS = frozenset({"0.0.0.0", "::", ""})


def principal_of(request: Any) -> Principal:
    """The principal the edge resolved for this request (a Starlette Request)."""
    return request.state.principal


def _host_name(host_header: str) -> str:
    """The name part of a Host header value (`[::1]:7000` -> `::1`, `a.b:80` -> `a.b`)."""
    value = host_header.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _is_loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def is_tinker_path(path: str) -> bool:
    """Whether `path` is a Tinker route (`/api/v1`, or its OpenAI-compatible `/oai/api/v1`)."""
    return any(path == p or path.startswith(p + "/") for p in (TINKER_PREFIX, TINKER_OAI_PREFIX))


class Edge:
    """The ASGI middleware of this module. `render(path, error)` builds the refusal in the shape
    of the route's protocol; `observe(status, seconds)` counts refusals (metrics)."""

    def __init__(
        self,
        app: ASGIApp,
        config: ServerConfig,
        render: Callable[[str, ApiError], Response],
        observe: Callable[[str, int, float], None] | None = None,
    ):
        self.app = app
        self.config = config
        self.render = render
        self.observe = observe
        self.credentials = Credentials(config.token, list(config.tinker_api_keys))
        bind = config.host.strip("[]").lower()
        self.any_host = "*" in config.allowed_hosts or (bind in _WILDCARDS and not config.allowed_hosts)
        self.hosts = {h.lower() for h in config.allowed_hosts} | ({bind} if bind not in _WILDCARDS else set())
        self.origins = {o.rstrip("/").lower() for o in config.allowed_origins}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        path: str = scope["path"]
        headers = Headers(scope=scope)
        try:
            self._check_host(headers)
            self._check_origin(scope["method"], headers)
            if path not in OPEN_PATHS and not path.startswith(SIGNED_PREFIX):
                principal = self.credentials.resolve(headers.get("authorization"), headers.get("x-api-key"))
                if not principal.operator and not is_tinker_path(path):
                    raise ApiError(403, "forbidden", "a Tinker API key opens only the Tinker routes (/api/v1); the "
                                   "shared backend's routes need the server's bearer token")
                scope.setdefault("state", {})["principal"] = principal
                receive = await self._read_body(headers, receive)
        except ApiError as error:
            await self.render(path, error)(scope, receive, send)
            if self.observe is not None:
                self.observe("edge", error.status, time.perf_counter() - start)
            return
        await self.app(scope, receive, send)

    def _check_host(self, headers: Headers) -> None:
        if self.any_host:
            return
        name = _host_name(headers.get("host", ""))
        if not name or not (_is_loopback_name(name) or name in self.hosts):
            raise ApiError(421, "misdirected_request", f"Host {headers.get('host')!r} is not this server's name; add it to "
                           "[server] allowed_hosts if clients reach the server by that name", "Host")

    def _check_origin(self, method: str, headers: Headers) -> None:
        if method in _SAFE_METHODS:
            return
        origin = headers.get("origin")
        if origin is not None:
            own = f"{urlsplit(origin).netloc}".lower() == headers.get("host", "").lower()
            if not own and origin.rstrip("/").lower() not in self.origins:
                raise ApiError(403, "cross_origin", f"requests that change state from origin {origin!r} are refused; add "
                               "it to [server] allowed_origins to allow a web page there", "Origin")
        elif headers.get("sec-fetch-site") == "cross-site":
            raise ApiError(403, "cross_origin", "cross-site requests that change state are refused", "Sec-Fetch-Site")

    async def _read_body(self, headers: Headers, receive: Receive) -> Receive:
        """The whole body, bounded in size and time, as a new `receive` that replays it (later
        calls reach the client's connection: disconnects still arrive)."""
        limit = self.config.max_request_bytes
        declared = headers.get("content-length")
        too_large = ApiError(413, "payload_too_large", f"request body exceeds {self.config.max_request_mb:g} MiB "
                             "([server] max_request_mb)")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        more = True
        try:
            with anyio.fail_after(self.config.body_timeout_s):
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        break
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
                    more = message.get("more_body", False)
        except TimeoutError:
            raise ApiError(408, "request_timeout", f"the request body did not arrive within "
                           f"{self.config.body_timeout_s:g} s ([server] body_timeout_s)") from None
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay

