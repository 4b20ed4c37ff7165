"""The `/api/v1/*` routes of the Tinker protocol (tinker SDK 0.38), mounted by `server/app.py`.

Auth: the SDK sends `X-API-Key`. With `ServerConfig.tinker_api_keys` set, a request needs one
of them; with none set, the routes answer only when the server listens on loopback (the
server's bearer token is not used here: the SDK cannot send it).

Model-touching POSTs return a future (`{"request_id", ...}`) at once; `retrieve_future`
long-polls up to `LONG_POLL_S` (under the SDK's 45 s read timeout) and then answers
`try_again`, which the SDK re-polls at once. forward_backward bodies and results and sample
results are protobuf (`schema.py`); everything else is JSON. Sample results carry the weights
version in the `X-Floe-Weights-Version` header (beyond Tinker).
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from floe.backend.runs import RunManager
from floe.errors import InvalidInput
from floe.server.auth import is_loopback
from floe.server.errors import ApiError
from floe.server.protocols.tinker.service import TinkerService

LONG_POLL_S = 20.0


def check_api_key(given: str | None, keys: list[str], host: str) -> None:
    """Raise 401 unless `given` is one of `keys` (compared in constant time); with no keys
    configured, only a loopback server answers."""
    if not keys:
        if is_loopback(host):
            return
        raise ApiError(401, "unauthorized", "the Tinker protocol off loopback needs [server] tinker_api_keys")
    if given is None or not any(hmac.compare_digest(given.encode(), k.encode()) for k in keys):
        raise ApiError(401, "unauthorized", "missing or wrong X-API-Key")


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise InvalidInput("body", "must be a JSON object") from None
    if not isinstance(body, dict):
        raise InvalidInput("body", "must be a JSON object")
    return body


def tinker_router(state: Any) -> APIRouter:
    """The router for one `server.app.ServerState` (its backend's model is the one base model)."""
    backend, config = state.backend, state.config
    runs = RunManager(backend.config, backend.tokenizer, Path(backend.config.state_dir) / "tinker",
                      full_finetune=config.tinker_full_finetune)
    service = TinkerService(
        runs, base_model=backend.config.model, served_name=state.model_name,
        tokenizer_id=backend.config.tokenizer or backend.config.model, gap_timeout_s=config.sequence_timeout_s,
    )

    async def authorized(request: Request) -> None:
        check_api_key(request.headers.get("x-api-key"), list(config.tinker_api_keys), config.host)

    router = APIRouter(prefix="/api/v1", dependencies=[Depends(authorized)])
    router.tinker_service = service  # type: ignore[attr-defined]  # tests and docs reach the live service

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
            {"model_name": name, "max_context_length": backend.max_context, "trainable": True, "sampleable": True}
            for name in service.model_names
        ]}

    @router.post("/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        return service.create_session(await _json(request))

    @router.post("/session_heartbeat")
    async def heartbeat(request: Request) -> Response:
        body = await _json(request)
        if not service.heartbeat(body.get("session_id")):
            return JSONResponse({"error": "session_finished", "message": "this session has finished"}, status_code=410)
        return JSONResponse({"type": "session_heartbeat"})

    @router.post("/sessions/{session_id}/finish")
    async def finish(session_id: str) -> dict[str, Any]:
        await run_in_threadpool(service.finish, session_id)
        return {"status": "finished"}

    @router.post("/telemetry")
    async def telemetry() -> dict[str, str]:
        return {"status": "accepted"}

    @router.post("/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        return service.create_model(await _json(request))

    @router.post("/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        body = await _json(request)
        info = service.get_info(body.get("model_id"))
        if info is None:
            raise ApiError(404, "not_found", f"no training run {body.get('model_id')!r}", "model_id")
        return info

    @router.post("/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        body = await request.body()
        if request.headers.get("content-encoding", "identity") != "identity":
            raise InvalidInput("Content-Encoding", "compressed bodies are not accepted (client config says so)")
        return service.forward_backward(body)  # forward() sends the same message with forward_only set

    @router.post("/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        return service.optim_step(await _json(request))

    @router.post("/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        return service.save_weights(await _json(request))

    @router.post("/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
        return service.save_weights_for_sampler(await _json(request))

    @router.post("/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        return service.load_weights(await _json(request))

    @router.post("/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        body = await _json(request)
        return await run_in_threadpool(service.create_sampling_session, body)

    @router.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        out = service.get_sampler(sampler_id)
        if out is None:
            raise ApiError(404, "not_found", f"no sampler {sampler_id!r}", "sampler_id")
        return out

    @router.post("/asample")
    async def asample(request: Request) -> dict[str, Any]:
        return service.asample(await _json(request))

    @router.post("/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        body = await _json(request)
        rid = body.get("request_id")
        if not isinstance(rid, str) or not service.futures.known(rid):
            raise ApiError(404, "not_found", f"no request {rid!r} (unknown or expired)", "request_id")
        reply = await service.futures.wait(rid, LONG_POLL_S)
        if reply is None:
            return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"})
        return Response(reply.body, status_code=reply.status, media_type=reply.media_type, headers=reply.headers)

    @router.get("/training_runs/{run_id}")
    async def training_run(run_id: str) -> dict[str, Any]:
        out = service.training_run(run_id)
        if out is None:
            raise ApiError(404, "not_found", f"no training run {run_id!r}", "run_id")
        return out

    @router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str) -> dict[str, Any]:
        if not await run_in_threadpool(service.delete_checkpoint, run_id, checkpoint_id):
            raise ApiError(404, "not_found", f"no checkpoint {checkpoint_id!r} in run {run_id!r}", "checkpoint_id")
        return {"status": "deleted"}

    return router

