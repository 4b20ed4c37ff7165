"""In-place copy: the sync method when policy and sampler live in one process.

The published tensors are the policy's own (no copy on the policy side); the sampler copies
them into its existing tensors, so nothing is reallocated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from floe.backend.sync.base import SyncReport, WeightSync, check_publishable

if TYPE_CHECKING:
    from floe.backend.zones import PolicyWorker, SamplerWorker


class InPlaceCopy(WeightSync):
    """Hand the tensors to the sampler in this process; it copies them in place."""

    name = "inplace"

    def sync(self, policy: PolicyWorker, sampler: SamplerWorker) -> SyncReport:
        snapshot = policy.publish()
        check_publishable(snapshot)
        received = sampler.receive(snapshot.tensors)
        return SyncReport(snapshot.fingerprints, received, snapshot.bytes)
