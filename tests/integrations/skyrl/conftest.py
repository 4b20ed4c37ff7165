"""Fixtures of the SkyRL suites (marker `skyrl`): a tiny model and generated GSM8K-style parquet."""

from __future__ import annotations

from pathlib import Path

import pytest

from floe.models import make_tiny
from tests.integrations.skyrl.assets import make_parquet


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("skyrl-assets")
    return {
        "model": make_tiny(root / "tiny", hidden_size=64, num_hidden_layers=2),
        "train": make_parquet(root / "train.parquet", rows=24, seed=0),
        "val": make_parquet(root / "val.parquet", rows=8, seed=1),
    }
