"""The Ray placement suite (marker `ray`, run by scripts/ci/ray.sh in its own environment).

Every test here is marked `ray` (pyproject's addopts leave them out of the core suite) and no
module here imports Ray at collection time: the core suite collects this directory without Ray
installed. ONE local Ray cluster serves the whole session, with more logical CPUs than the
machine's 2 cores, so 2 policy ranks, 2 sampler replicas and a reference actor fit; backends
built in this process join it (placement.address = "local" reuses a connected cluster).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import floe
from floe.models import make_tiny

LOGICAL_CPUS = 8


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.ray)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    import ray  # noqa: PLC0415 - only the Ray suite imports Ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_worker_niceness", "0")  # as floe.placement.ray.cluster does for its own clusters
    ray.init(num_cpus=LOGICAL_CPUS, include_dashboard=False, namespace="floe-tests", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("models") / "tiny", hidden_size=64, num_hidden_layers=2)


RAY_PLACEMENT = {
    "kind": "ray",
    "policy": {"workers": 2, "cpus": 1},
    "sampler": {"workers": 2, "cpus": 1},
    "reference": {"cpus": 1},
    "call_timeout_s": 120,
    "start_timeout_s": 180,
}


@pytest.fixture
def make_backend(tiny_model: Path, tmp_path: Path) -> Iterator[Any]:
    """Factory: a Backend on the tiny model; `placement` (a dict) and other config overrides."""
    from floe.backend import Backend  # noqa: PLC0415

    built: list[Any] = []

    def build(**overrides: Any) -> Any:
        cfg = {"model": str(tiny_model), "state_dir": str(tmp_path / "states"), "num_threads": 1, **overrides}
        backend = Backend(floe.BackendConfig(**cfg))
        built.append(backend)
        return backend

    yield build
    for b in built:
        b.close()
