"""Which sampler engines exist and how each is built from its config.

`SamplerConfig.engine` is a discriminated union on `name`; `ENGINES` maps each name to a
builder. This module is the only place that chooses an engine: adding one is a config model
in `floe.config`, an engine module here in `floe/sampler/`, and one entry below. Optional
engines (vLLM) import their stack inside the builder, so floe imports without it.

`build_engine` times every start and logs it; `engine_start_seconds(engine)` reports it
(shown by `Backend.info()`).
"""

from __future__ import annotations

import copy
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from floe.config import EngineConfig, TorchEngineConfig, VllmEngineConfig
from floe.errors import InvalidInput
from floe.sampler.engine import SamplerEngine
from floe.sampler.torch_engine import TorchEngine


@dataclass(frozen=True)
class EngineSource:
    """What an engine starts from: the policy's initial weights and where they came from."""

    model: PreTrainedModel  # the policy's model at start-up; an engine copies it, never shares it
    model_path: str  # the HF directory or hub id the policy was loaded from
    tokenizer: PreTrainedTokenizerBase
    trust_remote_code: bool = False  # engines that load model_path themselves (vLLM) pass it on


def _build_torch(config: TorchEngineConfig, source: EngineSource) -> TorchEngine:
    model = copy.deepcopy(source.model)
    if config.dtype != "auto":  # every sync casts the policy's weights to the engine's dtypes (backend.sync)
        model.to(getattr(torch, config.dtype))
    model.eval()
    return TorchEngine(model, source.tokenizer, config.max_batch_sequences)


def _build_vllm(config: VllmEngineConfig, source: EngineSource) -> SamplerEngine:
    try:
        from floe.sampler.vllm_engine import VllmEngine  # noqa: PLC0415 - vllm is an optional extra
    except ImportError as e:
        raise InvalidInput("config.sampler.engine.name", f"'vllm' is not installed here: {e}") from None
    return VllmEngine.start(config, source.model_path, source.model, source.tokenizer.eos_token_id, source.trust_remote_code)


ENGINES: dict[str, Callable[[Any, EngineSource], SamplerEngine]] = {
    "torch": _build_torch,
    "vllm": _build_vllm,
}

log = logging.getLogger("floe.sampler")
_start_seconds: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


def build_engine(config: EngineConfig, source: EngineSource) -> SamplerEngine:
    """The engine `config.name` names, built from `source`. InvalidInput when the engine's
    optional stack is missing or a setting cannot be honoured on this machine."""
    began = time.perf_counter()
    engine = ENGINES[config.name](config, source)
    _start_seconds[engine] = seconds = time.perf_counter() - began
    log.info("sampler engine %r started in %.2f s", config.name, seconds)
    return engine


def engine_start_seconds(engine: SamplerEngine) -> float | None:
    """Seconds `build_engine` took to start `engine` (None for an engine built otherwise)."""
    return _start_seconds.get(engine)
