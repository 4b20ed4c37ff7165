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

import json
from pathlib import Path
from typing import Any

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
        prepare_model(host.model, compute)  # dropout off and checkpointing on the HF model itself
        host.add_config(ADAPTER, backend_lora_config(lora, host.model), LoraSpec(lora.rank, seed), trainable=True)
        self.host = host
        super().__init__(host.view(ADAPTER), optimizer,  # type: ignore[arg-type]
                         compute.model_copy(update={"gradient_checkpointing": False}))  # already applied above
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
        self.host.save_adapter(ADAPTER, directory)
        save_file(part.tensors["optimizer.safetensors"], str(directory / "optimizer.safetensors"))
        save_file(part.tensors["rng.safetensors"], str(directory / POLICY_RNG_FILE))
        return {**part.meta, "policy_layout": LAYOUT}

    def _saved_config(self, directory: Path, meta: dict[str, Any]) -> dict[str, Any]:
        policy_layout(meta, lora=True)
        path = directory / ADAPTER_CONFIG
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise StateError(f"load_state: the state at {directory} has no readable {ADAPTER_CONFIG} ({exc})") from None
        live = self.host.peft.peft_config[ADAPTER].to_dict()  # type: ignore[union-attr]
        live["target_modules"] = sorted(live["target_modules"]) if live.get("target_modules") else None
        live["peft_type"] = "LORA"
        for key in _CONFIG_KEYS:
            ours = sorted(live[key]) if isinstance(live.get(key), (list, set)) else live.get(key)
            theirs = sorted(saved[key]) if isinstance(saved.get(key), list) else saved.get(key)
            if ours != theirs:
                raise StateError(f"load_state: the saved adapter has {key} = {theirs!r}, this backend's [lora] gives "
                                 f"{ours!r}; configure the same adapter")
        return saved

    def check_state(self, directory: Path, meta: dict[str, Any]) -> None:
        """StateError when the saved adapter (config, names, shapes) or optimizer does not fit."""
        self._saved_config(directory, meta)
        saved = saved_shapes(directory, ADAPTER_WEIGHTS)
        check_saved_policy(saved, self._live_shapes(), meta, len(self.params), has_rng(directory))

    def load_state(self, directory: Path, meta: dict[str, Any]) -> None:
        """Apply a state `check_state` accepted (`PolicyZone.load_part`)."""
        try:
            part = ZoneState(
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
        self.load_part(part)
