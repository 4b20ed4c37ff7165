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

Tied weights (a model whose LM head is its input embedding: Qwen3 0.6B-4B, Llama 3.2 1B/3B,
Gemma): in either layout the shared tensor is saved once, under its first state-dict name, and
state.json's `tied_weights` maps every other name of it to that one ({"lm_head.weight":
"model.embed_tokens.weight"}); a load gives the other names the same tensor (`with_tied`), and
the model's own tie is untouched (one parameter, both names). safetensors refuses to store
one tensor twice, so this is the only way a sharded (DCP) state of such a model can be written.
States of tied models saved before `tied_weights` existed hold the tensor under both names and
load as they are.

state.json also lists every other file of the state with its size in bytes (`files`,
relative paths), written last, so a file that is missing, cut short or grown is found before
anything loads (`check_intact`; states without the list get the header checks only).

The zones that keep an in-memory state (the sampler) give it as a `ZoneState` (tensors per
file, JSON keys); the policy writes its files into the temp directory and returns its JSON
keys, so a sharded policy writes its own shards. The directory is written through
`floe.atomic.atomic_directory` (a crash leaves the old state or the new one, never a mix);
every zone checks its part before any zone applies it, so a bad state changes nothing.

Finding states: `list_states(parent)` is the one listing every path that looks for states
uses (the Backend's list_states, `floe eval --checkpoint`, `floe serve --resume-from` /
`--resume-latest`): it first finishes swaps a crash interrupted and removes what killed
writers left (`floe.atomic.recover_all`). `newest_intact_state` is what `--resume-latest`
resumes: the newest state that `check_intact` accepts, with the damaged ones it skipped.

A damaged state (state.json unreadable, a file missing or of the wrong size, a safetensors
file whose header does not parse) is a StateError naming the state, the file and what is
wrong (`check_intact`, which `read_state` runs before any zone reads a byte).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from floe.atomic import atomic_directory, owner_tag, recover, recover_all
from floe.errors import StateError
from floe.names import check_name, path_under

__all__ = [
    "FORMAT_VERSION", "POLICY_RNG_FILE", "STATE_FILES", "TIED", "ZoneState", "check_intact", "check_state_name",
    "delete_state_dir", "list_state_dirs", "list_states", "newest_intact_state", "policy_layout", "read_meta",
    "read_policy_files", "read_state", "saved_shapes", "state_path", "states_newest_first", "tied_names", "with_tied",
    "write_policy_files", "write_state",
]

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
STATE_FILES = ("policy.safetensors", "optimizer.safetensors", "rng.safetensors")
POLICY_RNG_FILE = "policy_rng.safetensors"
_META = "state.json"
_FILES = "files"  # state.json key: relative path -> size in bytes of every other file of the state


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
        if _FILES in policy_meta or _FILES in merged.meta:
            raise ValueError(f"state parts may not set the state.json key {_FILES!r} (the file list)")
        listing = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        meta = {"format": FORMAT_VERSION, "model": model_name, **policy_meta, **merged.meta, _FILES: listing}
        (tmp / _META).write_text(json.dumps(meta, indent=2))


def _damaged(directory: Path, what: str, file: str, problem: str) -> StateError:
    name = directory.name
    return StateError(f"{what}: the state {name!r} at {directory} is damaged: {file}: {problem}; delete it "
                      f"(delete_state({name!r})) or load another state")


def _read_meta_checked(directory: Path, what: str) -> dict[str, Any]:
    """state.json as a dict; StateError when there is no state or state.json is damaged."""
    if not (directory / _META).is_file():
        raise StateError(f"{what}: no saved state at {directory}")
    try:
        meta = json.loads((directory / _META).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _damaged(directory, what, _META, f"not readable JSON ({e})") from None
    if not isinstance(meta, dict):
        raise _damaged(directory, what, _META, "not a JSON object")
    return meta


def check_intact(directory: Path, what: str = "load_state") -> dict[str, Any]:
    """The state's state.json after checking the state is whole: state.json parses, its format
    is readable, every file it lists is there with its size, the files the policy layout and
    the sampler need are there, and every safetensors file's header parses and covers the file
    exactly. Headers only: nothing is loaded. StateError naming the state, the file and the
    problem otherwise (`what` names the operation in the message)."""
    recover(directory)
    meta = _read_meta_checked(directory, what)
    if meta.get("format") not in READABLE_FORMATS:
        raise StateError(f"{what}: the state {directory.name!r} has format {meta.get('format')!r}, not one of "
                         f"{list(READABLE_FORMATS)} (a newer floe wrote it, or it is not a floe state)")
    listed = meta.get(_FILES)
    if listed is not None:
        if not isinstance(listed, dict):
            raise _damaged(directory, what, _META, f"its {_FILES!r} entry is not a table of files")
        for rel, size in sorted(listed.items()):
            path = directory / rel
            if not path.is_file():
                raise _damaged(directory, what, rel, "missing")
            actual = path.stat().st_size
            if actual != size:
                raise _damaged(directory, what, rel, f"{actual} bytes, {size} when it was saved (cut short or changed)")
    layout = meta.get("policy_layout", "full")
    needed = ["rng.safetensors"] + (["policy.safetensors", "optimizer.safetensors"] if layout == "full" else [])
    for file in needed:
        if not (directory / file).is_file():
            raise _damaged(directory, what, file, "missing")
    if layout == "sharded" and not any((directory / "policy").glob("*.safetensors")):
        raise _damaged(directory, what, "policy/", "no policy shards")
    for path in sorted(directory.rglob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    f.get_slice(key).get_shape()
        except Exception as e:  # noqa: BLE001 - SafetensorError and OSError: the file is damaged
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise _damaged(directory, what, path.relative_to(directory).as_posix(), first) from None
    return meta


def read_state(directory: Path, files: tuple[str, ...] = STATE_FILES) -> ZoneState:
    """state.json and the tensors of `files` (those present) of a state directory, after
    `check_intact`; StateError when there is no state, its format is not readable or it is
    damaged. Zones check their own part against the live model before anything is applied;
    the policy reads its own files (`read_policy_files`, `state_sharded`)."""
    meta = check_intact(directory)
    return ZoneState({file: load_file(str(directory / file)) for file in files if (directory / file).is_file()}, meta)


def policy_layout(meta: dict[str, Any], lora: bool = False) -> str:
    """How the policy's files are laid out: "full" (format 1, `PolicyZone`), "sharded"
    (`policy_sharded`) or "lora" (a peft adapter, `policy_lora`). StateError for an unknown
    layout, and when the state's kind (adapter or full weights) is not the loader's (`lora`:
    the loader trains a LoRA adapter)."""
    layout = meta.get("policy_layout", "full")
    if layout not in ("full", "sharded", "lora"):
        raise StateError(f"load_state: unknown policy_layout {layout!r} in state.json")
    if lora and layout != "lora":
        raise StateError(f"load_state: this backend trains a LoRA adapter ([lora]), but the state holds a full policy "
                         f"(policy_layout {layout!r}); load it on a backend without [lora]")
    if not lora and layout == "lora":
        raise StateError("load_state: the state holds a LoRA adapter (policy_layout 'lora'), but this backend trains "
                         "every weight; load it on a backend with the same [lora]")
    return layout


TIED = "tied_weights"  # state.json key: other state-dict name of a shared tensor -> the name it is saved under


def tied_names(model: Any) -> dict[str, str]:
    """{name: first name} for every parameter or buffer of `model` reachable under more than one
    state-dict name (tied embeddings), each later name mapped to the first one (state-dict
    order). Empty for a model without ties."""
    first: dict[Any, str] = {}
    tied: dict[str, str] = {}
    if hasattr(model, "named_parameters"):  # a module: one parameter object under several names
        named: Any = itertools.chain(model.named_parameters(remove_duplicate=False),
                                     model.named_buffers(remove_duplicate=False))
        key: Callable[[torch.Tensor], Any] = id
    else:  # an object with only state_dict (a LoRA adapter view): tensors sharing their storage
        named = model.state_dict().items()

        def key(t: torch.Tensor) -> Any:
            return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
    for name, tensor in named:
        k = key(tensor)
        if k in first:
            tied[name] = first[k]
        else:
            first[k] = name
    return tied


def with_tied(values: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, Any]:
    """`values` (tensors or shapes by state-dict name, as saved) plus every tied name of
    `meta[TIED]` given its saved tensor's value; StateError when the record names a tensor the
    state does not hold."""
    out = dict(values)
    tied = meta.get(TIED) or {}
    if not isinstance(tied, dict):
        raise StateError(f"load_state: state.json's {TIED!r} is not a table of names")
    for alias, name in tied.items():
        if name not in out:
            raise StateError(f"load_state: state.json ties {alias!r} to {name!r}, which the state does not hold")
        out[alias] = out[name]
    return out


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
                "policy.safetensors": with_tied(load_file(str(directory / "policy.safetensors")), meta),
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
    """state.json of a saved state, or None when there is no state at `directory`; StateError
    when state.json is damaged."""
    recover(directory)
    if not (directory / _META).is_file():
        return None
    return _read_meta_checked(directory, "read_meta")


def list_states(parent: Path) -> list[str]:
    """Names of the saved states under `parent`, sorted: the one listing every path that looks
    for states uses. Interrupted swaps are finished first and leftovers of dead writers removed
    (`floe.atomic.recover_all`), so a state whose overwrite a crash interrupted is listed."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    recover_all(parent)
    return sorted(p.name for p in parent.iterdir() if (p / _META).is_file() and not p.name.startswith("."))


list_state_dirs = list_states  # the earlier name


def states_newest_first(parent: Path) -> list[str]:
    """`list_states`, most recently saved first (by state.json's modification time)."""
    parent = Path(parent)
    names = list_states(parent)
    return sorted(names, key=lambda n: ((parent / n / _META).stat().st_mtime_ns, n), reverse=True)


def newest_intact_state(parent: Path) -> tuple[str | None, list[tuple[str, str]]]:
    """(the newest state under `parent` that `check_intact` accepts, or None; the newer ones it
    skipped as (name, why) pairs, newest first): what `floe serve --resume-latest` resumes."""
    skipped: list[tuple[str, str]] = []
    for name in states_newest_first(parent):
        try:
            check_intact(Path(parent) / name, "resume")
        except StateError as e:
            skipped.append((name, str(e)))
            continue
        return name, skipped
    return None, skipped


def delete_state_dir(directory: Path) -> None:
    """Remove a state: renamed aside first (it leaves the listing at once and a crash cannot
    leave a half-deleted state under its name), then removed (a crash midway leaves a
    `.deleted-` sibling that the next listing removes, `floe.atomic`)."""
    aside = directory.parent / f".{directory.name}.deleted-{owner_tag()}-{uuid.uuid4().hex[:8]}"
    os.replace(directory, aside)
    shutil.rmtree(aside, ignore_errors=True)
