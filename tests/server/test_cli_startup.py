"""`floe serve` start-up: host:port is bound before any model is prepared or loaded, so a port
in use is one line (exit 2) in about a second, and the server then serves on that socket."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.rl.conftest import TINY_RECIPE


def test_a_port_in_use_is_one_line_before_the_model_is_built(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(TINY_RECIPE.format(steps=1, async_k=0, run_dir=tmp_path / "run"))
    cache = tmp_path / "cache"  # where the recipe's tiny model would be built
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "floe.cli", "serve", str(recipe), "--port", str(port)],
                              capture_output=True, text=True, timeout=120, check=False,
                              env={**os.environ, "FLOE_CACHE": str(cache)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"floe serve: error: port {port} on 127.0.0.1 is in use; choose another with --port"
    assert not cache.exists() and not (tmp_path / "run").exists()  # no model built, nothing written


def test_port_zero_serves_on_the_socket_bound_at_start(server_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(f'[backend]\nmodel = "{server_model}"\nstate_dir = "{tmp_path / "states"}"\n')
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "floe.server", str(config), "--port", "0"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        port = None
        deadline = time.monotonic() + 90
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            for line in log.read_text().splitlines():
                record = json.loads(line) if line.startswith("{") else {}
                if record.get("msg", record.get("message")) == "serving":
                    port = record["port"]
            time.sleep(0.2)
        assert port is not None and port > 0, log.read_text()[-3000:]
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    finally:
        proc.kill()
        proc.wait()
