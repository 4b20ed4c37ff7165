"""What the zones say about weights when they cross a seam: fingerprints and the published snapshot.

These types sit below both the zone protocols (`zones.py`, whose `PolicyWorker.publish` returns a
`WeightsSnapshot` and whose `SamplerWorker.receive` answers fingerprints) and the weight-sync
methods (`sync/`, which move snapshots between zones), so neither imports the other's module
for them.

A fingerprint (`floe.sampler.engine.fingerprint`, part of the engine contract) is the exact,
order-independent integer digest of one tensor's bytes (word sum, block-weighted word sum,
dtype, shape); `nonfinite` names the tensors holding NaN or infinity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from floe.sampler.engine import Fingerprint, fingerprint, fingerprints, nonfinite, unique_bytes

__all__ = ["Fingerprint", "WeightsSnapshot", "fingerprint", "fingerprints", "nonfinite"]


@dataclass(frozen=True)
class WeightsSnapshot:
    """The policy's weights as published for a sync: plain tensors by state-dict name, their
    fingerprints, and the optimizer step they come from."""

    tensors: dict[str, torch.Tensor]
    fingerprints: dict[str, Fingerprint]
    step: int

    @property
    def bytes(self) -> int:
        """Bytes of one copy of the weights, tied tensors (one storage under two names) counted once."""
        return unique_bytes(self.tensors)
