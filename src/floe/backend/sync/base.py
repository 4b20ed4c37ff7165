"""Weight sync: moving the policy's published weights into the sampler, and proving it.

A sync is: `policy.publish()` (a `WeightsSnapshot`: tensors and their fingerprints) →
`WeightSync.transfer` (the method: in-place copy today; an object store or a broadcast group
across processes later) → `sampler.receive` (returns the fingerprints of what it now holds)
→ `verify` (published == received) → the coordinator bumps the sampler version. A failed
check raises `StateError`; the version does not move.

A fingerprint (`floe.sampler.engine.fingerprint`, part of the engine contract) is the float64
sum and sum of squares of one tensor.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from floe.errors import StateError
from floe.sampler.engine import Fingerprint, fingerprint, fingerprints

__all__ = ["Fingerprint", "WeightSync", "WeightsSnapshot", "check_publishable", "fingerprint", "fingerprints", "verify"]

if TYPE_CHECKING:
    from floe.backend.zones import SamplerWorker

@dataclass(frozen=True)
class WeightsSnapshot:
    """The policy's weights as published for a sync: plain tensors by state-dict name, their
    fingerprints, and the optimizer step they come from."""

    tensors: dict[str, torch.Tensor]
    fingerprints: dict[str, Fingerprint]
    step: int

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def check_publishable(snapshot: WeightsSnapshot) -> None:
    """StateError when any published tensor is not finite (nothing has moved yet)."""
    broken = [name for name, fp in snapshot.fingerprints.items() if not all(math.isfinite(x) for x in fp)]
    if broken:
        raise StateError(f"sync_weights: policy weights are not finite in {broken[:5]}; the sampler was not changed")


def verify(published: Mapping[str, Fingerprint], received: Mapping[str, Fingerprint]) -> None:
    """StateError unless the sampler holds exactly the published tensors."""
    if published.keys() != received.keys():
        differ = sorted(set(published) ^ set(received))[:5]
        raise StateError(f"sync_weights: the sampler holds different tensors than the policy published: {differ}")
    mismatched = [name for name, fp in published.items() if received[name] != fp]
    if mismatched:
        raise StateError(f"sync_weights: fingerprints differ after the transfer for {mismatched[:5]}")


class WeightSync(ABC):
    """A way of moving published weights into a sampler. The coordinator calls
    `check_publishable` before and `verify` after `transfer`."""

    name: str

    @abstractmethod
    def transfer(self, snapshot: WeightsSnapshot, sampler: SamplerWorker) -> dict[str, Fingerprint]:
        """Deliver `snapshot.tensors` to `sampler.receive`; returns the fingerprints the
        sampler reports for what it holds afterwards."""
