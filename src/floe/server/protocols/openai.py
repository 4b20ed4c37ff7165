"""OpenAI-compatible sampling, served by the sampler zone (its latest synced weights).

  GET  /v1/models
  POST /v1/completions         prompt: string, list of strings, token ids, or list of token-id lists
  POST /v1/chat/completions    messages rendered with the tokenizer's chat template

This module owns the requests (which fields exist, what they mean as `floe.SamplingParams`),
the routes, and OpenAI's error shape; answers are built by openai_render.py and concurrent
requests are merged by floe.server.batching.

Fields: the request models below list what is honoured. Standard OpenAI/vLLM fields that floe
does not implement (penalties, `echo`, `response_format`, tools, ...) are accepted only at
their no-op value and otherwise refused as "not supported" (`UNSUPPORTED`); any other field is
an unknown parameter. Nothing is silently ignored. floe extensions: `top_k`, `ignore_eos`,
`stop_token_ids` (as in vLLM), and in every choice `token_ids` (the generated ids, stop token
included) and `prompt_token_ids`. `temperature: 0` is greedy decoding (floe.SamplingParams'
greedy path: the argmax token, log-probs reported at temperature 1).

Errors under /v1 are `{"error": {"message", "type", "param", "code"}}` (`openai_error_body`),
with `param` the field as the user wrote it (`max_tokens`, `prompt[1]`, `messages[0].content`).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from floe.backend.validation import MAX_TOP_LOGPROBS
from floe.errors import InvalidInput
from floe.sampler.engine import OnStep
from floe.server.batching import SampleBatcher
from floe.server.bodies import parse_json_object
from floe.server.connections import until_disconnected
from floe.server.errors import ApiError
from floe.server.protocols.openai_render import Answer, LiveStream, Renderer, render
from floe.server.state import ServerState
from floe.types import SampleResult, SamplingParams

PREFIX = "/v1"
DEFAULT_MAX_TOKENS = 16  # completions, as in OpenAI's and vLLM's; chat defaults to the remaining context

# Standard fields floe does not implement -> the values that mean "off" (accepted, as they
# change nothing); any other value is refused naming the field.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "repetition_penalty": (None, 1),
    "logit_bias": (None, {}), "min_p": (None, 0), "min_tokens": (None, 0), "best_of": (None, 1),
    "echo": (None, False), "suffix": (None,), "response_format": (None, {"type": "text"}),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,), "store": (None, False),
    "metadata": (None, {}), "service_tier": (None, "auto", "default"), "verbosity": (None,),
    "prompt_cache_key": (None,), "use_beam_search": (None, False), "length_penalty": (None, 1),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields both routes share. None = the default, as OpenAI treats null."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, description="default 1; 0 = greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="floe/vLLM extension; 0 or -1 = off")
    n: int | None = Field(None, ge=1, le=1024)
    stop: Any = Field(default_factory=list, description="a string or a list of strings")
    stop_token_ids: list[int] | None = Field(None, description="vLLM extension: more stop tokens")
    ignore_eos: bool = Field(False, description="vLLM extension: do not stop at the end-of-sequence token")
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="accepted for compatibility; not used")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> list[str]:
        items = [v] if isinstance(v, str) else v if v is not None else []
        if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
            raise ValueError("must be a non-empty string or a list of non-empty strings")
        return items

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        return self


class CompletionRequest(_SamplingFields):
    prompt: Any = Field(description="a string, a list of strings, a list of token ids, or a list of token-id lists")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="log-probs of the sampled tokens and this many alternatives")


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any
    name: Any = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: Any) -> None:
        if v is not None:
            raise ValueError("is not supported (the chat template renders roles, not names); remove it")

    @field_validator("content")
    @classmethod
    def _content(cls, v: Any) -> str:
        if isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(p, dict) for p in v):
            for i, part in enumerate(v):
                if part.get("type") != "text" or set(part) != {"type", "text"} or not isinstance(part["text"], str):
                    raise ValueError(f"part {i}: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported")
            return "".join(p["text"] for p in v)
        raise ValueError("must be a string or a list of text parts")


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _consistent(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("max_completion_tokens: give max_tokens or max_completion_tokens, not both")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self


# -- requests -> sampling ----------------------------------------------------------------------


def parse(model: type[BaseModel], raw: bytes) -> Any:
    """The request model from a JSON body; ApiError(400) naming the field otherwise."""
    try:
        data = parse_json_object(raw)
    except InvalidInput as e:
        raise ApiError(400, "invalid_json" if e.field == "body" else "invalid_value", e.message,
                       None if e.field == "body" else e.field) from None
    for name, neutral in UNSUPPORTED.items():
        if name in data:
            value = data.pop(name)
            if not any(value == v and type(value) is type(v) for v in neutral):
                allowed = " or ".join(json.dumps(v) for v in neutral)
                raise ApiError(400, "unsupported_parameter",
                               f"{name} is not supported by this server (floe); remove it or send {allowed}", name)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None


def _validation_error(error: ValidationError) -> ApiError:
    first = error.errors()[0]
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
    msg = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        return ApiError(400, "unknown_parameter", f"{path} is not a parameter of this endpoint; check the spelling", path)
    if first["type"] == "missing":
        return ApiError(400, "missing_required_parameter", f"{path} is required", path)
    field, sep, rest = msg.partition(": ")  # a model validator names its field as "field: ..."
    if not path and sep and re.fullmatch(r"\w+", field):
        path, msg = field, rest
    return ApiError(400, "invalid_value", msg, path or None)


def completion_prompts(prompt: Any, tokenizer: Any) -> tuple[list[list[int]], bool]:
    """Every accepted prompt form as a list of token-id lists (one group per prompt), and
    whether the user gave a single prompt (errors then name `prompt`, else `prompt[i]`)."""
    def is_ids(p: Any) -> bool:
        return isinstance(p, list) and bool(p) and all(type(t) is int for t in p)

    single = isinstance(prompt, str) or is_ids(prompt)
    if single:
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        items = prompt
    else:
        raise ApiError(400, "invalid_value", "must be a non-empty string, a list of strings, a list of token ids, "
                       "or a list of non-empty token-id lists", "prompt")
    return [tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in items], single


def sampling_params(req: _SamplingFields, max_tokens: int, top_logprobs: int) -> SamplingParams:
    """The request as floe sampling parameters (`temperature: 0` is floe's greedy decoding)."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else max(req.top_k, 0),
        stop_token_ids=list(req.stop_token_ids or []),
        stop=req.stop,
        seed=req.seed,
        stop_at_eos=not req.ignore_eos,
        top_logprobs=top_logprobs,
    )


def user_field(field: str, fields: dict[str, str], prompt_field: Any) -> str:
    """A backend field path (`params.max_tokens`, `prompts[1]`) as the user wrote it."""
    if field.startswith("params."):
        name = field.removeprefix("params.")
        return fields.get(name, name)
    match = re.match(r"prompts\[(\d+)\]", field)
    if match:
        return prompt_field(int(match.group(1)))
    return field


def error_code(field: str, prompts: list[list[int]], max_context: int) -> str:
    """OpenAI's `code` for a refused sample call: `context_length_exceeded` when the backend
    names a prompt (`prompts[i]`) that alone fills the context, else `invalid_value`."""
    match = re.fullmatch(r"prompts\[(\d+)\]", field)
    if match and int(match.group(1)) < len(prompts) and len(prompts[int(match.group(1))]) >= max_context:
        return "context_length_exceeded"
    return "invalid_value"


# -- errors ------------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def openai_error_body(error: ApiError) -> tuple[int, dict[str, Any]]:
    """OpenAI's status and `{"error": {message, type, param, code}}` for a refusal; the
    message names the field, so the openai SDK's exception text says what to fix."""
    status = 400 if error.status == 422 else error.status
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    message = error.message
    if error.field and not message.startswith(error.field):
        message = f"{error.field}: {message}"
    return status, {"error": {"message": message, "type": kind, "param": error.field, "code": error.error}}


def openai_error_response(error: ApiError) -> JSONResponse:
    status, body = openai_error_body(error)
    return JSONResponse(body, status_code=status)


# -- routes ------------------------------------------------------------------------------------

STREAMING_HEADER = "X-Floe-Token-Streaming"  # "live" (tokens sent as generated) | "replayed" (after the call)

SampleCall = Callable[[list[list[int]], int, SamplingParams, OnStep | None], Awaitable[SampleResult]]


@dataclass
class Target:
    """What one OpenAI-style request samples from: the model name answers carry, its tokenizer
    and context, the sample call (prompts, n, params, on_step) -> result (awaitable; cancelling
    it must stop the generation), and whether steps are `live` or `replayed`."""

    name: str
    tokenizer: Any
    max_context: int
    sample: SampleCall
    streaming: str  # "live" | "replayed"
    on_result: Callable[[SampleResult], None] = lambda result: None  # metrics


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that calls `on_close` however it ends: sent in full, failed, or cut
    by a disconnect (also one before the body iterator ever started, which then never runs
    its own `finally`)."""

    def __init__(self, content: Any, on_close: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def stop_ids(params: SamplingParams, tokenizer: Any) -> frozenset[int]:
    """The token ids that end a sample under `params` (as the engines stop): `stop_token_ids`,
    and the tokenizer's eos with `stop_at_eos`."""
    ids = set(params.stop_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    if params.stop_at_eos and isinstance(eos, int):
        ids.add(eos)
    return frozenset(ids)


def add_openai_routes(router: APIRouter, resolve: Callable[[Request, str | None], Awaitable[Target]],
                      models: Callable[[Request], Awaitable[dict[str, Any]]]) -> None:
    """`GET /models`, `POST /completions` and `POST /chat/completions` on `router`, sampling
    from the `Target` that `resolve(request, model)` names (an ApiError, e.g. 404
    `model_not_found`, refuses the request). Shared by `/v1` and Tinker's `/oai/api/v1`."""

    async def sample(request: Request, target: Target, prompts: list[list[int]], n: int, params: SamplingParams,
                     fields: dict[str, str], prompt_field: Any, on_step: OnStep | None = None) -> SampleResult:
        try:
            result = await until_disconnected(request, target.sample(prompts, n, params, on_step))
        except InvalidInput as e:
            raise ApiError(400, error_code(e.field, prompts, target.max_context), e.message,
                           user_field(e.field, fields, prompt_field)) from None
        target.on_result(result)
        return result

    async def answer(request: Request, target: Target, req: _SamplingFields, kind: str, prompts: list[list[int]],
                     n: int, params: SamplingParams, fields: dict[str, str], prompt_field: Any, logprobs: bool,
                     top: int) -> Any:
        rn = Renderer(target.tokenizer, params.stop, stop_ids(params, target.tokenizer))
        if not req.stream:
            result = await sample(request, target, prompts, n, params, fields, prompt_field)
            return render(Answer(kind, target.name, result, params.stop, logprobs, top), rn)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        live = LiveStream(kind, target.name, prompts, n, rn, logprobs, top, include_usage)
        call = asyncio.ensure_future(sample(request, target, prompts, n, params, fields, prompt_field, live.put_steps))
        call.add_done_callback(lambda _: live.end())
        started = False
        try:
            # The first step or the end: a refused request is answered with its error status
            # (nothing was sent yet), a running one streams.
            started = await until_disconnected(request, live.first())
            if not started and call.exception() is not None:
                raise call.exception()  # type: ignore[misc]
            started = True
        finally:
            if not started:
                call.cancel()

        def close() -> None:
            if not call.done():  # the client left (or the stream failed): the engine stops at its next step
                call.cancel()

        return _ClosingStream(live.events(call), close, media_type="text/event-stream",
                              headers={STREAMING_HEADER: target.streaming})

    @router.get("/models")
    async def list_models(request: Request) -> dict[str, Any]:
        return await models(request)

    @router.post("/completions")
    async def completions(request: Request) -> Any:
        req: CompletionRequest = parse(CompletionRequest, await request.body())
        target = await resolve(request, req.model)
        prompts, single = completion_prompts(req.prompt, target.tokenizer)
        params = sampling_params(req, req.max_tokens or DEFAULT_MAX_TOKENS, req.logprobs or 0)
        fields = {"top_logprobs": "logprobs", "stop_at_eos": "ignore_eos"}
        return await answer(request, target, req, "completion", prompts, req.n or 1, params, fields,
                            lambda i: "prompt" if single else f"prompt[{i}]", req.logprobs is not None, req.logprobs or 0)

    @router.post("/chat/completions")
    async def chat(request: Request) -> Any:
        req: ChatRequest = parse(ChatRequest, await request.body())
        target = await resolve(request, req.model)
        tokenizer = target.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, "invalid_value", "the model's tokenizer has no chat template; use /v1/completions", "messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.content} for m in req.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        limit_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens or req.max_tokens
        if max_tokens is None:  # as vLLM: whatever context the prompt leaves
            max_tokens = target.max_context - len(prompt)
            limit_field = "messages"
            if max_tokens < 1:
                raise ApiError(400, "context_length_exceeded",
                               f"the rendered prompt has {len(prompt)} tokens; the model's context is {target.max_context}",
                               "messages")
        params = sampling_params(req, max_tokens, req.top_logprobs or 0)
        fields = {"max_tokens": limit_field, "stop_at_eos": "ignore_eos"}
        return await answer(request, target, req, "chat", [prompt], req.n or 1, params, fields, lambda i: "messages",
                            bool(req.logprobs), req.top_logprobs or 0)


def openai_router(state: ServerState) -> APIRouter:
    """The `/v1` routes on the shared backend's sampler (the operator's), batched (`SampleBatcher`)."""
    router = APIRouter(prefix=PREFIX)
    backend = state.backend
    config = state.config
    batcher = SampleBatcher(
        backend.sample_streaming, window_s=config.openai_batch_window_ms / 1000,
        max_sequences=config.openai_batch_max_sequences, max_context=backend.max_context,
        on_stopped=state.metrics.sample_calls_stopped.inc,
    )
    router.batcher = batcher  # type: ignore[attr-defined]  # for tests

    def on_result(result: SampleResult) -> None:
        state.metrics.tokens_sampled.inc(result.num_tokens)

    target = Target(state.model_name, backend.tokenizer, backend.max_context, batcher.sample,
                    "live" if backend.streams_tokens else "replayed", on_result)

    async def resolve(request: Request, model: str | None) -> Target:
        if model is not None and not state.serves(model):
            raise ApiError(404, "model_not_found", f"this server serves {state.model_name!r}, not {model!r}", "model")
        return target

    async def models(request: Request) -> dict[str, Any]:
        served = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "floe",
                  "max_model_len": backend.max_context}
        adapters = [{**served, "id": name, "parent": state.model_name} for name in sorted(state.adapter_names)]
        return {"object": "list", "data": [served, *adapters]}

    add_openai_routes(router, resolve, models)
    return router
