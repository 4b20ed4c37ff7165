"""Moving weights from the policy to the sampler, and proving they arrived intact.

`sync_weights` copies every parameter and buffer in place (the sampler keeps its tensors, so
nothing is reallocated), then compares a per-tensor fingerprint (float64 sum and sum of
squares) of source and destination. The fingerprint is transport-agnostic: the same check
works when the two copies live in different processes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SyncReport:
    bytes: int
    seconds: float
    tensors: int
    mismatched: tuple[str, ...]

    @property
    def verified(self) -> bool:
        return not self.mismatched


def fingerprint(t: torch.Tensor) -> tuple[float, float]:
    d = t.detach().double()
    return float(d.sum()), float((d * d).sum())


@torch.no_grad()
def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> SyncReport:
    start = time.perf_counter()
    src_state, dst_state = src.state_dict(), dst.state_dict()
    if src_state.keys() != dst_state.keys():
        missing = sorted(set(src_state) ^ set(dst_state))[:5]
        raise RuntimeError(f"policy and sampler models differ in tensors: {missing}")
    total = 0
    for name, tensor in src_state.items():
        dst_state[name].copy_(tensor)
        total += tensor.numel() * tensor.element_size()
    mismatched = tuple(
        name for name, tensor in src_state.items() if fingerprint(tensor) != fingerprint(dst_state[name])
    )
    return SyncReport(total, time.perf_counter() - start, len(src_state), mismatched)
