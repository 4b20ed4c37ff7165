"""The sampler zone: an engine's generation, stamped with the weights version it ran on.

The zone owns the version (syncs received) and the generator that seeds calls without a seed;
generation itself is the engine's (`floe.sampler`). Several `sample` calls may run at once
(the Backend holds the sampler shared for them): each reads the version once, draws its seed
under a small lock, and the engine keeps all per-call state local.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from floe.backend.state import ZoneState
from floe.backend.sync.base import Fingerprint
from floe.errors import StateError
from floe.sampler.engine import SamplerEngine
from floe.types import SampleResult, SamplingParams


class SamplerZone:
    """Implements `zones.SamplerWorker` around one `SamplerEngine`."""

    def __init__(self, engine: SamplerEngine, engine_name: str, seed: int):
        self.engine = engine
        self.engine_name = engine_name
        self._version = 0
        self._generator = torch.Generator(device="cpu").manual_seed(seed)  # seeds unseeded calls
        self._seed_lock = threading.Lock()

    @property
    def version(self) -> int:
        return self._version

    @property
    def model(self) -> Any:
        """The engine's model, for tests and benchmarks that inspect the sampler's weights
        directly (engines that hold a torch module in this process have one)."""
        return self.engine.model  # type: ignore[attr-defined]

    def validate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> None:
        self.engine.validate(prompts, n, params)

    def sample(self, prompts: list[list[int]], n: int, params: SamplingParams) -> SampleResult:
        start = time.perf_counter()
        seed = params.seed
        if seed is None:
            with self._seed_lock:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._generator))
        version = self._version
        groups = self.engine.generate(prompts, n, params, seed, version)
        num_tokens = sum(len(s.tokens) for g in groups for s in g.samples)
        return SampleResult(groups, version, num_tokens, time.perf_counter() - start)

    def receive(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, Fingerprint]:
        self.engine.load_weights(tensors)
        return self.engine.fingerprints()

    def set_version(self, version: int) -> None:
        self._version = version

    def save_state(self) -> ZoneState:
        with self._seed_lock:
            rng = self._generator.get_state()
        return ZoneState({"rng.safetensors": {"sampler": rng}}, {"sampler_version": self._version})

    def check_state(self, state: ZoneState) -> None:
        if "sampler" not in state.tensors.get("rng.safetensors", {}) or type(state.meta.get("sampler_version")) is not int:
            raise StateError("load_state: the state has no sampler version or generator; it is not a floe state")

    def load_state(self, state: ZoneState) -> None:
        self._version = int(state.meta["sampler_version"])
        with self._seed_lock:
            self._generator.set_state(state.tensors["rng.safetensors"]["sampler"])

    def close(self) -> None:
        self.engine.close()
