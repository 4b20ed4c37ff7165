"""Fixtures of the verl suites (marker `verl`): one Ray cluster for every `main_ppo` run."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.integrations.ray_cluster import ray_cluster
from tests.integrations.verl.run import RAY_CPUS, RUN_ENV


@pytest.fixture(scope="session")
def shared_ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The session's Ray cluster (tests/integrations/ray_cluster.py), named by $RAY_ADDRESS while
    the session runs: every `main_ppo` run (run.py's `run_main_ppo`) joins it."""
    with ray_cluster({**os.environ, **RUN_ENV}, tmp_path_factory.mktemp("ray") / "ray.log", RAY_CPUS) as address:
        yield address
