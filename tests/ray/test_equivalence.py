"""Must-show 1: a Ray placement (2 policy ranks, 2 sampler replicas, reference on its own
worker) gives the local placement's numbers over 3 GRPO steps: sampled tokens equal, losses,
grad norms and final weights within 1e-5 (fp32)."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from tests.ray.conftest import RAY_PLACEMENT
from tests.ray.steps import Record, assert_close_weights, grpo_step, weights

TOL = 1e-5


@pytest.mark.parametrize("sync", ["broadcast", "object_store", "shared_memory"])
def test_ray_matches_local_over_three_grpo_steps(ray_cluster, make_backend, sync: str, tmp_path) -> None:
    local = make_backend()
    ray_backend = make_backend(placement={**RAY_PLACEMENT, "sync": sync})
    info = ray_backend.info()
    assert info.capabilities["placement"]["policy_ranks"] == 2
    assert info.capabilities["placement"]["sampler_replicas"] == 2
    assert info.capabilities["placement"]["reference"] == "own worker"
    assert len(info.capabilities["zones_memory"]["policy"]) == 2
    assert len(info.capabilities["zones_memory"]["sampler"]) == 2
    assert local.info().capabilities["placement"]["kind"] == "local"
    assert info.capabilities["policy_devices"] == 2 and local.info().capabilities["policy_devices"] == 1  # MFU's denominator

    a, b = Record(), Record()
    for step in range(3):
        grpo_step(local, step, a)
        grpo_step(ray_backend, step, b)
    assert a.tokens == b.tokens  # seeded samples: the split over 2 replicas changes no token
    assert a.versions == b.versions == [0, 1, 2]
    assert a.steps == b.steps == [1, 2, 3]
    assert a.measured == b.measured  # the same counts and keys from the proxies as in process
    assert b.losses == pytest.approx(a.losses, abs=TOL)
    assert b.grad_norms == pytest.approx(a.grad_norms, abs=TOL)
    assert_close_weights(weights(local), weights(ray_backend), TOL)
    assert ray_backend.sampler.version == 3

    # export_hf gathers the shards into an ordinary HF directory equal to the local export.
    ray_dir, local_dir = ray_backend.export_hf(str(tmp_path / "ray-hf")), local.export_hf(str(tmp_path / "local-hf"))
    exported = AutoModelForCausalLM.from_pretrained(ray_dir).state_dict()
    assert_close_weights({k: v.float() for k, v in exported.items()},
                         {k: v.float() for k, v in AutoModelForCausalLM.from_pretrained(local_dir).state_dict().items()}, TOL)
