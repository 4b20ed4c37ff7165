"""The policy zone of a `[lora]` backend: `PolicyZone` training one peft LoRA adapter.

The base model is frozen (`floe.models.lora.AdapterHost`); the zone's model is the adapter's
`AdapterView`, so `PolicyZone`'s loop, AdamW and mixed-precision code run unchanged on the
adapter's A and B matrices alone (the optimizer holds nothing else). Scoring reads the
adapted model, the LM head included (`AdapterView.get_output_embeddings`).

What differs from a full-weights policy:
* `publish` gives the merged weights under the base model's names, W + (alpha / r)·B·A
  (`AdapterHost.merged_state_dict`), so every sampler engine takes them as it takes a full
  policy's weights (in-place push, fingerprints of the merged tensors);
* states use the layout "lora": the adapter in peft's format (`adapter_config.json` +
  `adapter_model.safetensors`, loadable by `peft.PeftModel.from_pretrained` on the base),
  plus optimizer.safetensors and the policy RNG as in the "full" layout;
* `export_hf` writes the peft adapter directory.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from floe.backend.policy import PolicyZone, check_saved_policy, prepare_model
from floe.backend.state import POLICY_RNG_FILE, ZoneState, policy_layout, saved_shapes
from floe.backend.state_sharded import has_rng
from floe.backend.weights import WeightsSnapshot, fingerprints
from floe.config import ComputeConfig, LoraConfig, OptimizerConfig
from floe.errors import StateError
from floe.models.lora import AdapterHost, LoraSpec, backend_lora_config

ADAPTER = "policy"  # the adapter's peft name
LAYOUT = "lora"  # state.json policy_layout of a LoRA policy's state
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_CONFIG_KEYS = ("r", "lora_alpha", "target_modules", "exclude_modules", "peft_type")


class LoraPolicyZone(PolicyZone):
    """`PolicyZone` on the LoRA adapter `ADAPTER` of `host` (module docstring)."""

    def __init__(self, host: AdapterHost, lora: LoraConfig, seed: int, optimizer: OptimizerConfig,
                 compute: ComputeConfig):
        self.host = host
        super().__init__(host.view(ADAPTER), optimizer, add_policy_adapter(host, lora, seed, compute))  # type: ignore[arg-type]
        self.compute = compute

    def publish(self) -> WeightsSnapshot:
        """The merged weights by the base model's state-dict names (merged ones are new tensors)."""
        tensors = self.host.merged_state_dict(ADAPTER)
        return WeightsSnapshot(tensors, fingerprints(tensors), self.step)

    def export_hf(self, directory: Path) -> None:
        """The adapter as a peft directory (adapter_config.json + adapter_model.safetensors)."""
        self.model.save_pretrained(directory)

    # -- own state: layout "lora" -------------------------------------------------------------

    def save_state(self, directory: Path) -> dict[str, Any]:
        """The adapter (peft format), optimizer.safetensors and the policy RNG into `directory`."""
        part = self.state_part()
        write_lora_files(self.host, directory, None, part.tensors["optimizer.safetensors"],
                         part.tensors["rng.safetensors"]["torch_cpu"])
        return {**part.meta, "policy_layout": LAYOUT}

    def check_state(self, directory: Path, meta: dict[str, Any]) -> None:
        """StateError when the saved adapter (config, names, shapes) or optimizer does not fit."""
        check_lora_state(self.host, directory, meta, self._live_shapes(), len(self.params))

    def load_state(self, directory: Path, meta: dict[str, Any]) -> None:
        """Apply a state `check_state` accepted (`PolicyZone.load_part`)."""
        self.load_part(read_lora_state(directory, meta))


def add_policy_adapter(host: AdapterHost, lora: LoraConfig, seed: int, compute: ComputeConfig) -> ComputeConfig:
    """What a LoRA policy does to its model first: dropout off and gradient checkpointing on the
    HF model itself, then the trainable adapter `ADAPTER` of `[lora]` (A drawn from `seed`, B = 0).
    Returns the compute config for the policy built on it (checkpointing already applied)."""
    prepare_model(host.model, compute)
    host.add_config(ADAPTER, backend_lora_config(lora, host.model), LoraSpec(lora.rank, seed), trainable=True)
    return compute.model_copy(update={"gradient_checkpointing": False})


# The layout "lora", shared with the sharded LoRA policy (`policy_sharded_lora`), which gathers
# its shards into whole tensors and writes / reads exactly these files.

def write_lora_files(host: AdapterHost, directory: Path, adapter: Mapping[str, torch.Tensor] | None,
                     optimizer: dict[str, torch.Tensor], rng: torch.Tensor) -> None:
    """The layout's files: the adapter `ADAPTER` of `host` in peft's format (its live tensors,
    or `adapter` by the same names), optimizer.safetensors ("<param index>.<AdamW key>") and
    the policy RNG."""
    host.save_adapter(ADAPTER, directory, adapter)
    save_file(optimizer, str(directory / "optimizer.safetensors"))
    save_file({"torch_cpu": rng}, str(directory / POLICY_RNG_FILE))


def _saved_config(host: AdapterHost, directory: Path, meta: dict[str, Any]) -> dict[str, Any]:
    policy_layout(meta, lora=True)
    path = directory / ADAPTER_CONFIG
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StateError(f"load_state: the state at {directory} has no readable {ADAPTER_CONFIG} ({exc})") from None
    excluded = saved.get("exclude_modules")
    if isinstance(excluded, str) and excluded.startswith("{"):
        # states written before 2026-12-07 hold the str() of peft's set; a literal, never code
        saved["exclude_modules"] = sorted(ast.literal_eval(excluded))
    live = host.peft.peft_config[ADAPTER].to_dict()  # type: ignore[union-attr]
    live["target_modules"] = sorted(live["target_modules"]) if live.get("target_modules") else None
    live["peft_type"] = "LORA"
    for key in _CONFIG_KEYS:
        ours = sorted(live[key]) if isinstance(live.get(key), (list, set)) else live.get(key)
        theirs = sorted(saved[key]) if isinstance(saved.get(key), list) else saved.get(key)
        if ours != theirs:
            raise StateError(f"load_state: the saved adapter has {key} = {theirs!r}, this backend's [lora] gives "
                             f"{ours!r}; configure the same adapter")
    return saved


def check_lora_state(host: AdapterHost, directory: Path, meta: dict[str, Any], live: dict[str, tuple[int, ...]],
                     num_params: int) -> None:
    """StateError when the saved adapter (config, names, shapes against `live`, the adapter's
    tensor shapes by peft name) or optimizer (`num_params` parameters) does not fit; reads
    headers only."""
    _saved_config(host, directory, meta)
    saved = saved_shapes(directory, ADAPTER_WEIGHTS)
    check_saved_policy(saved, live, meta, num_params, has_rng(directory))


def read_lora_state(directory: Path, meta: dict[str, Any]) -> ZoneState:
    """A state of the layout in memory, as `PolicyZone.state_part` shapes it (the adapter under
    "policy.safetensors")."""
    try:
        return ZoneState(
            {
                "policy.safetensors": load_file(str(directory / ADAPTER_WEIGHTS)),
                "optimizer.safetensors": load_file(str(directory / "optimizer.safetensors")),
                "rng.safetensors": {k: v for k, v in load_file(str(directory / POLICY_RNG_FILE)).items()
                                    if k == "torch_cpu"},
            },
            meta,
        )
    except FileNotFoundError as exc:
        raise StateError(f"load_state: the state at {directory} lacks the policy's file "
                         f"{Path(exc.filename or '').name}") from None
