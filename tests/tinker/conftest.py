"""Fixtures for the Tinker protocol suite (marker `tinker`, run by scripts/ci/tinker.sh): a real
`python -m floe.server` process on loopback serving a tiny model, driven by the unmodified
tinker SDK. Nothing here imports tinker: the tests import it inside their bodies, so the core
run (which deselects the marker) collects this directory without the SDK installed."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from floe.models import make_tiny
from tests.server.conftest import ServerProcess, free_port, write_config

API_KEY = "tml-floe-test"


@pytest.fixture(scope="session")
def tinker_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A deep path: the SDK's tokenizer heuristic rewrites paths with exactly two '/'.
    return make_tiny(tmp_path_factory.mktemp("tinker-models") / "a" / "tiny", hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2)


@pytest.fixture(autouse=True)
def _sdk_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)


@pytest.fixture
def tinker_server(tmp_path: Path, tinker_model: Path):
    """Factory: a server on a fresh state dir (extra `[server]` TOML lines allowed), serving
    `model` (default: the tiny `tinker_model`)."""
    servers: list[ServerProcess] = []

    def start(server_toml: str = "", state_dir: Path | None = None, model: Path | None = None) -> ServerProcess:
        config = write_config(tmp_path / f"serve-{len(servers)}.toml", model or tinker_model,
                              state_dir or tmp_path / "states", server_toml)
        for attempt in range(3):
            # free_port() only finds a port that was free a moment ago; on a shared machine
            # another process may bind it before the server does, so that case tries a new one.
            proc = ServerProcess(config, free_port(), tmp_path / f"server-{len(servers)}-{attempt}.log")
            servers.append(proc)
            try:
                proc.wait_ready()
                break
            except RuntimeError as exc:
                if "address already in use" not in str(exc) or attempt == 2:
                    raise
        proc.state_dir = state_dir or tmp_path / "states"  # type: ignore[attr-defined]
        return proc

    yield start
    for s in servers:
        s.stop(signal.SIGKILL)

