"""The plugin's own floe backend: `python -m floe.server` on loopback, started and stopped here.

verl runs its trainer, rollout servers and agent loops in separate Ray processes; they all
reach one floe backend through floe's HTTP client, so the plugin's "embedded" backend is a
`floe serve` child of the trainer process, on 127.0.0.1, a free port and a fresh token. It
dies with the trainer (Linux parent-death signal; atexit elsewhere).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from floe.errors import FloeError


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def to_toml(table: Mapping[str, Any], prefix: str = "") -> str:
    """Nested mappings of str/number/bool/list values as TOML tables. TOML has no null: None
    values are left out here and given by `null_overrides` on the command line instead."""
    plain = [f"{k} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, Mapping) and v is not None]
    out = ([f"[{prefix}]"] if prefix else []) + plain
    for k, v in table.items():
        if isinstance(v, Mapping):
            out.append(to_toml(v, f"{prefix}.{k}" if prefix else k))
    return "\n".join(out) + "\n"


def null_overrides(table: Mapping[str, Any], prefix: str = "") -> list[str]:
    """`floe serve` flags that set each None value of the nested `table` (`--a.b null`): a None
    left out of the TOML would become the field's default (`optimizer.grad_clip`: 1.0, where
    None means no clipping)."""
    flags: list[str] = []
    for key, value in table.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if value is None:
            flags += [f"--{dotted}", "null"]
        elif isinstance(value, Mapping):
            flags += null_overrides(value, dotted)
    return flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class LocalServer:
    """A running `floe serve` child process: `url`, `token`, `stop()`."""

    def __init__(self, backend: Mapping[str, Any], log_path: str | Path | None = None, ready_timeout_s: float = 300,
                 *, server: Mapping[str, Any] | None = None, port: int | None = None):
        """Start a server for BackendConfig dict `backend` (and ServerConfig dict `server`, its
        `[server]` table) on 127.0.0.1:`port` (default: a free port); wait until it answers /ready.

        Raises FloeError with the end of the server's log if it exits or is not ready in time.
        """
        self.token = secrets.token_hex(16)
        self.port = _free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        self._workdir = workdir = Path(tempfile.mkdtemp(prefix="floe-verl-"))
        config = workdir / "serve.toml"
        tables = {"backend": dict(backend), **({"server": dict(server)} if server else {})}
        config.write_text(to_toml(tables))
        self.log_path = Path(log_path) if log_path else workdir / "server.log"
        env = {**os.environ, "FLOE_TOKEN": self.token}
        # Only the thread that forks may own the parent-death signal (it fires when that thread ends).
        in_main = threading.current_thread() is threading.main_thread()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - open for the process's lifetime
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "floe.server", str(config), *null_overrides(tables), "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning"],
            stdout=self._log, stderr=subprocess.STDOUT, env=env,
            preexec_fn=_die_with_parent if in_main and sys.platform.startswith("linux") else None,  # noqa: PLW1509 - only prctl runs before exec
        )
        atexit.register(self.stop)
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise FloeError(f"floe serve exited with {self.proc.returncode}: {self._tail()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise FloeError(f"floe serve was not ready after {ready_timeout_s}s: {self._tail()}")
            time.sleep(0.2)

    def _tail(self) -> str:
        try:
            return self.log_path.read_text()[-3000:]
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30) -> None:
        """Stop the server (SIGTERM, then SIGKILL after `timeout_s`); safe to call twice. Its
        directory (serve.toml, and server.log unless `log_path` was given) goes with it, unless
        the server had failed on its own: then it stays, for its log."""
        failed = self.proc.poll() not in (None, 0)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
        if not failed:
            shutil.rmtree(self._workdir, ignore_errors=True)
