"""Engine fixtures for the conformance suite: one backend per engine per module.

The torch engine runs in the core suite; the vLLM engine's cases carry the `vllm` marker and
run in vLLM's own environment (scripts/ci/vllm.sh). Nothing here imports vllm: the engine is
built through the registry only when a vllm case runs.

vLLM's CPU attention needs head_dim >= 32, so the engines share a tiny Qwen3 with head_dim 32
(hidden 64, 2 heads); it loads in transformers and vLLM alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import floe
from floe.models import make_tiny

# Small and quick on 2 shared cores: eager mode, a 256 MiB KV cache, short contexts.
VLLM_ENGINE: dict[str, Any] = {
    "name": "vllm", "enforce_eager": True, "kv_cache_memory_gib": 0.25, "max_model_len": 512, "max_num_seqs": 64,
}
ENGINES = {"torch": {"name": "torch", "max_batch_sequences": 64}, "vllm": VLLM_ENGINE}
ENGINE_PARAMS = ["torch", pytest.param("vllm", marks=pytest.mark.vllm)]


@pytest.fixture(scope="session")
def engine_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("models") / "tiny_hd32", hidden_size=64, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32, num_hidden_layers=2)


def engine_config(model: Path, state_dir: Path, engine: str, **overrides: Any) -> floe.BackendConfig:
    """A BackendConfig on `model` with the suite's settings for `engine` (default recipe otherwise)."""
    return floe.BackendConfig(model=str(model), state_dir=str(state_dir),
                              sampler={"engine": ENGINES[engine]}, **overrides)


@pytest.fixture(scope="module", params=ENGINE_PARAMS)
def engine_client(request: pytest.FixtureRequest, engine_model: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[floe.Client]:
    """An embedded client whose sampler runs the parametrised engine (lr 1e-2 so that a few
    steps move the weights visibly)."""
    config = engine_config(engine_model, tmp_path_factory.mktemp("states"), request.param, optimizer={"lr": 1e-2})
    client = floe.connect(config)
    yield client
    client.close()
