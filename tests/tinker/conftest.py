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


def start_tinker_server(directory: Path, model: Path, server_toml: str = "", state_dir: Path | None = None,
                        port: int | None = None, wait: bool = True) -> ServerProcess:
    """A server on `state_dir` (default `directory/states`; extra `[server]` TOML lines allowed),
    its config and log in `directory`. `port`: that one (a restart on the same address);
    default a free one. `wait=False` returns at once (call `wait_ready()`), so that several
    servers start together."""
    directory.mkdir(parents=True, exist_ok=True)
    state_dir = state_dir or directory / "states"
    n = len(list(directory.glob("serve-*.toml")))
    config = write_config(directory / f"serve-{n}.toml", model, state_dir, server_toml)
    for attempt in range(3):
        # free_port() only finds a port that was free a moment ago; on a shared machine
        # another process may bind it before the server does, so that case tries a new one.
        proc = ServerProcess(config, port or free_port(), directory / f"server-{n}-{attempt}.log")
        proc.state_dir = state_dir  # type: ignore[attr-defined]
        if not wait:
            return proc
        try:
            return proc.wait_ready()
        except RuntimeError as exc:
            proc.stop(signal.SIGKILL)
            if "address already in use" not in str(exc) or attempt == 2 or port is not None:
                raise
    raise AssertionError("unreachable")


@pytest.fixture
def tinker_server(tmp_path: Path, tinker_model: Path):
    """Factory: a server on a fresh state dir (see start_tinker_server), serving `model` (default:
    the tiny `tinker_model`); all killed at teardown."""
    servers: list[ServerProcess] = []

    def start(server_toml: str = "", state_dir: Path | None = None, port: int | None = None,
              wait: bool = True, model: Path | None = None) -> ServerProcess:
        proc = start_tinker_server(tmp_path, model or tinker_model, server_toml, state_dir or tmp_path / "states", port,
                                   wait)
        servers.append(proc)
        return proc

    yield start
    for s in servers:
        s.stop(signal.SIGKILL)


@pytest.fixture
def tinker_service(tinker_server):
    """Factory: `tinker.ServiceClient(base_url=url, api_key=api_key)`, as an SDK user makes one.
    Each is closed at teardown with `close("success")`, which finishes its session while its
    server still runs (this fixture depends on `tinker_server`, so it is torn down first): no
    client's heartbeat thread outlives its test and logs into later ones."""
    clients = []

    def open_client(url: str, api_key: str = API_KEY):
        import tinker  # noqa: PLC0415 - the SDK exists only in the tinker environment

        client = tinker.ServiceClient(base_url=url, api_key=api_key)
        clients.append(client)
        return client

    yield open_client
    for client in clients:
        client.close("success").result(timeout=60)
