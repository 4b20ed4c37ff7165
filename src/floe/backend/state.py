"""Saved backend states on disk: weights, optimizer, step, version and RNG, written atomically.

A state is a directory `<state_dir>/<name>/` holding only safetensors and JSON (nothing that
executes code on load):
  policy.safetensors     the policy's weights
  optimizer.safetensors  AdamW moments and step counts, keyed "<param index>.<key>"
  rng.safetensors        torch's CPU RNG and the sampler's generator
  state.json             step, sampler version, optimizer hyper-parameters, model name
It is written into a temporary sibling and renamed into place, so a crash leaves either the
old state or the new one, never a mix. Loading reads and checks everything before touching
the live zones, so a bad or mismatched state changes nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from floe.errors import InvalidInput, StateError

FORMAT_VERSION = 1
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def check_state_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise InvalidInput("name", "a state name is 1-128 letters, digits, '_', '-', '.', not starting with '.'")
    return name


@dataclass
class LoadedState:
    """Everything read from a state directory, checked but not yet applied."""

    weights: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    step: int
    sampler_version: int
    torch_rng: torch.Tensor
    sampler_rng: torch.Tensor


def atomic_directory(final: Path) -> "_AtomicDir":
    return _AtomicDir(final)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recover(final: Path) -> None:
    """Finish an interrupted swap: if `final` is missing but its previous version was moved
    aside (a crash between the two renames), move that version back."""
    if final.exists():
        return
    for old in sorted(final.parent.glob(f".{final.name}.old-*")):
        if (old / "state.json").is_file() or (old / "config.json").is_file():
            os.replace(old, final)
            return


def recover_all(parent: Path) -> None:
    """`recover` every entry of `parent` whose swap a crash interrupted."""
    for old in parent.glob(".*.old-*"):
        recover(parent / old.name[1:].split(".old-")[0])


class _AtomicDir:
    """Context manager: yields a temp dir next to `final`; on success swaps it into place.

    The swap is two renames (old aside, new in); a crash between them is repaired by
    `recover`, which every reader calls first. Leftover temp dirs of a crashed write are removed.
    """

    def __init__(self, final: Path):
        self.final = final

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        recover(self.final)
        for stale in self.final.parent.glob(f".{self.final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.tmp-", dir=self.final.parent))
        self.tmp.chmod(0o755)  # mkdtemp's 0o700 would make shared checkpoints unreadable to others
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        for f in self.tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        old = None
        if self.final.exists():
            old = self.final.parent / f".{self.final.name}.old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(self.final, old)
        os.replace(self.tmp, self.final)
        _fsync_dir(self.final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def save_state(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    sampler_version: int,
    sampler_rng: torch.Tensor,
    model_name: str,
) -> None:
    opt = optimizer.state_dict()
    opt_tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, float]] = {}
    for idx, param_state in opt["state"].items():
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                opt_tensors[f"{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = value
    meta = {
        "format": FORMAT_VERSION,
        "model": model_name,
        "step": step,
        "sampler_version": sampler_version,
        "param_groups": opt["param_groups"],
        "optimizer_scalars": scalars,
    }
    with atomic_directory(directory) as tmp:
        # clone() un-ties shared tensors (tied embeddings) so safetensors can store them.
        weights = {k: v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}
        save_file(weights, str(tmp / "policy.safetensors"))
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        save_file({"torch_cpu": torch.get_rng_state(), "sampler": sampler_rng}, str(tmp / "rng.safetensors"))
        (tmp / "state.json").write_text(json.dumps(meta, indent=2))


def read_state(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> LoadedState:
    """Read and check a saved state against the live model; raises before anything changes."""
    recover(directory)
    if not (directory / "state.json").is_file():
        raise StateError(f"load_state: no saved state at {directory}")
    meta = json.loads((directory / "state.json").read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise StateError(f"load_state: state format {meta.get('format')} is not {FORMAT_VERSION}")
    weights = load_file(str(directory / "policy.safetensors"))
    live = model.state_dict()
    if weights.keys() != live.keys():
        diff = sorted(set(weights) ^ set(live))[:5]
        raise StateError(f"load_state: saved weights do not match this model (e.g. {diff})")
    for k, v in weights.items():
        if v.shape != live[k].shape:
            raise StateError(f"load_state: {k} has shape {tuple(v.shape)}, the model {tuple(live[k].shape)}")
    tensors = load_file(str(directory / "optimizer.safetensors"))
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    for idx, values in meta["optimizer_scalars"].items():
        state.setdefault(int(idx), {}).update(values)
    groups = meta["param_groups"]
    if sum(len(g["params"]) for g in groups) != sum(len(g["params"]) for g in optimizer.param_groups):
        raise StateError("load_state: the saved optimizer covers a different set of parameters")
    rng = load_file(str(directory / "rng.safetensors"))
    return LoadedState(
        weights=weights,
        optimizer_state={"state": state, "param_groups": groups},
        step=int(meta["step"]),
        sampler_version=int(meta["sampler_version"]),
        torch_rng=rng["torch_cpu"],
        sampler_rng=rng["sampler"],
    )
