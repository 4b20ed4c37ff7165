"""Tinker's OpenAI-compatible endpoints: `/oai/api/v1/completions` and
`/oai/api/v1/chat/completions` (and `GET /oai/api/v1/models`), as Tinker serves them next to its
own API, so an `openai.OpenAI(base_url=f"{server}/oai/api/v1", api_key=<Tinker key>)` client
samples a tenant's checkpoints. The request and answer shapes, streaming included, are those of
floe's `/v1` routes (`protocols/openai.py`, `add_openai_routes`).

`model` names what to sample:
* a base model id the Tinker service serves (`[backend] model`, `[server] served_model_name`,
  `[server] tinker_base_models`): the base weights;
* a `tinker://<run>/sampler_weights/<name>` path (`save_weights_for_sampler`): that checkpoint;
* `<base>;<path>`: the same checkpoint, checked to be trained on `<base>` (400 otherwise).

Ownership is the Tinker service's (`store.Store.checkpoint`): a checkpoint is found only if the
asking key owns it or its owner published it; anything else (another key's checkpoint, a
deleted or expired one, a path that never existed) answers the same 404 `model_not_found`,
which says nothing about whether the path exists. The key comes as `Authorization: Bearer
<key>` (what the openai SDK and Tinker's docs send) or `X-API-Key`; the edge resolves it.

Errors are OpenAI's shape (as under `/v1`), their messages scrubbed of server paths as on the
Tinker routes. Bounds: the service's `tinker_max_samples_per_request` (prompts x n) and
`tinker_max_sampled_tokens_per_request` (prompts x n x max_tokens), checked before any work.
Sampling runs on the Tinker workers in the key's turn, under the same per-key queue bound as
`asample` (`Futures.call`: 429 `too_many_requests` past it), on the sampler's weights
(`residency.Residency.sampler` pins them in memory), one prompt after another; the torch engine reports tokens as it draws them, so
streams are `live`; a client that disconnects stops the generation at the next step.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from floe.backend.validation import validate_prompts
from floe.errors import InvalidInput, NotFound
from floe.sampler.engine import OnStep, StepToken, StopGeneration
from floe.server.edge import principal_of
from floe.server.errors import ApiError, to_api_error
from floe.server.principals import Principal
from floe.server.protocols.openai import Target, add_openai_routes
from floe.server.protocols.tinker.service import TinkerService
from floe.server.protocols.tinker.store import SamplerRow
from floe.types import SampledGroup, SampleResult, SamplingParams

OAI_PREFIX = "/oai/api/v1"


def _not_found(model: str) -> ApiError:
    return ApiError(404, "model_not_found", f"no model {model[:200]!r} for this key: give a base model this server "
                    "serves, or the tinker:// path of a sampler checkpoint this key owns or that was published", "model")


def resolve_model(service: TinkerService, who: Principal, model: str | None) -> SamplerRow:
    """The sampler `model` names for `who` (module docstring), as a registry-free `SamplerRow`
    the residency can pin. ApiError 404 `model_not_found` for anything `who` may not see."""
    if model is None or not model.strip():
        raise ApiError(400, "missing_required_parameter", "model is required: a base model id or a tinker:// "
                       "sampler checkpoint path", "model")
    base, sep, path = model.partition(";")
    if not sep:
        base, path = ("", model) if model.startswith("tinker://") else (model, "")
    if not path:
        key = service.names.get(base)
        if key is None:
            raise _not_found(model)
        return SamplerRow(f"oai:base:{key}", who.id, "", base, key, None, None, 0, "base", 0.0)
    try:
        ckpt = service.store.checkpoint(path, who, field="model", kinds=("sampler_weights",))
    except (NotFound, InvalidInput):
        raise _not_found(model) from None
    if base and service.names.get(base) != ckpt.base:
        raise ApiError(400, "invalid_value", f"the checkpoint was trained on {ckpt.base_model!r}, not {base[:200]!r}",
                       "model")
    # One residency entry per (key, checkpoint as it is now): a checkpoint re-made under the same
    # path is a new entry, and no key shares another's entry.
    sid = f"oai:{who.id}:{ckpt.path}:{ckpt.created!r}"
    return SamplerRow(sid, who.id, "", ckpt.base_model, ckpt.base, None, ckpt.path,
                      int(ckpt.info.get("version", 0)), "checkpoint", ckpt.created)


def tinker_oai_router(service: TinkerService) -> APIRouter:
    """The `/oai/api/v1` routes on `service` (mounted by `server/app.py`)."""
    router = APIRouter(prefix=OAI_PREFIX)
    bounds = service.bounds

    async def resolve(request: Request, model: str | None) -> Target:
        who = principal_of(request)
        row = await run_in_threadpool(resolve_model, service, who, model)
        manager = service.bases[row.base]

        async def sample(prompts: list[list[int]], n: int, params: SamplingParams,
                         on_step: OnStep | None) -> SampleResult:
            rows = len(prompts) * n
            if rows > bounds.samples_per_request:
                raise InvalidInput("n", f"prompts x n = {rows} exceeds {bounds.samples_per_request} ([server] "
                                   "tinker_max_samples_per_request)")
            if rows * params.max_tokens > bounds.sampled_tokens_per_request:
                raise InvalidInput("params.max_tokens", f"prompts x n x max_tokens = {rows * params.max_tokens} exceeds "
                                   f"{bounds.sampled_tokens_per_request} ([server] tinker_max_sampled_tokens_per_request)")
            validate_prompts(prompts, n, params, manager.vocab_size, manager.max_context)
            gone = threading.Event()

            def run() -> SampleResult:
                groups: list[SampledGroup] = []
                seed = params.seed if params.seed is not None else manager.draw_seed()
                with service.residency.sampler(row) as (held, info):
                    for gi, prompt in enumerate(prompts):
                        def step(steps: list[StepToken], first: int = gi * n) -> None:
                            if gone.is_set():
                                raise StopGeneration("the client has gone")
                            if on_step is not None:
                                on_step([replace(st, row=first + st.row) for st in steps])
                        groups.append(held.sample(info, prompt, n, replace(params, seed=seed + gi), step))
                tokens = sum(len(s.tokens) for g in groups for s in g.samples)
                return SampleResult(groups, info.version, tokens, 0.0)

            try:
                return await service.futures.call(who.id, run)  # in this key's turn, under its queue bound
            except asyncio.CancelledError:
                gone.set()  # the engine stops at its next step
                raise
            except (InvalidInput, StopGeneration):
                raise
            except Exception as exc:  # noqa: BLE001 - re-raised, scrubbed: no server path in the message
                error = to_api_error(exc)
                error.message = service.scrub(error.message)
                raise error from None

        return Target(model or "", manager.tokenizer, manager.max_context, sample, "live")

    async def models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "floe",
             "max_model_len": service.bases[key].max_context} for name, key in service.names.items()]}

    add_openai_routes(router, resolve, models)
    return router
