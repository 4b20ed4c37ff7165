"""Saved backend states on disk: the files, their format, and the directory operations.

A state is a directory `<state_dir>/<name>/` holding only safetensors and JSON (nothing that
executes code on load). Format 2 (written now):
  state.json             format, model name, sampler version, and the policy's keys: step, the
                         optimizer hyper-parameters used so far (a record: a loading backend
                         applies its own), `policy_layout` ("full" or "sharded")
  rng.safetensors        the sampler's generator ("sampler")
  the policy's own files, written by the policy zone itself (`PolicyWorker.save_state(dir)`):
    layout "full" (one process, `PolicyZone`):
      policy.safetensors     weights (with dtype bfloat16: its fp32 master weights)
      optimizer.safetensors  AdamW moments and step counts, keyed "<param index>.<key>"
      policy_rng.safetensors torch's CPU RNG ("torch_cpu")
    layout "sharded" (FSDP ranks, `policy_sharded.ShardedPolicyZone`): see `state_sharded`.
Format 1 (still read): the same without `policy_layout` (= "full"), the policy's RNG in
rng.safetensors ("torch_cpu") next to the sampler's.

The zones that keep an in-memory state (the sampler) give it as a `ZoneState` (tensors per
file, JSON keys); the policy writes its files into the temp directory and returns its JSON
keys, so a sharded policy writes its own shards. The directory is written through
`floe.atomic.atomic_directory` (a crash leaves the old state or the new one, never a mix);
every zone checks its part before any zone applies it, so a bad state changes nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from floe.atomic import atomic_directory, recover, recover_all
from floe.errors import StateError
from floe.names import check_name, path_under

__all__ = [
    "FORMAT_VERSION", "POLICY_RNG_FILE", "STATE_FILES", "ZoneState", "check_state_name", "delete_state_dir",
    "list_state_dirs", "policy_layout", "read_meta", "read_policy_files", "read_state", "saved_shapes", "state_path",
    "write_policy_files", "write_state",
]

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
STATE_FILES = ("policy.safetensors", "optimizer.safetensors", "rng.safetensors")
POLICY_RNG_FILE = "policy_rng.safetensors"
_META = "state.json"


def check_state_name(name: Any) -> str:
    """`name` if it is a valid state name (`floe.names.check_name`), else InvalidInput("name")."""
    return check_name(name, "name")


def state_path(state_dir: Path, name: Any) -> Path:
    """The directory of state `name` under `state_dir` (InvalidInput("name") for a bad name)."""
    return path_under(state_dir, name, field="name")


@dataclass
class ZoneState:
    """One zone's part of a saved state (or, read back, the whole state): tensors by file
    name (one of STATE_FILES) and by key, plus JSON-able values for state.json."""

    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def _merge(parts: list[ZoneState]) -> ZoneState:
    out = ZoneState({}, {})
    for part in parts:
        for file, tensors in part.tensors.items():
            if file not in STATE_FILES or out.tensors.setdefault(file, {}).keys() & tensors.keys():
                raise ValueError(f"state parts collide or use an unknown file: {file}")
            out.tensors[file].update(tensors)
        if out.meta.keys() & part.meta.keys():
            raise ValueError(f"state parts collide in state.json keys: {sorted(out.meta.keys() & part.meta.keys())}")
        out.meta.update(part.meta)
    return out


def write_state(
    directory: Path,
    parts: list[ZoneState],
    model_name: str,
    save_policy: Callable[[Path], dict[str, Any]] | None = None,
) -> None:
    """Write one state directory, atomically replacing a state of the same name: first
    `save_policy(temp directory)` (the policy writes its own files there and returns its
    state.json keys), then the in-memory `parts` (each file one of STATE_FILES, written only
    when a part gives it), then state.json. ValueError when parts collide with each other or
    with a file the policy wrote."""
    merged = _merge(parts)
    with atomic_directory(directory, replace=True) as tmp:
        policy_meta = save_policy(tmp) if save_policy is not None else {}
        if policy_meta.keys() & merged.meta.keys():
            raise ValueError(f"state parts collide in state.json keys: {sorted(policy_meta.keys() & merged.meta.keys())}")
        for file, tensors in merged.tensors.items():
            if (tmp / file).exists():
                raise ValueError(f"state parts collide with the policy's file {file}")
            save_file(tensors, str(tmp / file))
        meta = {"format": FORMAT_VERSION, "model": model_name, **policy_meta, **merged.meta}
        (tmp / _META).write_text(json.dumps(meta, indent=2))


def read_state(directory: Path, files: tuple[str, ...] = STATE_FILES) -> ZoneState:
    """state.json and the tensors of `files` (those present) of a state directory; StateError
    when there is no state or its format is not readable. Zones check their own part against
    the live model before anything is applied; the policy reads its own files
    (`read_policy_files`, `state_sharded`)."""
    recover(directory)
    if not (directory / _META).is_file():
        raise StateError(f"load_state: no saved state at {directory}")
    meta = json.loads((directory / _META).read_text())
    if meta.get("format") not in READABLE_FORMATS:
        raise StateError(f"load_state: state format {meta.get('format')} is not one of {list(READABLE_FORMATS)}")
    return ZoneState({file: load_file(str(directory / file)) for file in files if (directory / file).is_file()}, meta)


def policy_layout(meta: dict[str, Any]) -> str:
    """How the policy's files are laid out: "full" (format 1, `PolicyZone`) or "sharded"."""
    layout = meta.get("policy_layout", "full")
    if layout not in ("full", "sharded"):
        raise StateError(f"load_state: unknown policy_layout {layout!r} in state.json")
    return layout


def write_policy_files(directory: Path, part: ZoneState) -> None:
    """The "full" policy layout: `part` as produced by `PolicyZone.state_part()` (files
    policy.safetensors, optimizer.safetensors, rng.safetensors with "torch_cpu"), the RNG going
    to POLICY_RNG_FILE so the sampler's rng.safetensors stays its own."""
    save_file(part.tensors["policy.safetensors"], str(directory / "policy.safetensors"))
    save_file(part.tensors["optimizer.safetensors"], str(directory / "optimizer.safetensors"))
    save_file(part.tensors["rng.safetensors"], str(directory / POLICY_RNG_FILE))


def read_policy_files(directory: Path, meta: dict[str, Any]) -> ZoneState:
    """The "full" policy layout as a `PolicyZone.state_part()`-shaped ZoneState (format 1 or 2);
    StateError when a file is missing."""
    rng_file = directory / POLICY_RNG_FILE
    try:
        rng = load_file(str(rng_file)) if rng_file.is_file() else load_file(str(directory / "rng.safetensors"))
        return ZoneState(
            {
                "policy.safetensors": load_file(str(directory / "policy.safetensors")),
                "optimizer.safetensors": load_file(str(directory / "optimizer.safetensors")),
                "rng.safetensors": {k: v for k, v in rng.items() if k == "torch_cpu"},
            },
            meta,
        )
    except FileNotFoundError as exc:
        raise StateError(f"load_state: the state at {directory} lacks the policy's file {Path(exc.filename or '').name}") from None


def saved_shapes(directory: Path, file: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a safetensors file, from its header alone (nothing loaded)."""
    path = directory / file
    if not path.is_file():
        raise StateError(f"load_state: the state at {directory} lacks the policy's file {file}")
    with safe_open(str(path), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 - safe_open is not a dict


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
