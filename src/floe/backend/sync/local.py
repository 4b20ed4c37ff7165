"""In-place copy: the sync method when policy and sampler live in one process.

The published tensors are the policy's own (no copy on the policy side, except a cast copy of
each tensor whose dtype the sampler's engine holds differently, `base.cast_for`); the sampler
copies them into its existing tensors, so nothing is reallocated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from floe.backend.sync.base import SyncReport, WeightSync, cast_for, check_publishable
from floe.backend.weights import WeightsSnapshot

if TYPE_CHECKING:
    from floe.backend.zones import PolicyWorker, SamplerWorker


class InPlaceCopy(WeightSync):
    """Hand the tensors to the sampler in this process; it copies them in place."""

    name = "inplace"

    def sync(self, policy: PolicyWorker, sampler: SamplerWorker) -> SyncReport:
        snapshot = policy.publish()
        check_publishable(snapshot)
        sent = cast_for(snapshot, sampler.held_dtypes())
        cast = {name: t for name, t in sent.tensors.items() if t is not snapshot.tensors[name]}
        if cast:  # a cast to a narrower dtype could overflow; the tensors not cast were checked above
            check_publishable(WeightsSnapshot(cast, {}, sent.step))
        received = sampler.receive(sent.tensors)
        return SyncReport(sent.fingerprints, received, sent.bytes)
