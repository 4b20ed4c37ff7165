"""Weight sync across the Ray placement's processes: policy ranks → every sampler replica.

Every method first asks every policy rank `all_finite()` (a collective): non-finite weights are
refused with StateError before a byte moves, and the version does not move. All move the full
tensors bucket by bucket (`ShardedPolicyZone.full_tensor_buckets`: the FSDP shards are gathered
one bucket at a time, full on rank 0), and all check that every replica ends up holding exactly
what was published (`proxies.same_fingerprints`); the Backend then verifies published ==
received and bumps the version.

Precision: the buckets are cast on policy rank 0 to the dtypes the replicas' engines hold
(`RaySamplerGroup.held_dtypes`, `backend.sync.cast_tensors`) and fingerprinted after the cast,
so an fp32 policy syncs into bf16 engines (half the bytes) and verifies what they hold.

* `RayBroadcastSync` (placement.sync = "broadcast"): rank 0 broadcasts each bucket over the
  sync group (policy rank 0 + every replica; NCCL on GPU, gloo on CPU) while the replicas
  receive (`backend.sync.broadcast`). Peak extra memory: one bucket (sync_bucket_mb) on the
  sender and on each replica, plus the gather buffers of one bucket on every policy rank.
* `RayObjectStoreSync` (placement.sync = "object_store", the fallback when no collective group
  can span the processes): rank 0 puts each bucket into Ray's object store as plain CPU
  tensors and every replica fetches them one at a time. Peak extra memory: the whole weights
  once in the object store (shared by the replicas of a node), one bucket in each replica.
* `RaySharedMemorySync` (placement.sync = "shared_memory", every replica on policy rank 0's
  node, checked at start): rank 0 writes every bucket into its reused /dev/shm segment and
  returns a JSON handle (names, shapes, dtypes, offsets); each replica maps the segment and
  copies bucket by bucket into its engine (`backend.sync.shared`). With a GPU and colocation
  (each replica on its policy rank's GPU) the segment is a buffer on rank 0's GPU shared by
  CUDA IPC instead: device-to-device copies, no host staging (written and guarded, not run on
  the CPU CI). Peak extra memory: the whole weights once in the segment (rank 0's host memory,
  or its GPU), nothing beyond the page cache of the mapping on a replica.
"""

from __future__ import annotations

from typing import Any

from floe.backend.sync.base import SyncReport, WeightSync
from floe.errors import StateError
from floe.placement.ray.calls import Call, gather
from floe.placement.ray.proxies import RayPolicy, RaySamplerGroup, same_fingerprints

__all__ = ["RayBroadcastSync", "RayObjectStoreSync", "RaySharedMemorySync"]


class _RaySync(WeightSync):
    """What both Ray methods share: the bucket size, the call bound, and refusing non-finite
    weights before anything moves."""

    def __init__(self, bucket_bytes: int, timeout_s: float):
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s

    @staticmethod
    def _zones(policy: Any, sampler: Any) -> tuple[RayPolicy, RaySamplerGroup]:
        assert isinstance(policy, RayPolicy) and isinstance(sampler, RaySamplerGroup)
        if not policy.all_finite():
            raise StateError("sync_weights: policy weights are not finite; the sampler was not changed")
        return policy, sampler


class RayBroadcastSync(_RaySync):
    """torch.distributed broadcast from policy rank 0 to every replica (module docstring)."""

    name = "broadcast"

    def sync(self, policy: Any, sampler: Any) -> SyncReport:
        policy, sampler = self._zones(policy, sampler)
        dtypes = sampler.held_dtypes()
        sends = [Call("policy", i, r.send_weights.remote(self.bucket_bytes, dtypes)) for i, r in enumerate(policy.ranks)]
        receives = [Call("sampler", i, r.receive_weights.remote()) for i, r in enumerate(sampler.replicas)]
        answers = gather(sends + receives, self.timeout_s)
        published, size = answers[0]
        return SyncReport(published, same_fingerprints(answers[len(sends):]), size)


class RayObjectStoreSync(_RaySync):
    """Buckets through Ray's object store (module docstring)."""

    name = "object_store"

    def sync(self, policy: Any, sampler: Any) -> SyncReport:
        policy, sampler = self._zones(policy, sampler)
        dtypes = sampler.held_dtypes()
        puts = gather([Call("policy", i, r.put_weights.remote(self.bucket_bytes, dtypes)) for i, r in enumerate(policy.ranks)],
                      self.timeout_s)
        refs, published, size = puts[0]
        takes = [Call("sampler", i, r.take_weights.remote(refs, self.timeout_s)) for i, r in enumerate(sampler.replicas)]
        return SyncReport(published, same_fingerprints(gather(takes, self.timeout_s)), size)


class RaySharedMemorySync(_RaySync):
    """Policy rank 0's shared-memory segment, mapped by every replica on its node (module
    docstring); `cuda_ipc` (GPU and colocation): the segment on rank 0's GPU, by CUDA IPC."""

    name = "shared_memory"

    def __init__(self, bucket_bytes: int, timeout_s: float, cuda_ipc: bool = False):
        super().__init__(bucket_bytes, timeout_s)
        self.cuda_ipc = cuda_ipc

    def sync(self, policy: Any, sampler: Any) -> SyncReport:
        policy, sampler = self._zones(policy, sampler)
        dtypes = sampler.held_dtypes()
        writes = gather([Call("policy", i, r.write_shared.remote(self.bucket_bytes, dtypes, self.cuda_ipc))
                         for i, r in enumerate(policy.ranks)], self.timeout_s)
        handle, published, size = writes[0]
        takes = [Call("sampler", i, r.take_shared.remote(handle)) for i, r in enumerate(sampler.replicas)]
        return SyncReport(published, same_fingerprints(gather(takes, self.timeout_s)), size)
