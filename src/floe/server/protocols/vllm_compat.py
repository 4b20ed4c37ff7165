"""vLLM's extra endpoints that prime-rl's orchestrator and verifiers' training client call.

  POST /inference/v1/generate  token ids in; token ids, per-token log-probs, finish reasons out
                               (vLLM's token-in/token-out API, as `renderers.client.generate`
                               in verifiers 0.4.0 posts it)
  POST /pause                  hold new sampling requests (generate, /v1/completions,
                               /v1/chat/completions) and wait for those in flight to finish;
                               query `mode` keep | wait (abort is refused)
  POST /resume                 let held and new sampling requests run
  POST /update_weights         body {"weight_dir": ".../broadcasts/step_N"}: check that the
                               sampler serves the weights `floe prime-trainer` published there
                               (floe.json's weights_version; the trainer syncs them through
                               the client); 409 when it serves an older version
  POST /load_lora_adapter      body {"lora_name", "lora_path": ".../broadcasts/step_N"}: prime-rl's
                               LoRA sync (trainer.model.lora): the same check as /update_weights,
                               then `lora_name` names the served model (its merged weights
                               W + (alpha/rank)·B·A) in sampling requests and /v1/models; 400 when
                               the backend has no [lora]
  GET  /liveness               {"status": "ok"} (GET /health is the app's)

The admin paths follow prime-rl's inference server and client (src/prime_rl/inference/vllm/
server.py, utils/client.py at floe.integrations.prime_rl.PRIME_RL_COMMIT). `/v1/models`
(protocols/openai.py) reports the context as `max_model_len`, which verifiers reads for its
pre-flight prompt-length check.

generate body: `model`, `token_ids`, `sampling_params` (max_tokens, temperature, top_p, top_k,
n, seed, stop_token_ids, stop, ignore_eos, logprobs (the sampled token's log-prob is always
returned; k > 0 adds k alternatives), skip_special_tokens, return_token_ids and the other
detokenizer switches (floe returns ids, so they change nothing), and vLLM's penalties at their neutral values only),
`cache_salt` (also accepted inside `sampling_params`), `priority`, `request_id`. Multimodal `features` / `content_parts` and
`prompt_logprobs` are refused naming the field. Answer: `{"request_id", "prompt_token_ids",
"choices": [{"index", "token_ids", "logprobs": {"content": [{"token": "token_id:ID",
"logprob", "top_logprobs"}]}, "finish_reason": "stop"|"length"}]}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from floe.backend.validation import MAX_TOP_LOGPROBS
from floe.errors import InvalidInput
from floe.server.batching import SampleBatcher
from floe.server.bodies import parse_json_object
from floe.server.connections import until_disconnected
from floe.server.errors import ApiError
from floe.server.state import ServerState
from floe.types import SamplingParams

GENERATE_PATH = "/inference/v1/generate"
ADAPTER_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_ADAPTER_NAMES = 16  # names are held for the server's life: bounded
SAMPLING_PATHS = (GENERATE_PATH, "/v1/completions", "/v1/chat/completions")

# vLLM SamplingParams fields floe does not implement -> the values that change nothing.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "min_p": (0, 0.0), "min_tokens": (0,), "prompt_logprobs": (None,), "logit_bias": (None, {}),
    "allowed_token_ids": (None,), "bad_words": (None, []), "truncate_prompt_tokens": (None,),
    "guided_decoding": (None,), "structured_outputs": (None,), "logits_processors": (None, []),
    "best_of": (None, 1), "output_kind": (None,),
}
# Detokenizer switches: floe answers token ids, so any value is accepted and changes nothing.
# `return_token_ids`: prime-rl's orchestrator puts it in every policy env's sampling extra_body
# (configs/orchestrator.py resolve_env_config), which verifiers' training client forwards here.
DETOKENIZER = ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
               "detokenize", "routed_experts_prompt_start", "return_token_ids")


class _Strict(BaseModel):
    # strict: `true` is not a token id and "5" is not a max_tokens (lax pydantic would coerce both)
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class GenerateSampling(_Strict):
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    n: int = Field(1, ge=1, le=1024)
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Prefix-cache isolation, as on the request itself: floe's sampler keeps no prefix cache
    # across requests, so it changes nothing. verifiers' training client at prime-rl's pinned
    # commit sends the orchestrator's per-group salt here (sampling extra_body).
    cache_salt: str | None = None


class GenerateRequest(_Strict):
    model: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    cache_salt: str | None = None
    priority: int | None = None
    request_id: str | None = None
    stream: bool = False


class PauseGate:
    """Holds sampling requests while paused (each at most `hold_s`, then 503); counts those in
    flight so /pause can drain them."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.paused = False
        self.in_flight = 0
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: not self.paused), self.hold_s)
            except asyncio.TimeoutError:
                raise ApiError(503, "paused", f"sampling is paused (POST /resume ends it); this request waited "
                               f"{self.hold_s:g} s ([server] pause_hold_s)") from None
            self.in_flight += 1
        try:
            yield
        finally:
            async with self._changed:
                self.in_flight -= 1
                self._changed.notify_all()

    async def pause(self) -> None:
        async with self._changed:
            self.paused = True
            await self._changed.wait_for(lambda: self.in_flight == 0)

    async def resume(self) -> None:
        async with self._changed:
            self.paused = False
            self._changed.notify_all()


def _bad(field: str, message: str) -> ApiError:
    return ApiError(400, "invalid_value", message, field)


def _json_body(raw: bytes) -> dict[str, Any]:
    try:
        return parse_json_object(raw)
    except InvalidInput as e:
        raise ApiError(400, "invalid_json" if e.field == "body" else "invalid_value", e.message,
                       None if e.field == "body" else e.field) from None


def generate_params(raw: dict[str, Any], max_context: int, prompt_len: int) -> tuple[SamplingParams, int, int]:
    """(floe SamplingParams, n, top-logprob count) from vLLM's `sampling_params`; ApiError(400)
    naming `sampling_params.<key>` for an unknown key or a non-neutral unsupported value."""
    data = dict(raw)
    for key in DETOKENIZER:
        data.pop(key, None)
    for key, neutral in NEUTRAL.items():
        if key in data:
            value = data.pop(key)
            if not any(value == v and (v is None or type(value) in (int, float, type(v))) for v in neutral):
                raise _bad(f"sampling_params.{key}", f"is not supported by floe; remove it or send "
                           f"{' or '.join(json.dumps(v) for v in neutral)}")
    try:
        sp = GenerateSampling.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            raise _bad(f"sampling_params.{loc}", "is not a vLLM sampling parameter floe knows; check the spelling") from None
        raise _bad(f"sampling_params.{loc}", str(first["msg"])) from None
    max_tokens = sp.max_tokens if sp.max_tokens is not None else max_context - prompt_len
    if max_tokens < 1:
        raise ApiError(400, "context_length_exceeded", f"the prompt has {prompt_len} tokens; the model's context "
                       f"is {max_context}", "token_ids")
    stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
    top = sp.logprobs or 0
    params = SamplingParams(max_tokens=max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=max(sp.top_k, 0),
                            stop_token_ids=sp.stop_token_ids, stop=stop, seed=sp.seed, stop_at_eos=not sp.ignore_eos,
                            top_logprobs=top)
    return params, sp.n, top


FINISH = {"stop_token": "stop", "stop_string": "stop", "length": "length"}


def vllm_router(state: ServerState, gate: PauseGate) -> APIRouter:
    """The routes above, on `state`'s backend (mounted with the app's bearer-token check)."""
    router = APIRouter()
    backend = state.backend
    config = state.config
    batcher = SampleBatcher(backend.sample_streaming, window_s=config.openai_batch_window_ms / 1000,
                            max_sequences=config.openai_batch_max_sequences, max_context=backend.max_context)

    @router.post(GENERATE_PATH)
    async def generate(request: Request) -> dict[str, Any]:
        body = _json_body(await request.body())
        for key in ("features", "content_parts", "return_token_ids"):
            if body.get(key) not in (None, False):
                raise _bad(key, "multimodal prompts are not supported by floe; send token_ids only")
            body.pop(key, None)
        try:
            req = GenerateRequest.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(p) for p in first["loc"])
            msg = "is not a field of this endpoint" if first["type"] == "extra_forbidden" else str(first["msg"])
            raise _bad(loc, msg) from None
        if req.stream:
            raise _bad("stream", "streaming is not supported on this endpoint; send stream: false")
        if req.model is not None and not state.serves(req.model):
            raise ApiError(404, "model_not_found", f"this server serves {state.model_name!r}, not {req.model!r}", "model")
        params, n, top = generate_params(req.sampling_params, backend.max_context, len(req.token_ids))
        try:
            result = await until_disconnected(request, batcher.sample([req.token_ids], n, params))
        except InvalidInput as e:
            field = e.field.replace("prompts[0]", "token_ids").replace("params.", "sampling_params.")
            raise _bad(field, e.message) from None
        state.metrics.tokens_sampled.inc(result.num_tokens)
        choices = []
        for i, s in enumerate(result.groups[0].samples):
            content = []
            for t, (tok, lp) in enumerate(zip(s.tokens, s.logprobs)):
                entry: dict[str, Any] = {"token": f"token_id:{tok}", "logprob": lp, "bytes": None, "top_logprobs": []}
                if top and s.top_logprobs is not None:
                    entry["top_logprobs"] = [{"token": f"token_id:{a}", "logprob": b, "bytes": None}
                                             for a, b in s.top_logprobs[t]]
                content.append(entry)
            choices.append({"index": i, "token_ids": list(s.tokens), "logprobs": {"content": content},
                            "finish_reason": FINISH[s.stop_reason], "weights_version": s.weights_version})
        return {"request_id": req.request_id or f"gen-{uuid.uuid4().hex}", "prompt_token_ids": req.token_ids,
                "choices": choices}

    @router.post("/pause")
    async def pause(mode: str = "keep", clear_cache: str = "false") -> dict[str, str]:
        if mode not in ("keep", "wait"):
            raise _bad("mode", f"{mode!r} is not supported; floe finishes requests in flight (mode keep or wait)")
        await gate.pause()
        return {"status": "paused"}

    @router.post("/resume")
    async def resume() -> dict[str, str]:
        await gate.resume()
        return {"status": "resumed"}

    async def served_step(field: str, weight_dir: Any) -> dict[str, Any]:
        """The published step at `weight_dir` (floe prime-trainer's marker), once the sampler serves it."""
        from floe.integrations.prime_rl.formats import read_marker  # noqa: PLC0415 - msgspec (the prime-rl extra)

        if not isinstance(weight_dir, str) or not weight_dir:
            raise _bad(field, "give the published step directory (broadcasts/step_N) of `floe prime-trainer`")
        try:
            marker = await run_in_threadpool(read_marker, Path(weight_dir))
        except InvalidInput as e:
            raise _bad(e.field, e.message) from None
        info = await run_in_threadpool(backend.info)
        if info.sampler_version < marker.weights_version:
            raise ApiError(409, "stale_weights", f"the sampler serves weights version {info.sampler_version}; "
                           f"{weight_dir} needs {marker.weights_version} (sync_weights has not run for it)", field)
        return {"status": "ok", "step": marker.step, "weights_version": info.sampler_version}

    @router.post("/update_weights")
    async def update_weights(request: Request) -> dict[str, Any]:
        body = _json_body(await request.body() or b"{}")
        return await served_step("weight_dir", body.get("weight_dir"))

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> dict[str, Any]:
        body = _json_body(await request.body() or b"{}")
        name = body.get("lora_name")
        if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
            raise _bad("lora_name", f"must be 1 to 64 letters, digits, '.', '_' or '-', got {name!r}")
        if backend.config.lora is None:
            raise _bad("lora_name", "this server's backend trains every weight, so there is no adapter to load: start "
                       "floe serve with [backend.lora] (the recipe's trainer.model.lora), or use /update_weights")
        if name not in state.adapter_names and len(state.adapter_names) >= MAX_ADAPTER_NAMES:
            raise _bad("lora_name", f"{MAX_ADAPTER_NAMES} adapter names are loaded already; reuse one of "
                       f"{sorted(state.adapter_names)}")
        reply = await served_step("lora_path", body.get("lora_path"))
        state.adapter_names.add(name)  # only once the sampler serves the adapter's step
        return {**reply, "lora_name": name}

    @router.get("/liveness")
    async def liveness() -> dict[str, str]:
        return {"status": "ok"}

    return router


def install(app: FastAPI, state: ServerState) -> PauseGate:
    """Mount the routes and the middleware that holds sampling requests while paused."""
    gate = PauseGate(state.config.pause_hold_s)
    app.state.vllm_pause = gate

    @app.middleware("http")
    async def hold_while_paused(request: Request, call_next: Any) -> Any:
        if request.method == "POST" and request.url.path in SAMPLING_PATHS:
            async with gate.admit():
                return await call_next(request)
        return await call_next(request)

    app.include_router(vllm_router(state, gate))
    return gate
