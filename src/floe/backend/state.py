"""Saved backend states on disk: the files, their format, and the directory operations.

A state is a directory `<state_dir>/<name>/` holding only safetensors and JSON (nothing that
executes code on load):
  policy.safetensors     the policy's weights (with dtype bfloat16: its fp32 master weights)
  optimizer.safetensors  AdamW moments and step counts, keyed "<param index>.<key>"
  rng.safetensors        torch's CPU RNG ("torch_cpu", the policy's) and the sampler's generator ("sampler")
  state.json             format, model name, step, sampler version, and the optimizer
                         hyper-parameters used so far (a record: a loading backend applies its own)
Each zone produces and consumes its own part as a `ZoneState` (tensors per file, JSON keys);
this module merges the parts into one directory and splits it back, so the zones never see
paths and the format is the same as before zones owned their state. The directory is written
through `floe.atomic.atomic_directory` (a crash leaves the old state or the new one, never a
mix); reading returns everything before any zone changes, so a bad state changes nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from floe.atomic import atomic_directory, recover, recover_all
from floe.errors import InvalidInput, StateError

__all__ = [
    "FORMAT_VERSION", "STATE_FILES", "ZoneState", "check_state_name", "delete_state_dir", "list_state_dirs",
    "read_meta", "read_state", "write_state",
]

FORMAT_VERSION = 1
STATE_FILES = ("policy.safetensors", "optimizer.safetensors", "rng.safetensors")
_META = "state.json"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def check_state_name(name: Any) -> str:
    """`name` if it is a valid state name, else InvalidInput("name", ...)."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise InvalidInput("name", "a state name is 1-128 letters, digits, '_', '-', '.', not starting with '.'")
    return name


@dataclass
class ZoneState:
    """One zone's part of a saved state (or, read back, the whole state): tensors by file
    name (one of STATE_FILES) and by key, plus JSON-able values for state.json."""

    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def _merge(parts: list[ZoneState]) -> ZoneState:
    out = ZoneState({name: {} for name in STATE_FILES}, {})
    for part in parts:
        for file, tensors in part.tensors.items():
            if file not in out.tensors or out.tensors[file].keys() & tensors.keys():
                raise ValueError(f"state parts collide or use an unknown file: {file}")
            out.tensors[file].update(tensors)
        if out.meta.keys() & part.meta.keys():
            raise ValueError(f"state parts collide in state.json keys: {sorted(out.meta.keys() & part.meta.keys())}")
        out.meta.update(part.meta)
    return out


def write_state(directory: Path, parts: list[ZoneState], model_name: str) -> None:
    """Write the zones' parts as one state directory, atomically replacing a state of the same name."""
    merged = _merge(parts)
    meta = {"format": FORMAT_VERSION, "model": model_name, **merged.meta}
    with atomic_directory(directory, replace=True) as tmp:
        for file in STATE_FILES:
            save_file(merged.tensors[file], str(tmp / file))
        (tmp / _META).write_text(json.dumps(meta, indent=2))


def read_state(directory: Path) -> ZoneState:
    """Everything in a state directory; StateError when there is none or its format differs.
    Zones check their own part against the live model before anything is applied."""
    recover(directory)
    if not (directory / _META).is_file():
        raise StateError(f"load_state: no saved state at {directory}")
    meta = json.loads((directory / _META).read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise StateError(f"load_state: state format {meta.get('format')} is not {FORMAT_VERSION}")
    return ZoneState({file: load_file(str(directory / file)) for file in STATE_FILES}, meta)


def read_meta(directory: Path) -> dict[str, Any] | None:
    """state.json of a saved state, or None when there is no state at `directory`."""
    recover(directory)
    if not (directory / _META).is_file():
        return None
    return json.loads((directory / _META).read_text())


def list_state_dirs(parent: Path) -> list[str]:
    """Names of the saved states under `parent`, sorted (interrupted swaps recovered first)."""
    if not parent.is_dir():
        return []
    recover_all(parent)
    return sorted(p.name for p in parent.iterdir() if (p / _META).is_file() and not p.name.startswith("."))


def delete_state_dir(directory: Path) -> None:
    """Remove a state: renamed aside first (it leaves the listing at once and a crash cannot
    leave a half-deleted state under its name), then removed."""
    aside = directory.parent / f".{directory.name}.deleted-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.replace(directory, aside)
    shutil.rmtree(aside, ignore_errors=True)
