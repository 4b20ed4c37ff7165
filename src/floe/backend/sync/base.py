"""Weight sync: moving the policy's published weights into the sampler, and proving it.

A sync is one call, `WeightSync.sync(policy, sampler)`: the method decides how the weights
travel (in one process: `policy.publish()` → `sampler.receive`, `local.InPlaceCopy`; across
processes: a torch.distributed broadcast group, an object store or a same-host shared-memory
segment, owned by the placement that put the zones there) and returns a `SyncReport`: the fingerprints the policy published, the
fingerprints the sampler(s) report holding afterwards, and the bytes moved. The coordinator
then calls `verify` (published == received) and only then bumps the sampler version. Every
method refuses non-finite weights (`check_publishable`) before anything moves; a failed check
raises `StateError` and the version does not move. A sync that fails after the sampler started
receiving leaves the sampler refusing to sample until a sync succeeds
(`backend.sampler.SamplerZone`: no sample is stamped with a version its weights are not).

Precision: the policy and the sampler's engine may hold different dtypes (an fp32 policy and a
bf16 vLLM engine). Every method sends the policy's tensors cast to the dtypes the sampler
holds (`SamplerWorker.held_dtypes`, `cast_for`), and the published fingerprints are those of
the cast tensors, so `verify` compares what the engine holds with the published weights cast
the same way (round to nearest even, as the engine's own copy would cast), and a bf16 engine
gets half the bytes.

A fingerprint (`floe.sampler.engine.fingerprint`, part of the engine contract) is exact and
order-independent: the wrapping int64 sum of a tensor's bytes read as int64 words, the sum of
its 4096-word blocks' sums weighted by block index, its dtype and shape. Finiteness is a
separate cheap check (`floe.sampler.engine.nonfinite`). `WeightsSnapshot` and `Fingerprint` live in
`backend.weights`, below both this module and the zone protocols (re-exported here).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from floe.backend.weights import Fingerprint, WeightsSnapshot, fingerprint, fingerprints, nonfinite
from floe.backend.zones import PolicyWorker, SamplerWorker
from floe.errors import StateError
from floe.sampler.engine import tensor_key

__all__ = [
    "Fingerprint", "SyncReport", "WeightSync", "WeightsSnapshot", "cast_for", "cast_tensors", "check_publishable",
    "fingerprint", "fingerprints", "verify",
]


def cast_tensors(tensors: Mapping[str, torch.Tensor], dtypes: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """`tensors` with each one cast to `dtypes[name]` (a dtype name; a copy only where the dtype
    differs, the tensor itself otherwise; names without an entry are kept as they are). Tied
    names (one tensor under two names) share one cast copy."""
    out: dict[str, torch.Tensor] = {}
    cast: dict[tuple, torch.Tensor] = {}  # tied names share one cast copy
    for name, t in tensors.items():
        want = dtypes.get(name)
        if want is None or str(t.dtype).removeprefix("torch.") == want:
            out[name] = t
        else:
            key = (*tensor_key(t), want)
            if key not in cast:
                cast[key] = t.to(getattr(torch, want))
            out[name] = cast[key]
    return out


def on_cpu(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` on the CPU (each moved once; tied names share one copy; CPU tensors as they are)."""
    moved: dict[tuple, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        key = tensor_key(t)
        if key not in moved:
            moved[key] = t.cpu()
        out[name] = moved[key]
    return out


def cast_for(snapshot: WeightsSnapshot, dtypes: Mapping[str, str]) -> WeightsSnapshot:
    """The snapshot as a sampler holding `dtypes` will hold it: tensors cast (`cast_tensors`),
    fingerprints of the cast tensors (those not cast keep theirs)."""
    tensors = cast_tensors(snapshot.tensors, dtypes)
    prints = {name: snapshot.fingerprints[name] if t is snapshot.tensors[name] else fingerprint(t)
              for name, t in tensors.items()}
    return WeightsSnapshot(tensors, prints, snapshot.step)



def check_finite(tensors: Mapping[str, torch.Tensor], outcome: str) -> None:
    """StateError naming the first tensors that hold a NaN or an infinity (`nonfinite`);
    `outcome` says what that leaves the sampler with (every sync method refuses them alike)."""
    broken = nonfinite(tensors)
    if broken:
        raise StateError(f"sync_weights: policy weights are not finite in {broken[:5]}; {outcome}")


def check_publishable(snapshot: WeightsSnapshot) -> None:
    """StateError when any published tensor is not finite (nothing has moved yet)."""
    check_finite(snapshot.tensors, "the sampler was not changed")


def verify(published: Mapping[str, Fingerprint], received: Mapping[str, Fingerprint]) -> None:
    """StateError unless the sampler holds exactly the published tensors."""
    if published.keys() != received.keys():
        differ = sorted(set(published) ^ set(received))[:5]
        raise StateError(f"sync_weights: the sampler holds different tensors than the policy published: {differ}")
    mismatched = [name for name, fp in published.items() if received[name] != fp]
    if mismatched:
        raise StateError(f"sync_weights: fingerprints differ after the transfer for {mismatched[:5]}")


@dataclass(frozen=True)
class SyncReport:
    """What one transfer did: fingerprints published by the policy and received by the
    sampler (every replica must report the same; a method with several replicas checks that
    itself), and the bytes of one full copy of the weights."""

    published: dict[str, Fingerprint]
    received: dict[str, Fingerprint]
    bytes: int


class WeightSync(ABC):
    """A way of moving the policy's weights into the sampler. The coordinator holds both zones
    exclusively during `sync` and calls `verify` on the report afterwards."""

    name: str

    @abstractmethod
    def sync(self, policy: PolicyWorker, sampler: SamplerWorker) -> SyncReport:
        """Move the policy's current weights into the sampler. StateError (nothing moved)
        when they are not finite (`check_publishable`)."""
