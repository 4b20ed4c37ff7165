"""The FastAPI app of `floe serve`: one route per client operation plus operations endpoints.

  POST /api/{op}             every operation in floe.protocol.ops.OPS (and no other name); body
                             and result in the wire format (floe.protocol.wire);
                             header Server-Timing: op;dur=<ms> is the time the backend spent
  GET  /health               liveness (no auth)
  GET  /ready                200 when serving, 503 while draining (no auth)
  GET  /info                 Info as JSON
  GET  /tokenizer            the tokenizer's saved files, so remote clients can rebuild it
  GET  /metrics              Prometheus
  /api/v1/...                the Tinker protocol (protocols/tinker/), X-API-Key auth
  /v1/...                    OpenAI-compatible sampling (protocols/openai.py); errors there
                             in OpenAI's shape, so the openai SDK shows them
  /inference/v1/generate, /pause, /resume, /update_weights, /load_lora_adapter, /liveness
                             vLLM's token-in/token-out API and the admin calls prime-rl's
                             orchestrator makes around weight updates (protocols/vllm_compat.py)

Every request first passes the edge (edge.py): Host and Origin checks, the principal
(principals.py: the bearer token, a Tinker key, or the one local user of a server without
credentials) resolved before the body is read, and the body bounded in size and time. Only
/health and /ready answer without a credential when the server has one. Operations run in a
worker thread, in per-client sequence order (ordering.py); the Backend itself serializes them.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import logging
import re
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from floe.backend import Backend
from floe.errors import FloeError
from floe.protocol.ops import OPS
from floe.protocol.wire import CLIENT_HEADER, REPLAYED_HEADER, SEQ_HEADER
from floe.server.edge import Edge
from floe.server.errors import ApiError, to_api_error
from floe.server.ordering import Reply
from floe.server.protocols.openai import PREFIX as OPENAI_PREFIX
from floe.server.protocols.openai import openai_error_response, openai_router
from floe.server.protocols.tinker import tinker_router
from floe.server.protocols.tinker.oai import OAI_PREFIX, tinker_oai_router
from floe.server.protocols.vllm_compat import install as install_vllm_compat
from floe.server.settings import ServerConfig
from floe.server.state import ServerState, error_response

log = logging.getLogger("floe.server")

_CLIENT_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def create_app(backend: Backend, config: ServerConfig) -> FastAPI:
    state = ServerState(backend, config)
    on_shutdown: list[Callable[[], None]] = []

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        for close in on_shutdown:  # after the last request: the Tinker service offloads its runs
            await run_in_threadpool(close)

    app = FastAPI(title="floe", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.floe = state

    def respond(path: str, error: ApiError) -> JSONResponse:
        """floe's error body, or OpenAI's under /v1 and Tinker's /oai/api/v1."""
        if any(path == p or path.startswith(p + "/") for p in (OPENAI_PREFIX, OAI_PREFIX)):
            return openai_error_response(error)
        return error_response(error)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return respond(request.url.path, exc)

    @app.exception_handler(FloeError)
    async def _floe_error(request: Request, exc: FloeError) -> JSONResponse:
        return respond(request.url.path, to_api_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return respond(request.url.path, ApiError(exc.status_code, code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        field = ".".join(str(p) for p in first.get("loc", ())) or None
        return respond(request.url.path, ApiError(422, "invalid_input", str(first.get("msg", "invalid request")), field))

    # Registered before `observe`, so `observe` (outside it) answers the pause gate's refusals.
    install_vllm_compat(app, state)  # /inference/v1/generate, /pause, /resume, /update_weights, ... (prime-rl)

    @app.middleware("http")
    async def observe(request: Request, call_next: Any) -> Response:
        start = time.perf_counter()
        if state.draining and request.url.path != "/health":
            response: Response = respond(request.url.path, ApiError(503, "shutting_down", "the server is shutting down; retry elsewhere or later"))
        else:
            try:
                response = await call_next(request)
            except ApiError as exc:  # a refusal of the middleware inside (the pause gate)
                response = respond(request.url.path, exc)
            except Exception as exc:  # answered as a 500, logged
                log.exception("unhandled error")
                response = respond(request.url.path, to_api_error(exc))
        route = getattr(request.scope.get("route"), "path", "unmatched")
        if route == "/api/{op}" and request.path_params.get("op") in OPS:
            route = request.url.path  # one label per operation; unknown names stay grouped
        seconds = time.perf_counter() - start
        state.metrics.observe_request(route, response.status_code, seconds)
        log.info(
            "request",
            extra={
                "method": request.method, "path": request.url.path, "status": response.status_code,
                "ms": round(seconds * 1000, 2), "client": request.headers.get(CLIENT_HEADER),
                "seq": request.headers.get(SEQ_HEADER),
            },
        )
        return response

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if state.draining:
            return error_response(ApiError(503, "shutting_down", "the server is shutting down"))
        return JSONResponse({"status": "ready"})

    @app.get("/info")
    async def info() -> dict[str, Any]:
        return dataclasses.asdict(await run_in_threadpool(backend.info))

    @app.get("/tokenizer")
    async def tokenizer_files() -> dict[str, Any]:
        return {"files": await run_in_threadpool(_tokenizer_files, backend)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.post("/api/{op}")
    async def operation(op: str, request: Request) -> Response:
        if op not in OPS:
            raise ApiError(404, "not_found", f"no operation {op!r}; one of {list(OPS)}")
        order = _order_headers(request)
        body = await request.body()  # read (bounded) by the edge

        async def produce() -> Reply:
            return await run_in_threadpool(state.execute, op, body)

        if order is None:
            reply, replayed = await produce(), False
        else:
            digest = await run_in_threadpool(lambda: hashlib.sha256(body).digest())
            reply, replayed = await state.ledger.run(*order, digest, produce)
        headers = {"Server-Timing": f"op;dur={reply.seconds * 1000:.3f}"}
        if replayed:
            headers[REPLAYED_HEADER] = "1"
        return Response(reply.body, status_code=reply.status, media_type=reply.media_type, headers=headers)

    app.include_router(openai_router(state))
    tinker = tinker_router(state)  # tenants kept apart by the Tinker service itself
    app.include_router(tinker)
    app.include_router(tinker_oai_router(tinker.tinker_service))  # type: ignore[attr-defined]  # Tinker's OpenAI-compatible routes
    on_shutdown.append(tinker.tinker_service.close)  # type: ignore[attr-defined]
    # Outermost, so that nothing (the pause gate included) runs before a request is admitted.
    app.add_middleware(Edge, config=config, render=respond, observe=state.metrics.observe_request)
    return app


def _order_headers(request: Request) -> tuple[str, int] | None:
    """(client id, seq) from the ordering headers, or None for an unordered request."""
    client, seq = request.headers.get(CLIENT_HEADER), request.headers.get(SEQ_HEADER)
    if client is None and seq is None:
        return None
    if client is None or not _CLIENT_ID.fullmatch(client):
        raise ApiError(400, "bad_request", "must be 1-128 letters, digits, '_.:-' (sent with X-Floe-Seq)", CLIENT_HEADER)
    if seq is None or not seq.isascii() or not seq.isdigit() or not 0 < int(seq) < 2**63:
        raise ApiError(400, "bad_request", "must be an integer >= 1 (sent with X-Floe-Client)", SEQ_HEADER)
    return client, int(seq)


def _tokenizer_files(backend: Backend) -> dict[str, dict[str, str]]:
    """The tokenizer as `save_pretrained` writes it: {filename: {"encoding", "data"}}."""
    files = {}
    with tempfile.TemporaryDirectory() as tmp:
        backend.tokenizer.save_pretrained(tmp)
        for path in sorted(Path(tmp).iterdir()):
            raw = path.read_bytes()
            try:
                files[path.name] = {"encoding": "utf-8", "data": raw.decode("utf-8")}
            except UnicodeDecodeError:
                files[path.name] = {"encoding": "base64", "data": base64.b64encode(raw).decode()}
    return files
