"""Helpers for the first-use CLI tests: the tiny loop recipe, and the real `floe` command."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.rl.conftest import TINY_RECIPE


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    cpu_seconds: float  # user + system time of the command (robust to a loaded machine)


def run_floe(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> Result:
    """Run `python -m floe.cli ARGS` (what the `floe` script runs) and measure its CPU time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "floe.cli", *args], capture_output=True, text=True,
                          timeout=timeout, check=False, env={**os.environ, **(env or {})})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Result(proc.returncode, proc.stdout, proc.stderr, cpu)


@pytest.fixture
def recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write the tiny loop recipe (tests/rl/conftest.py) and return its path; FLOE_CACHE is in tmp_path."""
    monkeypatch.setenv("FLOE_CACHE", str(tmp_path / "cache"))

    def write(steps: int = 2, name: str = "run", extra: str = "") -> str:
        path = tmp_path / f"{name}.toml"
        path.write_text(TINY_RECIPE.format(steps=steps, async_k=0, run_dir=tmp_path / name) + extra)
        return str(path)

    return write
