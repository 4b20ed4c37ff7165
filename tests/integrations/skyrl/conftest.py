"""Fixtures of the SkyRL suites (marker `skyrl`): a tiny model and generated GSM8K-style parquet,
and one Ray cluster for every `main_base` run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from floe.models import make_tiny
from tests.integrations.ray_cluster import ray_cluster
from tests.integrations.skyrl.assets import make_parquet, run_env


@pytest.fixture(scope="session")
def shared_ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The session's Ray cluster (tests/integrations/ray_cluster.py; Ray's own count of CPUs, as
    SkyRL's plain `ray.init()` would start), named by $RAY_ADDRESS while the session runs: every
    `main_base` run (test_skyrl_run.py's `run_skyrl`) joins it."""
    with ray_cluster(run_env(), tmp_path_factory.mktemp("ray") / "ray.log") as address:
        yield address


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory, shared_ray: str) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("skyrl-assets")
    return {
        "model": make_tiny(root / "tiny", hidden_size=64, num_hidden_layers=2),
        "train": make_parquet(root / "train.parquet", rows=24, seed=0),
        "val": make_parquet(root / "val.parquet", rows=8, seed=1),
    }
