"""placement.sync = "shared_memory" on the Ray placement (issue 22, item 2): 2 policy ranks
and 2 replicas on one node go through GRPO steps with the weights moved through policy rank 0's
/dev/shm segment (JSON handle, `backend.sync.shared`), verified as every method; a bad handle
leaves a replica refusing to sample until a sync repairs it; close unlinks the segment.

Not covered here: the refusal of a replica on another node (one-node test cluster) and the
CUDA IPC path (no GPU in CI)."""

from __future__ import annotations

import os

import pytest

import floe
from floe.backend.sync.shared import SHM_DIR
from floe.backend.weights import fingerprints
from tests.ray.conftest import RAY_PLACEMENT
from tests.ray.steps import Record, grpo_step

PARAMS = floe.SamplingParams(max_tokens=3, seed=0)


def _segments(pid: int) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"floe-sync-{pid}-")]


def test_shared_memory_sync_through_grpo_steps(ray_cluster, make_backend) -> None:
    backend = make_backend(placement={**RAY_PLACEMENT, "sync": "shared_memory"})
    assert backend.info().capabilities["placement"]["sync"] == "shared_memory"
    record = Record()
    for step in range(2):
        grpo_step(backend, step, record)  # sample -> train -> sync_weights (verified)
    assert record.versions == [0, 1] and backend.info().sampler_version == 2
    want = fingerprints(backend.policy.publish().tensors)
    held = [ray_cluster.get(r.call.remote("held_fingerprints")) for r in backend.sampler.replicas]
    assert all(h == want for h in held)
    rank0 = ray_cluster.get(backend.policy.ranks[0].pid.remote())
    assert len(_segments(rank0)) == 1  # one segment, reused by every sync

    # A handle that is not JSON, then one naming a path: StateErrors; the replica then refuses
    # to sample until a sync succeeds.
    replica = backend.sampler.replicas[0]
    with pytest.raises(Exception, match="not JSON"):
        ray_cluster.get(replica.take_shared.remote("{not json"))
    with pytest.raises(Exception, match="not a floe sync segment"):
        ray_cluster.get(replica.take_shared.remote('{"kind": "shm", "segment": "../etc/passwd", "buckets": []}'))
    with pytest.raises(floe.StateError):
        backend.sample([[10, 11]], 4, PARAMS)
    assert backend.sync_weights().version == 3
    assert backend.sample([[10, 11]], 4, PARAMS).weights_version == 3

    backend.close()
    assert _segments(rank0) == []  # unlinked at close
