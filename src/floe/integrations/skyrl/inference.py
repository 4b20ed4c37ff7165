"""SkyRL's inference-engine client served by a floe sampler: token ids in, tokens + log-probs out.

`FloeInferenceClient` implements SkyRL 0.4.0's ``InferenceEngineInterface`` (what
``SkyRLGymGenerator`` calls) on ``floe.Client.sample``. SkyRL's generator sends one request per
trajectory, concurrently; requests that arrive in the same event-loop turn are gathered, and
those with the same prompt and sampling parameters become one ``sample(prompts, n)`` call, so
floe prefills each prompt once for its n samples. `weight_version` is the sampler version floe
reports (the trainer's step, see dispatch.py), which SkyRL reads for its prefix-cache salt.

Every response's floe ``weights_version`` is also recorded, per SkyRL session id (one per
trajectory), into the sink `record_versions` opened around a generator call, so the fully-async
trainer (fully_async.py) measures staleness from floe's real versions.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from skyrl.backends.skyrl_train.inference_servers.base import (
    InferenceEngineInput,
    InferenceEngineInterface,
    InferenceEngineOutput,
)

import floe
from floe.errors import InvalidInput
from floe.integrations.skyrl.mapping import map_sampling

# floe stop reasons -> the vLLM ones SkyRL's generator understands.
STOP_REASONS = {"stop_token": "stop", "stop_string": "stop", "length": "length"}

# session id (None when a request has none) -> the weights versions of its responses, in order.
VersionSink = dict[Hashable | None, list[int]]
_VERSIONS: ContextVar[VersionSink | None] = ContextVar("floe_skyrl_versions", default=None)


@contextmanager
def record_versions() -> Iterator[VersionSink]:
    """A sink that every `FloeInferenceClient.generate` awaited in this context (and the tasks
    it starts, which copy the context) fills with its responses' floe weights versions."""
    sink: VersionSink = {}
    token = _VERSIONS.set(sink)
    try:
        yield sink
    finally:
        _VERSIONS.reset(token)


@dataclass
class _Pending:
    prompt: list[int]
    params: dict[str, Any]
    future: asyncio.Future[floe.SampledSequence] = field(repr=False)


class FloeInferenceClient(InferenceEngineInterface):
    """SkyRL's inference client on a floe backend (`client`); `calls` counts floe operations.

    `weight_version` starts at the backend's sampler version (a `floe serve` may have synced
    before this run)."""

    def __init__(self, client: floe.Client, tokenizer: Any, model_name: str, calls: Counter[str]):
        self._client = client
        self._tokenizer = tokenizer
        self._model_name = model_name
        self._calls = calls
        self._pending: list[_Pending] = []
        self._flush: asyncio.Task[None] | None = None
        self.weight_version = client.info().sampler_version

    @property
    def model_name(self) -> str:
        return self._model_name

    async def generate(self, input_batch: InferenceEngineInput, model: str | None = None) -> InferenceEngineOutput:
        """Generate one response per prompt in `input_batch["prompt_token_ids"]`.

        Text prompts, multi-modal features and sample-support capture are refused
        (InvalidInput naming the field): SkyRL's gym generator sends token ids only.
        """
        if input_batch.get("prompts"):
            raise InvalidInput("prompts", "floe's SkyRL client takes token ids (prompt_token_ids), not text")
        for name in ("mm_features", "return_sample_support", "routed_experts_prompt_starts"):
            if input_batch.get(name):
                raise InvalidInput(name, "not supported by floe's SkyRL client")
        prompts = input_batch.get("prompt_token_ids") or []
        params = map_sampling(input_batch.get("sampling_params") or {})
        loop = asyncio.get_running_loop()
        futures = []
        for prompt in prompts:
            fut: asyncio.Future[floe.SampledSequence] = loop.create_future()
            self._pending.append(_Pending([int(t) for t in prompt], params, fut))
            futures.append(fut)
        if self._flush is None or self._flush.done():
            self._flush = asyncio.create_task(self._run_pending())
        samples = await asyncio.gather(*futures)
        sink = _VERSIONS.get()
        if sink is not None:
            sessions = input_batch.get("session_ids") or [None] * len(samples)
            for session, s in zip(sessions, samples):
                sink.setdefault(session, []).append(s.weights_version)
        want_logprobs = (input_batch.get("sampling_params") or {}).get("logprobs") is not None
        return {
            "responses": [self._tokenizer.decode(s.tokens, skip_special_tokens=True) for s in samples],
            "response_ids": [list(s.tokens) for s in samples],
            "stop_reasons": [STOP_REASONS[s.stop_reason] for s in samples],
            "response_logprobs": [list(s.logprobs) for s in samples] if want_logprobs else None,
            "prompt_logprobs": None,
            "rollout_expert_indices": None,
            "rollout_sample_support": None,
        }

    async def _run_pending(self) -> None:
        """Sample every queued request until the queue stays empty. Each round first lets the
        trajectory coroutines started in this event-loop turn enqueue, then makes one floe call
        per set of sampling parameters and per samples-per-prompt count (seeded requests go
        alone). Requests queued while a call runs are taken by the next round."""
        while True:
            for _ in range(3):
                await asyncio.sleep(0)
            pending, self._pending = self._pending, []
            if not pending:
                return
            await self._sample(pending)

    async def _sample(self, pending: list[_Pending]) -> None:
        buckets: dict[Hashable, dict[tuple[int, ...], list[_Pending]]] = {}
        for i, p in enumerate(pending):
            key: Hashable = (json.dumps(p.params, sort_keys=True), i if "seed" in p.params else None)
            buckets.setdefault(key, {}).setdefault(tuple(p.prompt), []).append(p)
        for by_prompt in buckets.values():
            by_count: dict[int, list[list[_Pending]]] = {}
            for reqs in by_prompt.values():
                by_count.setdefault(len(reqs), []).append(reqs)
            for n, groups in by_count.items():
                params = floe.SamplingParams(**groups[0][0].params)
                try:
                    self._calls["sample"] += 1
                    out = await asyncio.to_thread(self._client.sample, [g[0].prompt for g in groups], n, params)
                except Exception as exc:  # noqa: BLE001 - handed to every waiting trajectory, not swallowed
                    for reqs in groups:
                        for r in reqs:
                            if not r.future.done():
                                r.future.set_exception(exc)
                    continue
                for reqs, group in zip(groups, out.groups):
                    for r, s in zip(reqs, group.samples):
                        r.future.set_result(s)
                self.weight_version = out.weights_version

    def get_endpoint_url(self) -> str:
        return "floe://skyrl"

    async def chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError("floe's SkyRL client serves token-in/token-out generate() only")

    async def render_chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError("floe's SkyRL client serves token-in/token-out generate() only")

    async def completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError("floe's SkyRL client serves token-in/token-out generate() only")

    # Memory and weight management belong to floe (sync_weights); SkyRL's hooks are no-ops.
    async def wake_up(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def update_named_weights(self, request: Any) -> None:
        raise NotImplementedError("weights reach floe's sampler through sync_weights, not SkyRL's weight transfer")

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        raise NotImplementedError("a LoRA policy reaches floe's sampler as merged weights through sync_weights "
                                  "([lora] in the backend), not as an adapter file")

    async def teardown(self) -> None:
        return None

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        return None

    async def pause_generation(self) -> None:
        return None

    async def resume_generation(self) -> None:
        return None

    async def finish_session(self, session_id: str) -> None:
        return None

    async def get_world_size(self) -> tuple[int, int]:
        return (1, 1)
