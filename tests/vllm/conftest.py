"""Tests of vLLM together with other stacks (marker `vllm`, run by scripts/ci/vllm.sh, whose
environment also holds Ray). Nothing here imports vllm or ray at collection time: the core
suite collects this directory without either.

The fixtures are those of the suites they come from: the tiny vLLM-compatible model (head_dim
32) of tests/sampler and the one local Ray cluster per session of tests/ray.
"""

from __future__ import annotations

from tests.ray.conftest import ray_cluster  # noqa: F401 - fixture
from tests.sampler.conftest import engine_model  # noqa: F401 - fixture
