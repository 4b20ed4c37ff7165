"""The LoRA policy on one rank of a data-parallel group: `ShardedPolicyZone` on a peft adapter.

What `policy_lora.LoraPolicyZone` is to `PolicyZone`, this is to `policy_sharded.ShardedPolicyZone`:
the base model is frozen and wrapped once in peft (`floe.models.lora.AdapterHost`, the adapter
added by `policy_lora.add_policy_adapter`: the same init from the same seed on every rank and in
one process), then FSDP2 shards base and adapter together (each decoder layer one unit, the
root the rest). AdamW holds the adapter's A and B shards alone; the frozen base gets no
gradient, so the ranks reduce-scatter the adapter's gradients only. Scoring reads the adapted
model through the adapter's `AdapterView` (the adapted LM head included). Everything else —
global loss scales, summed gradients, the global grad norm, equal micro-batch counts, bf16
mixed precision — is the sharded zone's own, so the ranks give what one LoRA process gives.

What differs from the full-weights ranks (collectives, as there):
* weights out (`full_tensor_buckets`, so every sync method and `publish`): the merged weights
  by the base model's names, W + (alpha / r)·B·A, each adapted weight gathered with its A and B
  and merged on rank 0 by `models.lora.merge_weight` (the formula the local zone merges with);
* states use the local LoRA zone's layout "lora" (`policy_lora`: the adapter in peft's format,
  optimizer.safetensors by parameter index, the policy RNG): the adapter is small, so the ranks
  gather it and its AdamW moments whole and rank 0 writes the files; a load reads them whole on
  every rank and keeps each rank's shards. A state moves between one process and any number of
  ranks in both directions;
* `export_hf` writes the peft adapter directory (rank 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from floe.backend.policy import PENDING_SAVE
from floe.backend.policy_lora import (
    ADAPTER,
    LAYOUT,
    add_policy_adapter,
    check_lora_state,
    read_lora_state,
    write_lora_files,
)
from floe.backend.policy_sharded import ShardedPolicyZone, full_tensor
from floe.config import ComputeConfig, LoraConfig, OptimizerConfig
from floe.errors import StateError
from floe.models.lora import AdapterHost, merge_weight, merged_entries

__all__ = ["ShardedLoraPolicyZone"]


def _base_name(name: str) -> str:
    return name.replace(".base_layer.", ".")


class ShardedLoraPolicyZone(ShardedPolicyZone):
    """`ShardedPolicyZone` on the LoRA adapter `policy_lora.ADAPTER` of `host` (module docstring).

    `host` holds the base model the caller loaded on `device`; `lora`, `seed`: the backend's
    `[lora]` and seed (A's init)."""

    def __init__(self, host: AdapterHost, lora: LoraConfig, seed: int, optimizer: OptimizerConfig,
                 compute: ComputeConfig, group: dist.ProcessGroup, device: torch.device):
        self.host = host
        super().__init__(host.model, optimizer, add_policy_adapter(host, lora, seed, compute), group, device,
                         scoring=host.view(ADAPTER))
        self.compute = compute
        # Published by the base model's names: the merged weight stands where base_layer.weight is.
        self.out_dtypes = {_base_name(k): v for k, v in self.out_dtypes.items() if ".lora_" not in k}
        self.out_tied = {_base_name(k): _base_name(v) for k, v in self.tied.items()}
        self.adapter = host.named_parameters(ADAPTER)  # peft name -> this rank's shard (a DTensor)
        # The optimizer's parameter order is the local zone's (its AdapterView's), so optimizer
        # indices of the layout "lora" mean the same parameters in both.
        assert [id(p) for p in self.adapter.values()] == [id(p) for p in self.params]

    def _published(self) -> Iterator[tuple[str, torch.Tensor, Callable[[], torch.Tensor]]]:
        """The merged weights: an adapted layer's weight gathered with its A and B, then merged."""
        for name, held, layer in merged_entries(self.model, ADAPTER):
            if name in self.out_tied:
                continue
            if layer is None:
                yield name, held, partial(full_tensor, held)
            else:
                yield name, held, partial(_gather_merged, held, layer, self.rank == 0)

    def _gathered(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Collective: the whole adapter (peft names) and AdamW tensors ("<index>.<key>"), on CPU."""
        adapter = {k: full_tensor(p).detach().cpu() for k, p in self.adapter.items()}
        optim = {f"{idx}.{key}": full_tensor(value).detach().cpu()
                 for idx, state in self.optimizer.state_dict()["state"].items()
                 for key, value in state.items() if isinstance(value, torch.Tensor)}
        return adapter, optim

    def export_hf(self, directory: Path) -> None:
        """Collective. Rank 0 writes the adapter as a peft directory (adapter_config.json +
        adapter_model.safetensors), as `LoraPolicyZone.export_hf` does."""
        adapter, _ = self._gathered()
        if self.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            self.host.save_adapter(ADAPTER, directory, adapter)
        dist.barrier(group=self.group)

    # -- own state: layout "lora" -------------------------------------------------------------

    def param_names(self) -> list[str]:
        """The adapter's peft names, in optimizer index order."""
        return list(self.adapter)

    def save_state(self, directory: Path) -> dict[str, Any]:
        """Collective. The layout "lora" into `directory` (rank 0 writes it: the same path on
        every rank); returns state.json's keys. StateError on every rank (nothing applied) while
        gradients wait for optim_step or when rank 0 cannot write."""
        if self.pending_calls:
            raise StateError(PENDING_SAVE)
        adapter, optim = self._gathered()
        failed = ""
        if self.rank == 0:
            try:
                write_lora_files(self.host, directory, adapter, optim, torch.get_rng_state())
            except Exception as e:  # noqa: BLE001 - told to every rank below, then raised on each
                failed = f"{type(e).__name__}: {e}"
        if not self._all_agree(not failed):
            raise StateError(f"save_state: policy rank 0 could not write the LoRA state under {directory}"
                             + (f": {failed}" if failed else ""))
        return {**self._optimizer_meta(), "policy_layout": LAYOUT}

    def check_state(self, directory: Path, meta: dict[str, Any]) -> None:
        """StateError when the saved adapter (config, names, shapes) or optimizer does not fit;
        reads headers only, changes nothing. Not collective."""
        check_lora_state(self.host, directory, meta, {k: tuple(p.shape) for k, p in self.adapter.items()},
                         len(self.params))

    def load_state(self, directory: Path, meta: dict[str, Any]) -> None:
        """Collective (by contract; reads files only). Apply a state `check_state` accepted:
        adapter, AdamW moments, step, RNG (`ShardedPolicyZone.load_whole`)."""
        self.load_whole(read_lora_state(directory, meta), self.adapter)


def _gather_merged(weight: torch.Tensor, layer: Any, keep: bool) -> torch.Tensor:
    """Collective: the adapted layer's whole weight with the adapter merged in. Every rank
    gathers W, A and B; only the rank that `keep`s the result (rank 0: `full_tensor_buckets`
    drops the others') computes the merge, the others return the gathered W."""
    a, b = (full_tensor(layer.lora_A[ADAPTER].weight), full_tensor(layer.lora_B[ADAPTER].weight))
    whole = full_tensor(weight)
    return merge_weight(whole, layer, ADAPTER, a, b) if keep else whole
