"""The "sharded" policy layout of a saved state: torch.distributed.checkpoint, safetensors only.

A state saved by `policy_sharded.ShardedPolicyZone` holds, next to state.json:
  policy/                  written by every rank together through torch.distributed.checkpoint
                           with `HuggingFaceStorageWriter(save_distributed=True)`: one safetensors
                           file per rank ("shard-<rank>-model-...") holding that rank's slices,
                           the slice offsets in the safetensors header metadata. No `.metadata`
                           pickle is written; the reader rebuilds the index from the headers.
                           Keys: "weights.<state-dict name>" (fp32 masters for trainable
                           parameters, buffers in the model's dtype; a tied tensor once, under
                           its first name, the others in state.json's `tied_weights`) and
                           "optim.<parameter name>.<AdamW key>" (exp_avg, exp_avg_sq, step).
  policy_rng.safetensors   torch's CPU RNG of rank 0 ("torch_cpu"), as in the "full" layout.
state.json gets `policy_layout = "sharded"`, step, param_groups and optimizer_scalars as the
"full" layout does. Names, not indices, identify parameters, so any number of ranks (or one
process) can load it: each reader asks torch.distributed.checkpoint for the slices it holds.

Conversions: `read_as_full` turns the sharded layout into the "full" one in memory (what
`PolicyZone.load_part` takes), so a state saved by ranks resumes in one process; the sharded
zone reads a "full" state directly (`ShardedPolicyZone.load_state`).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from floe.backend.state import POLICY_RNG_FILE, ZoneState, saved_shapes, with_tied
from floe.errors import StateError

__all__ = [
    "POLICY_DIR", "has_rng", "load_sharded", "read_as_full", "read_rng", "save_sharded", "saved_index",
    "saved_weight_shapes",
]

POLICY_DIR = "policy"
WEIGHTS = "weights."
OPTIM = "optim."


def save_sharded(directory: Path, tensors: dict[str, torch.Tensor], group: dist.ProcessGroup) -> None:
    """Collective: every rank of `group` writes its slices of `tensors` (DTensors or replicated
    plain tensors, same keys on every rank, no tensor under two keys) under `directory/POLICY_DIR`.
    StateError on every rank when any rank fails to write (torch.distributed.checkpoint gathers
    the ranks' failures and raises on all of them, as a BaseException: CheckpointException)."""
    writer = HuggingFaceStorageWriter(str(directory / POLICY_DIR), save_distributed=True)
    try:
        dcp_save(tensors, storage_writer=writer, process_group=group)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank gets the same failure
        raise StateError(f"save_state: the policy ranks could not write their shards under {directory}: "
                         f"{_first_failure(e)}") from None


def _first_failure(error: BaseException) -> str:
    """One line for a failed checkpoint write: the first failing rank's exception."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        cause = failures[rank]
        cause = cause[0] if isinstance(cause, tuple) else cause
        text = " ".join(str(cause).split())
        return f"rank {rank}: {type(cause).__name__}: {text[:300]}"
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"


def saved_index(directory: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Key -> (global shape, dtype) of a sharded policy, from the safetensors headers only;
    StateError when `directory` has no sharded policy."""
    path = directory / POLICY_DIR
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        raise StateError(f"load_state: the state at {directory} lacks the policy's shards ({POLICY_DIR}/)")
    metadata = HuggingFaceStorageReader(str(path)).read_metadata()
    out = {}
    for key, item in metadata.state_dict_metadata.items():
        assert isinstance(item, TensorStorageMetadata)
        out[key] = (tuple(item.size), item.properties.dtype)
    return out


def saved_weight_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """State-dict name -> shape of the weights of a sharded policy (headers only)."""
    return {k.removeprefix(WEIGHTS): shape for k, (shape, _) in saved_index(directory).items() if k.startswith(WEIGHTS)}


def has_rng(directory: Path) -> bool:
    """Whether the state holds the policy's RNG ("torch_cpu"; format 1 kept it in rng.safetensors)."""
    for file in (POLICY_RNG_FILE, "rng.safetensors"):
        if (directory / file).is_file() and "torch_cpu" in saved_shapes(directory, file):
            return True
    return False


def read_rng(directory: Path) -> torch.Tensor:
    """The policy's saved torch CPU RNG state."""
    for file in (POLICY_RNG_FILE, "rng.safetensors"):
        if (directory / file).is_file():
            found = load_file(str(directory / file))
            if "torch_cpu" in found:
                return found["torch_cpu"]
    raise StateError(f"load_state: the state at {directory} has no policy RNG")


def load_sharded(directory: Path, targets: dict[str, torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Fill `targets` (DTensors or plain tensors of the saved global shapes) in place from the
    sharded policy; collective over `group`, or in this process alone when None."""
    reader = HuggingFaceStorageReader(str(directory / POLICY_DIR))
    with warnings.catch_warnings():  # no_dist=True is what we mean; DCP warns that it assumes it
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(targets, storage_reader=reader, process_group=group, no_dist=group is None)


def read_as_full(directory: Path, meta: dict[str, Any], param_names: list[str]) -> ZoneState:
    """A sharded policy as the "full" layout in memory (`PolicyZone.state_part` shape):
    weights by state-dict name, AdamW tensors keyed "<index of the parameter in
    `param_names`>.<key>", the RNG. Loads every tensor whole in this process."""
    index = saved_index(directory)
    targets = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in index.items()}
    load_sharded(directory, targets, None)
    position = {name: i for i, name in enumerate(param_names)}
    weights: dict[str, torch.Tensor] = {}
    optim: dict[str, torch.Tensor] = {}
    for key, value in targets.items():
        if key.startswith(WEIGHTS):
            weights[key.removeprefix(WEIGHTS)] = value
        elif key.startswith(OPTIM):
            name, field = key.removeprefix(OPTIM).rsplit(".", 1)
            if name not in position:
                raise StateError(f"load_state: the saved optimizer has state for {name}, not a parameter of this model")
            optim[f"{position[name]}.{field}"] = value
    return ZoneState(
        {"policy.safetensors": with_tied(weights, meta), "optimizer.safetensors": optim,
         "rng.safetensors": {"torch_cpu": read_rng(directory)}},
        meta,
    )
