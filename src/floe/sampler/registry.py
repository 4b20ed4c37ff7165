"""Which sampler engines exist and how each is built from its config.

`SamplerConfig.engine` is a discriminated union on `name`; `ENGINES` maps each name to a
builder. This module is the only place that chooses an engine: adding one (vLLM) is a config
model in `floe.config`, an engine module here in `floe/sampler/`, and one entry below.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from floe.config import EngineConfig, TorchEngineConfig
from floe.sampler.engine import SamplerEngine
from floe.sampler.torch_engine import TorchEngine


@dataclass(frozen=True)
class EngineSource:
    """What an engine starts from: the policy's initial weights and where they came from."""

    model: PreTrainedModel  # the policy's model at start-up; an engine copies it, never shares it
    model_path: str  # the HF directory or hub id the policy was loaded from
    tokenizer: PreTrainedTokenizerBase


def _build_torch(config: TorchEngineConfig, source: EngineSource) -> TorchEngine:
    model = copy.deepcopy(source.model)
    model.eval()
    return TorchEngine(model, source.tokenizer, config.max_batch_sequences)


ENGINES: dict[str, Callable[[Any, EngineSource], SamplerEngine]] = {
    "torch": _build_torch,
}


def build_engine(config: EngineConfig, source: EngineSource) -> SamplerEngine:
    """The engine `config.name` names, built from `source`."""
    return ENGINES[config.name](config, source)
