"""The `/api/v1/*` routes of the Tinker protocol (tinker SDK 0.38), mounted by `server/app.py`.

Auth happens at the edge (server/edge.py): every route here gets the request's `Principal`
(a Tinker key's tenant, the operator's token, or the one local user of a server without
credentials) and passes it to the service, which keeps tenants apart. The one exception is
`GET /api/v1/download/...`: a signed, expiring URL is its credential (the SDK and the `tinker`
CLI fetch those with no headers, as they would from cloud storage).

Model-touching POSTs return a future (`{"request_id", ...}`) at once; `retrieve_future`
long-polls up to `[server] tinker_long_poll_s` (default 20 s, under the SDK's 45 s read timeout)
and then answers 408 with `{"type": "try_again"}`, which the SDK re-polls at once and without a
log line (a 200 `try_again` makes it warn at every poll). forward_backward bodies and results
and sample results are protobuf (`schema.py`); everything else is JSON. Sample results carry the
weights version in the `X-Floe-Weights-Version` header (beyond Tinker).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from floe.backend.runs import RunManager
from floe.errors import InvalidInput, NotFound
from floe.models import load_tokenizer
from floe.names import path_under
from floe.server.bodies import parse_json_object
from floe.server.edge import principal_of
from floe.server.errors import to_api_error
from floe.server.principals import Principal
from floe.server.protocols.tinker import requests as rq
from floe.server.protocols.tinker.service import Bounds, TinkerService, _digest
from floe.server.protocols.tinker.store import Checkpoint, Limits, Store
from floe.server.state import ServerState

log = logging.getLogger("floe.server.tinker")

DOWNLOAD_PREFIX = "/api/v1/download/"
URL_LIFETIME_S = 3600
MAX_PAGE = 1000
MAX_OFFSET = 10**9  # far beyond any listing a key can have (store.Limits), far within SQLite's integers


def build_service(state: ServerState) -> TinkerService:
    """The Tinker service of one `ServerState`: its backend's model is the default
    base model; `[server] tinker_base_models` adds more (each with its own tokenizer)."""
    backend, config = state.backend, state.config
    root = Path(backend.config.state_dir) / ".tinker"
    default = backend.config.model
    bases: dict[str, RunManager] = {
        default: RunManager(backend.config, backend.tokenizer, root, full_finetune=config.tinker_full_finetune)}
    names = {state.model_name: default, default: default}
    tokenizer_ids = {default: backend.config.tokenizer or default}
    for extra in config.tinker_base_models:
        if extra in names:
            continue
        cfg = backend.config.model_copy(update={"model": extra, "tokenizer": None})
        bases[extra] = RunManager(cfg, load_tokenizer(extra, trust_remote_code=cfg.trust_remote_code), root,
                                  full_finetune=config.tinker_full_finetune)
        names[extra] = extra
        tokenizer_ids[extra] = extra
    store = Store(root / "tinker.sqlite3", Limits(sessions=config.tinker_max_sessions, runs=config.tinker_max_runs,
                                                  checkpoints=config.tinker_max_checkpoints,
                                                  samplers_per_session=config.tinker_max_samplers_per_session))
    bounds = Bounds(samples_per_request=config.tinker_max_samples_per_request,
                    sampled_tokens_per_request=config.tinker_max_sampled_tokens_per_request,
                    stability_tokens=config.tinker_max_stability_tokens,
                    session_timeout_s=config.tinker_session_timeout_s, gap_timeout_s=config.sequence_timeout_s,
                    min_ttl_s=config.tinker_min_ttl_s, queued_per_key=config.tinker_max_queued_per_key,
                    queued_mb_per_key=config.tinker_max_queued_mb_per_key)
    return TinkerService(bases, names, tokenizer_ids, root, bounds, store,
                         (config.tinker_max_live_runs, config.tinker_max_live_samplers, config.tinker_max_live_bases),
                         config.tinker_full_finetune)


class _Signer:
    """HMAC-signed, expiring download URLs; the key lives in the Tinker root (mode 0600)."""

    def __init__(self, root: Path):
        path = root / "download.key"
        root.mkdir(parents=True, exist_ok=True)
        if not path.is_file():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(secrets.token_bytes(32))
        self._key = path.read_bytes()

    def sign(self, target: str, expires: int, identity: str) -> str:
        """The signature of `target` until `expires`, bound to the checkpoint's `identity`
        (`_identity`): a link to a checkpoint deleted and made again under the same name, by
        anyone, does not serve the new one."""
        return hmac.new(self._key, f"{target}\n{expires}\n{identity}".encode(), hashlib.sha256).hexdigest()

    def check(self, target: str, expires: str, signature: str, identity: str | None) -> None:
        """NotFound unless the link is well-formed, unexpired and signed for the checkpoint the
        registry holds now (`identity`; None: it has none, deleted or expired)."""
        gone = NotFound("sig", "this download link is wrong or has expired, or its checkpoint no longer exists; "
                        "ask for new links")
        if not (expires.isascii() and expires.isdigit() and len(expires) <= 12) or int(expires) < time.time():
            raise gone
        if identity is None or not hmac.compare_digest(self.sign(target, int(expires), identity), signature):
            raise gone


def _identity(ckpt: Checkpoint) -> str:
    """What tells one checkpoint from another made later under the same path: its owner and
    creation time (a re-created checkpoint gets a new one)."""
    return f"{ckpt.owner}\n{ckpt.created!r}"


def _page(request: Request, default_limit: int) -> tuple[int, int]:
    out = []
    for name, default in (("offset", 0), ("limit", default_limit)):
        raw = request.query_params.get(name, str(default))
        low, high = (1, MAX_PAGE) if name == "limit" else (0, MAX_OFFSET)
        # isascii: str.isdigit() also takes '²' and '٣', which int() refuses or reads as another number
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 12) or not low <= int(raw) <= high:
            raise InvalidInput(name, f"must be a decimal integer in [{low}, {high}], got {raw[:40]!r}")
        out.append(int(raw))
    scope = request.query_params.get("access_scope", "owned")
    if scope not in ("owned", "accessible"):
        raise InvalidInput("access_scope", f"must be 'owned' or 'accessible', got {scope[:40]!r}")
    return out[0], out[1]


def _scrubbing_route(service: TinkerService) -> type[APIRoute]:
    """A route class for how the Tinker routes answer what they raise (a FloeError, or anything
    unexpected): floe's error body, with `service.scrub` applied (no server path, as in the
    answers of futures: TinkerService.failure), and every 409 as 400 (a StateError, and a seq_id
    reused for other data, `sequence_reused`, which keeps its error code): the tinker SDK retries
    a 409 (a lock timeout, to it: `_base_client._should_retry`, `retry_handler`) ten times with
    backoff, and model-touching calls for five minutes, so a final refusal would reach the user
    a minute or more late."""

    class ScrubbedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def scrubbed(request: Request) -> Response:
                try:
                    return await handler(request)
                except Exception as exc:
                    error = to_api_error(exc)
                    if error.status >= 500:
                        log.exception("tinker route failed", exc_info=exc)
                    if error.status == 409:  # never 409 on Tinker routes: the SDK would retry it
                        error.status = 400
                    error.message = service.scrub(error.message)
                    raise error from None

            return scrubbed

    return ScrubbedRoute


def tinker_router(state: ServerState) -> APIRouter:
    """The router for one `ServerState`."""
    config = state.config
    service = build_service(state)
    signer = _Signer(service.layout.root)
    router = APIRouter(prefix="/api/v1", route_class=_scrubbing_route(service))
    router.tinker_service = service  # type: ignore[attr-defined]  # the app closes it; tests reach the live service
    state.metrics.watch("floe_tinker_in_memory", "what the Tinker service holds in memory (runs, samplers, bases: "
                        "the residency's; base_models, adapters, full_models: the base models' managers')", "what",
                        service.residency.memory)

    async def json_of(request: Request, model: type[rq.M]) -> tuple[rq.M, bytes]:
        raw = await request.body()
        return rq.parse(model, raw), _digest(raw)

    @router.post("/client/config")
    async def client_config() -> dict[str, Any]:
        return {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": True, "proto_compress_fwdbwd": False,
                "fwdbwd_max_chunk_len": config.tinker_chunk_datums,
                "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
                "sample_join_sampling_session": False}

    @router.post("/client/dynamic_config")
    async def dynamic_config() -> dict[str, Any]:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}

    @router.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        return {"supported_models": [
            {"model_name": name, "max_context_length": service.bases[key].max_context, "trainable": True,
             "sampleable": True} for name, key in service.names.items()]}

    @router.post("/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        req, _ = await json_of(request, rq.CreateSession)
        return await run_in_threadpool(service.create_session, principal_of(request), req)

    @router.post("/session_heartbeat")
    async def heartbeat(request: Request) -> Response:
        req, _ = await json_of(request, rq.SessionHeartbeat)
        if not await run_in_threadpool(service.heartbeat, principal_of(request), req.session_id):
            return JSONResponse({"error": "session_finished", "message": "this session has finished"}, status_code=410)
        return JSONResponse({"type": "session_heartbeat"})

    @router.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> dict[str, Any]:
        await run_in_threadpool(service.finish, principal_of(request), session_id)
        return {"status": "finished"}

    @router.get("/sessions/{session_id}")
    async def get_session(session_id: str, request: Request) -> dict[str, Any]:
        return await run_in_threadpool(service.get_session, principal_of(request), session_id)

    @router.get("/sessions")
    async def list_sessions(request: Request) -> dict[str, Any]:
        offset, limit = _page(request, 20)
        return await run_in_threadpool(service.list_sessions, principal_of(request), offset, limit)

    @router.post("/telemetry")
    async def telemetry() -> dict[str, str]:
        return {"status": "accepted"}  # the SDK's telemetry: dropped (nothing leaves this server)

    def sequenced(model: type[rq.M], operation: Callable[[Principal, rq.M, bytes], dict[str, Any]]) -> Callable[..., Any]:
        """A route for a training client's JSON operation: the body parsed by its request model,
        the operation run with the body's digest (a re-sent seq_id must carry the same one)."""
        async def route(request: Request) -> dict[str, Any]:
            req, digest = await json_of(request, model)
            return await run_in_threadpool(operation, principal_of(request), req, digest)
        return route

    for name, model, operation in (
        ("create_model", rq.CreateModel, service.create_model),
        ("optim_step", rq.OptimStep, service.optim_step),
        ("save_weights", rq.SaveWeights, service.save_weights),
        ("save_weights_for_sampler", rq.SaveWeightsForSampler, service.save_weights_for_sampler),
        ("save_weights_external", rq.SaveWeightsExternal, service.save_weights_external),
        ("load_weights", rq.LoadWeights, service.load_weights),
    ):
        router.add_api_route(f"/{name}", sequenced(model, operation), methods=["POST"], name=name)

    @router.post("/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        req, _ = await json_of(request, rq.GetInfo)
        return await run_in_threadpool(service.get_info, principal_of(request), req.model_id)

    @router.post("/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        if request.headers.get("content-encoding", "identity") != "identity":
            raise InvalidInput("Content-Encoding", "compressed bodies are not accepted (client config says so)")
        # forward() sends the same message with forward_only set
        return await run_in_threadpool(service.forward_backward, principal_of(request), await request.body())

    @router.post("/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        req, _ = await json_of(request, rq.CreateSamplingSession)
        return await run_in_threadpool(service.create_sampling_session, principal_of(request), req)

    @router.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request) -> dict[str, Any]:
        return await run_in_threadpool(service.get_sampler, principal_of(request), sampler_id)

    @router.post("/asample")
    async def asample(request: Request) -> dict[str, Any]:
        body = parse_json_object(await request.body())
        return await run_in_threadpool(service.asample, principal_of(request), body)

    @router.post("/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        req, _ = await json_of(request, rq.FutureRetrieve)
        who = principal_of(request)
        if not service.futures.known(req.request_id, who.id):
            raise NotFound("request_id", f"no request {req.request_id[:80]!r} for this key (unknown or expired)")
        reply = await service.futures.wait(req.request_id, config.tinker_long_poll_s)
        if reply is None:
            return JSONResponse({"type": "try_again", "request_id": req.request_id, "queue_state": "active"},
                                status_code=408)
        return Response(reply.body, status_code=reply.status, media_type=reply.media_type, headers=reply.headers)

    # -- REST: runs, checkpoints, downloads -------------------------------------------------

    @router.get("/training_runs")
    async def training_runs(request: Request) -> dict[str, Any]:
        offset, limit = _page(request, 20)
        return await run_in_threadpool(service.training_runs, principal_of(request), offset, limit)

    @router.get("/training_runs/{run_id}")
    async def training_run(run_id: str, request: Request) -> dict[str, Any]:
        return await run_in_threadpool(service.training_run, principal_of(request), run_id)

    @router.get("/training_runs/{run_id}/checkpoints")
    async def run_checkpoints(run_id: str, request: Request) -> dict[str, Any]:
        offset, limit = _page(request, MAX_PAGE)
        return await run_in_threadpool(service.checkpoints, principal_of(request), run_id, offset, limit)

    @router.get("/checkpoints")
    async def user_checkpoints(request: Request) -> dict[str, Any]:
        offset, limit = _page(request, 100)
        return await run_in_threadpool(service.checkpoints, principal_of(request), None, offset, limit)

    @router.post("/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        req, _ = await json_of(request, rq.WeightsInfo)
        return await run_in_threadpool(service.weights_info, principal_of(request), req.tinker_path)

    @router.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls")
    async def external_weights_urls(run_id: str, kind: str, name: str, request: Request) -> dict[str, Any]:
        ckpt, files = await run_in_threadpool(service.checkpoint_files, principal_of(request), run_id, f"{kind}/{name}")
        expires = int(time.time()) + URL_LIFETIME_S
        base = str(request.base_url).rstrip("/")
        urls = {}
        for f in files:
            target = f"{ckpt.run_id}/{ckpt.kind}/{ckpt.name}/{f}"
            urls[f] = f"{base}{DOWNLOAD_PREFIX}{target}?expires={expires}&sig={signer.sign(target, expires, _identity(ckpt))}"
        return {"urls": urls, "expires": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires))}

    @router.get("/download/{run_id}/{kind}/{name}/{file:path}")
    async def download(run_id: str, kind: str, name: str, file: str, request: Request) -> Response:
        target = f"{run_id}/{kind}/{name}/{file}"
        # The registry, not only the signature: a deleted or expired checkpoint is gone from
        # downloads at once, as from listings (its files wait for the next sweep).
        ckpt = await run_in_threadpool(service.store.find_checkpoint, run_id, kind, name)
        live = ckpt is not None and (ckpt.expires is None or ckpt.expires > time.time())
        signer.check(target, request.query_params.get("expires", ""), request.query_params.get("sig", ""),
                     _identity(ckpt) if live and ckpt is not None else None)
        directory = service.layout.checkpoint(run_id, kind, name, field="path")
        path = path_under(directory, *file.split("/"), field="path")
        if not path.is_file():
            raise NotFound("path", "this checkpoint file no longer exists")
        return FileResponse(path, media_type="application/octet-stream")

    @router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(run_id: str, kind: str, name: str, request: Request) -> dict[str, Any]:
        await run_in_threadpool(service.delete_checkpoint, principal_of(request), run_id, f"{kind}/{name}")
        return {"status": "deleted"}

    @router.post("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
    async def publish(run_id: str, kind: str, name: str, request: Request) -> dict[str, Any]:
        await run_in_threadpool(service.publish, principal_of(request), run_id, f"{kind}/{name}", True)
        return {"status": "published"}

    @router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
    async def unpublish(run_id: str, kind: str, name: str, request: Request) -> dict[str, Any]:
        await run_in_threadpool(service.publish, principal_of(request), run_id, f"{kind}/{name}", False)
        return {"status": "unpublished"}

    @router.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl")
    async def set_ttl(run_id: str, kind: str, name: str, request: Request) -> dict[str, Any]:
        req, _ = await json_of(request, rq.SetTtl)
        await run_in_threadpool(service.set_ttl, principal_of(request), run_id, f"{kind}/{name}", req.ttl_seconds)
        return {"status": "ok"}

    return router
