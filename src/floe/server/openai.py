"""OpenAI-compatible sampling, served by the sampler zone (its latest synced weights).

  GET  /v1/models
  POST /v1/completions         prompt: string, list of strings, token ids, or list of token-id lists
  POST /v1/chat/completions    messages rendered with the tokenizer's chat template

Accepted fields are listed in the request models below; anything else is a 422 naming the
field (so a setting is never silently ignored). floe extensions: `top_k`, and in every choice
`token_ids` (the generated ids, stop token included) and `prompt_token_ids`.
`temperature: 0` means greedy decoding (top_k = 1; reported log-probs are then at temperature 1).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.concurrency import run_in_threadpool

from floe.config import validation_to_invalid_input
from floe.errors import InvalidInput
from floe.server.errors import ApiError
from floe.types import SampledSequence, SampleResult, SamplingParams

if TYPE_CHECKING:
    from floe.server.app import ServerState

DEFAULT_MAX_TOKENS = 16


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="floe/vLLM extension; 0 or -1 = off")
    n: int = Field(1, ge=1, le=1024)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: Literal[False] = Field(False, description="streaming is not supported")
    user: str | None = Field(None, description="accepted for compatibility; only logged")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=0, description="0 = the sampled tokens' log-probs (no alternatives)")


class ChatContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant"]
    content: str | list[ChatContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="alternatives are not computed")

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, v: int | None, info: Any) -> int | None:
        if v is not None and info.data.get("max_tokens") is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return v


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ApiError(400, "bad_request", "the body must be a JSON object", "body") from None
    if not isinstance(data, dict):
        raise ApiError(400, "bad_request", "the body must be a JSON object", "body")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_to_invalid_input(e, "request") from None


def _params(req: _SamplingFields, max_tokens: int | None) -> SamplingParams:
    greedy = req.temperature == 0
    return SamplingParams(
        max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
        temperature=1.0 if greedy else req.temperature,
        top_p=req.top_p,
        top_k=1 if greedy else max(req.top_k, 0),
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        seed=req.seed,
    )


class _Renderer:
    """Token ids -> OpenAI text, finish reasons and log-prob objects."""

    def __init__(self, tokenizer: Any, stop: list[str]):
        self.tok = tokenizer
        self.stop = stop

    def text(self, seq: SampledSequence) -> str:
        tokens = seq.tokens[:-1] if seq.stop_reason == "stop_token" else seq.tokens
        text = self.tok.decode(tokens, skip_special_tokens=True)
        if seq.stop_reason == "stop_string":
            cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=len(text))
            text = text[:cut]
        return text

    def pieces(self, seq: SampledSequence) -> list[str]:
        return [self.tok.decode([t]) for t in seq.tokens]

    @staticmethod
    def finish_reason(seq: SampledSequence) -> str:
        return "length" if seq.stop_reason == "length" else "stop"


def openai_router(state: "ServerState") -> APIRouter:
    router = APIRouter(prefix="/v1")
    tokenizer = state.backend.tokenizer

    def check_model(model: str | None) -> None:
        if model is not None and model != state.model_name:
            raise InvalidInput("request.model", f"this server serves {state.model_name!r}, not {model!r}")

    async def sample(prompts: list[list[int]], n: int, params: SamplingParams) -> SampleResult:
        result = await run_in_threadpool(state.backend.sample, prompts, n, params)
        state.metrics.tokens_sampled.inc(result.num_tokens)
        return result

    def envelope(kind: str, choices: list[dict[str, Any]], result: SampleResult) -> dict[str, Any]:
        prompt_tokens = sum(len(g.prompt) for g in result.groups)
        return {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": state.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": result.num_tokens,
                "total_tokens": prompt_tokens + result.num_tokens,
            },
            "system_fingerprint": f"floe-weights-v{result.weights_version}",
        }

    @router.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0, "owned_by": "floe"}]}

    @router.post("/completions")
    async def completions(request: Request) -> dict[str, Any]:
        req: CompletionRequest = _parse(CompletionRequest, await request.body())
        check_model(req.model)
        prompts = _completion_prompts(req.prompt, tokenizer)
        params = _params(req, req.max_tokens)
        result = await sample(prompts, req.n, params)
        render = _Renderer(tokenizer, params.stop)
        choices = []
        for group in result.groups:
            for seq in group.samples:
                choice: dict[str, Any] = {
                    "index": len(choices), "text": render.text(seq), "finish_reason": render.finish_reason(seq),
                    "logprobs": None, "token_ids": seq.tokens, "prompt_token_ids": group.prompt,
                }
                if req.logprobs is not None:
                    pieces = render.pieces(seq)
                    offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
                    choice["logprobs"] = {
                        "tokens": pieces, "token_logprobs": seq.logprobs, "top_logprobs": None, "text_offset": offsets,
                    }
                choices.append(choice)
        return envelope("text_completion", choices, result)

    @router.post("/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        req: ChatRequest = _parse(ChatRequest, await request.body())
        check_model(req.model)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        params = _params(req, req.max_completion_tokens or req.max_tokens)
        result = await sample([prompt], req.n, params)
        render = _Renderer(tokenizer, params.stop)
        choices = []
        for seq in result.groups[0].samples:
            logprobs = None
            if req.logprobs:
                logprobs = {
                    "content": [
                        {"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}
                        for piece, lp in zip(render.pieces(seq), seq.logprobs)
                    ]
                }
            choices.append({
                "index": len(choices),
                "message": {"role": "assistant", "content": render.text(seq)},
                "finish_reason": render.finish_reason(seq),
                "logprobs": logprobs,
                "token_ids": seq.tokens,
                "prompt_token_ids": prompt,
            })
        return envelope("chat.completion", choices, result)

    return router


def _completion_prompts(prompt: str | list[str] | list[int] | list[list[int]], tokenizer: Any) -> list[list[int]]:
    """Every accepted prompt form as a list of token-id lists (one group per prompt)."""
    items: list[Any] = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
    if not items:
        raise InvalidInput("request.prompt", "must not be empty")
    return [tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in items]
