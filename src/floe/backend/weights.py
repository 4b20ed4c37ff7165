"""Moving weights from the policy to the sampler, and proving they arrived intact.

`sync_weights` fingerprints the policy's tensors (float64 sum and sum of squares) and refuses
non-finite weights before touching the sampler, copies every parameter and buffer in place
(the sampler keeps its tensors, so nothing is reallocated), then compares the destination's
fingerprints with the source's. The fingerprint is transport-agnostic: the same check
works when the two copies live in different processes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from floe.errors import StateError


@dataclass(frozen=True)
class SyncReport:
    """A copy that verified (a failed one raises instead of reporting)."""

    bytes: int
    seconds: float
    tensors: int


def fingerprint(t: torch.Tensor) -> tuple[float, float]:
    d = t.detach().double()
    return float(d.sum()), float((d * d).sum())


@torch.no_grad()
def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> SyncReport:
    """Copy and verify; raises StateError (sampler untouched) if the source is not finite,
    and StateError if the copy does not verify."""
    start = time.perf_counter()
    src_state, dst_state = src.state_dict(), dst.state_dict()
    if src_state.keys() != dst_state.keys():
        missing = sorted(set(src_state) ^ set(dst_state))[:5]
        raise StateError(f"sync_weights: policy and sampler models differ in tensors: {missing}")
    expected = {name: fingerprint(tensor) for name, tensor in src_state.items()}
    broken = [name for name, fp in expected.items() if not all(math.isfinite(x) for x in fp)]
    if broken:
        raise StateError(f"sync_weights: policy weights are not finite in {broken[:5]}; the sampler was not changed")
    total = 0
    for name, tensor in src_state.items():
        dst_state[name].copy_(tensor)
        total += tensor.numel() * tensor.element_size()
    mismatched = tuple(name for name, fp in expected.items() if fingerprint(dst_state[name]) != fp)
    if mismatched:
        raise StateError(f"sync_weights: fingerprints differ after the copy for {list(mismatched)[:5]}")
    return SyncReport(total, time.perf_counter() - start, len(src_state))
