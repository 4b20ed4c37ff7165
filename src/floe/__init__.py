"""floe: an open RL post-training backend. Public API only; see docs/architecture.md and docs/api.md."""

from floe import chat, grpo  # public helper modules: floe.chat.Renderer, floe.grpo.batch_from_samples, ...
from floe.client import AsyncClient, Client, connect, connect_async
from floe.config import BackendConfig, ComputeConfig, OptimizerConfig, ReferenceConfig, SamplerConfig
from floe.errors import FloeError, InvalidInput, StateError
from floe.protocol.errors import RemoteError, RemoteUnavailable
from floe.types import (
    Batch,
    ForwardBackwardResult,
    ForwardResult,
    Group,
    Info,
    OptimStepResult,
    Sample,
    SampledGroup,
    SampledSequence,
    SampleResult,
    SamplingParams,
    StateResult,
    SyncResult,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncClient", "BackendConfig", "Batch", "Client", "ComputeConfig", "FloeError", "ForwardBackwardResult",
    "ForwardResult", "Group", "Info", "InvalidInput", "OptimStepResult", "OptimizerConfig", "ReferenceConfig",
    "RemoteError", "RemoteUnavailable", "Sample", "SampleResult", "SampledGroup", "SampledSequence",
    "SamplerConfig", "SamplingParams", "StateError", "StateResult", "SyncResult", "chat", "connect", "connect_async",
    "grpo",
]
