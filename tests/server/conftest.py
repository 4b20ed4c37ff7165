"""Fixtures for the remote backend: a tiny model, and REAL `python -m floe.server` processes
on loopback (no TestClient). `shared_server` is one token-protected server for the tests
that leave its state as they found it or only compare before/after."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

import floe
from floe.models import make_tiny

TOKEN = "test-token-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A free port whose next port is free too (prime-rl's zmq transport binds port and port + 1)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def write_config(path: Path, model: Path, state_dir: Path, server: str = "") -> Path:
    path.write_text(f'[backend]\nmodel = "{model}"\nstate_dir = "{state_dir}"\nseed = 0\n\n[server]\n{server}\n')
    return path


class ServerProcess:
    """One `python -m floe.server` subprocess; its JSON logs go to `log_path`."""

    def __init__(self, config: Path, port: int, log_path: Path, *args: str, token: str | None = None):
        self.url = f"http://127.0.0.1:{port}"
        self.token = token
        self.log_path = log_path
        cmd = [sys.executable, "-m", "floe.server", str(config), "--port", str(port), *args]
        env = {k: v for k, v in os.environ.items() if k != "FLOE_TOKEN"}
        if token:
            env["FLOE_TOKEN"] = token
        self._log = open(log_path, "ab")  # noqa: SIM115 - open for the process's lifetime, closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 90) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log_path.read_text()[-3000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def client(self, **options) -> floe.Client:
        return floe.connect(self.url, token=self.token, **options)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()


@pytest.fixture(scope="session")
def server_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("server-models") / "tiny", hidden_size=32, intermediate_size=64, num_hidden_layers=2)


@pytest.fixture
def start_server(tmp_path: Path, server_model: Path):
    """Factory: start a server on a fresh state dir; every one is stopped at teardown."""
    servers: list[ServerProcess] = []

    def start(*args: str, token: str | None = None, port: int | None = None, server_toml: str = "",
              state_dir: Path | None = None, wait: bool = True) -> ServerProcess:
        config = write_config(tmp_path / "serve.toml", server_model, state_dir or tmp_path / "states", server_toml)
        proc = ServerProcess(config, port or free_port(), tmp_path / f"server-{len(servers)}.log", *args, token=token)
        servers.append(proc)
        return proc.wait_ready() if wait else proc

    yield start
    for s in servers:
        s.stop(signal.SIGKILL)


def own_server(tmp_path_factory: pytest.TempPathFactory, model: Path, name: str, token: str) -> Iterator[ServerProcess]:
    """A module's own server on `model` (a fresh state dir under `name`), stopped after it:
    `yield from own_server(...)` in a module-scoped fixture."""
    tmp = tmp_path_factory.mktemp(name)
    config = write_config(tmp / "serve.toml", model, tmp / "states")
    proc = ServerProcess(config, free_port(), tmp / "server.log", token=token).wait_ready()
    yield proc
    proc.stop(signal.SIGKILL)


def openai_sdk(server: ServerProcess, token: str) -> Iterator[openai.OpenAI]:
    """The real openai SDK on `server`'s /v1 (no retries: a failure shows), closed after it."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=token, max_retries=0, timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory: pytest.TempPathFactory, server_model: Path):
    tmp = tmp_path_factory.mktemp("shared-server")
    config = write_config(tmp / "serve.toml", server_model, tmp / "states", "max_request_mb = 1\nsequence_timeout_s = 1.5")
    proc = ServerProcess(config, free_port(), tmp / "server.log", token=TOKEN).wait_ready()
    yield proc
    proc.stop(signal.SIGKILL)


@pytest.fixture
def shared_client(shared_server: ServerProcess):
    client = shared_server.client(timeout=60)
    yield client
    client.close()
