"""A real `floe serve` process on loopback (tests.server.conftest.ServerProcess) on a tiny model
with a chat template, shared by this directory's HTTP tests (core and `verifiers`)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from floe.models import make_tiny
from tests.server.conftest import ServerProcess, free_port, write_config

TOKEN = "prime-token"


@pytest.fixture(scope="module")
def prime_server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("prime-serve")
    model = make_tiny(tmp / "tiny", hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    config = write_config(tmp / "serve.toml", model, tmp / "states")
    proc = ServerProcess(config, free_port(), tmp / "server.log", token=TOKEN).wait_ready()
    proc.model_path = Path(model)  # type: ignore[attr-defined]
    yield proc
    proc.stop(signal.SIGKILL)
