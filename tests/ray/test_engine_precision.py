"""An fp32 policy with bf16 sampler replicas on the Ray placement (issue 23, item 2): both sync
methods (and shared_memory) cast on policy rank 0 to what the replicas hold and verify it; after a sync that
fails once the replicas took the weights, they refuse to sample until a sync succeeds."""

from __future__ import annotations

import pytest
import torch

import floe
from floe.backend.sync import SyncReport
from floe.backend.weights import fingerprints
from tests.ray.conftest import RAY_PLACEMENT
from tests.ray.steps import Record, grpo_step

SMALL = {**RAY_PLACEMENT, "policy": {"workers": 1, "cpus": 1}, "sampler": {"workers": 2, "cpus": 1},
         "reference": {"colocate_with_policy": True}}
BF16_ENGINE = {"engine": {"name": "torch", "dtype": "bfloat16"}}
PARAMS = floe.SamplingParams(max_tokens=3, seed=0)


def _held(ray, backend) -> list[dict]:
    return [ray.get(r.call.remote("held_fingerprints")) for r in backend.sampler.replicas]


@pytest.mark.parametrize("sync", ["broadcast", "object_store", "shared_memory"])
def test_bf16_replicas_under_an_fp32_policy(ray_cluster, make_backend, sync) -> None:
    backend = make_backend(placement={**SMALL, "sync": sync}, sampler=BF16_ENGINE)
    assert set(backend.sampler.held_dtypes().values()) == {"bfloat16"}
    record = Record()
    for step in range(2):
        grpo_step(backend, step, record)  # sample -> train -> sync_weights (verified)
    assert record.versions == [0, 1] and backend.info().sampler_version == 2
    want = fingerprints({k: v.to(torch.bfloat16) for k, v in backend.policy.publish().tensors.items()})
    assert all(held == want for held in _held(ray_cluster, backend))  # the policy's weights rounded to bf16
    assert backend.sample([[10, 11]], 2, PARAMS).weights_version == 2


def test_after_a_failed_sync_the_replicas_refuse_to_sample(ray_cluster, make_backend) -> None:
    from floe.placement.ray.sync import RayBroadcastSync  # noqa: PLC0415 - Ray only inside the Ray suite's tests

    class DroppingBroadcast(RayBroadcastSync):
        """The broadcast whose report loses a tensor after the replicas took the weights."""

        def sync(self, policy, sampler) -> SyncReport:
            report = super().sync(policy, sampler)
            received = dict(report.received)
            received.pop(next(iter(received)))
            return SyncReport(report.published, received, report.bytes)

    backend = make_backend(placement=SMALL, sampler=BF16_ENGINE)
    grpo_step(backend, 0, Record())
    real = backend.weight_sync
    backend.weight_sync = DroppingBroadcast(real.bucket_bytes, real.timeout_s)
    tok = [[10, 11]]
    batch = [floe.Group(tok[0], [floe.Sample([12, 13])])]
    backend.forward_backward(batch, "cross_entropy")
    backend.optim_step()
    with pytest.raises(floe.StateError, match="different tensors"):
        backend.sync_weights()
    assert backend.info().sampler_version == 1
    with pytest.raises(floe.StateError, match="not those of its version 1"):
        backend.sample(tok, 2, PARAMS)
    backend.weight_sync = real
    assert backend.sync_weights().version == 2
    assert backend.sample(tok, 2, PARAMS).weights_version == 2
