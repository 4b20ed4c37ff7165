"""What the routes of every protocol share: `ServerState` (the backend, settings, metrics, the
ordering ledger, the served model id) and the error replies. It lives below the app and the
protocols, which both take it (the protocols never import the app)."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

from fastapi.responses import JSONResponse

from floe.backend import Backend
from floe.protocol import wire
from floe.server.errors import ApiError, to_api_error
from floe.server.metrics import Metrics
from floe.server.ordering import Ledger, Reply
from floe.server.settings import ServerConfig

__all__ = ["ServerState", "default_model_id", "error_reply", "error_response"]

log = logging.getLogger("floe.server")


def default_model_id(model: str) -> str:
    """The id the endpoints serve when no `served_model_name` is set: a hub id as given, a
    local directory by its name, a Hugging Face cache snapshot by its repo id."""
    cached = re.search(r"models--([^/\\]+?)--([^/\\]+)[/\\]snapshots[/\\]", model)
    if cached:
        return f"{cached.group(1)}/{cached.group(2)}"
    path = Path(model).expanduser()
    if path.is_absolute() or path.exists() or model.startswith("."):
        return path.resolve().name or model
    return model


class ServerState:
    """What the routes share: the backend, settings, metrics, the ordering ledger."""

    def __init__(self, backend: Backend, config: ServerConfig):
        self.backend = backend
        self.config = config
        self.metrics = Metrics()
        self.ledger = Ledger(config.result_window, config.max_clients, config.sequence_timeout_s)
        self.draining = False
        self.model_name = config.served_model_name or default_model_id(backend.config.model)
        # LoRA adapter names given to vLLM's /load_lora_adapter (protocols/vllm_compat.py): the
        # sampler serves the policy's merged weights, so each is another name of the served model.
        self.adapter_names: set[str] = set()
        self.metrics.observe_state(backend.info())

    def serves(self, model: str) -> bool:
        """Whether sampling requests may name `model`: the served name, the backend's model, or a
        loaded adapter's name (`adapter_names`)."""
        return model in (self.model_name, self.backend.config.model) or model in self.adapter_names

    def execute(self, op: str, body: bytes) -> Reply:
        """Decode, run and encode one operation; every failure becomes an error reply."""
        try:
            kwargs = wire.decode_request(op, body)
            method = getattr(self.backend, op, None)
            if not callable(method):
                raise ApiError(501, "not_implemented", f"the backend has no method {op!r} for this operation")
            start = time.perf_counter()
            result = method(**kwargs)
            seconds = time.perf_counter() - start
            self.metrics.observe_result(op, kwargs, result)
            return Reply(200, wire.encode_result(op, result), wire.MEDIA_TYPE, seconds)
        except Exception as exc:  # every failure is answered, none kills the server
            error = to_api_error(exc)
            if error.status >= 500:
                log.exception("operation failed", extra={"op": op})
            return error_reply(error)


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def error_reply(error: ApiError) -> Reply:
    return Reply(error.status, error_response(error).body, "application/json")



