"""Sampler engines: generation from token ids behind one interface (`engine.SamplerEngine`).

`registry.build_engine` turns `SamplerConfig.engine` into an engine; `torch_engine` is the
KV-cache engine that runs in this process; `kv_cache` its preallocated cache. Only this
package knows which engine generates.
"""

from floe.sampler.engine import OnStep, SamplerEngine, StepToken, StopGeneration, replay_steps
from floe.sampler.registry import ENGINES, EngineSource, build_engine

__all__ = ["ENGINES", "EngineSource", "OnStep", "SamplerEngine", "StepToken", "StopGeneration", "build_engine",
           "replay_steps"]
