"""Colocation: policy rank i and sampler replica i in one bundle. The Backend switches modes
(train: sampler asleep; sync: both up; sample: policy offloaded), the numbers stay the local
ones, and info() says where each zone's memory is. On CPU, sleep/offload move nothing but the
state machine runs for real (the GPU path: benchmarks/bench_gpu.py)."""

from __future__ import annotations

import pytest

from floe.errors import StateError
from tests.ray.conftest import RAY_PLACEMENT
from tests.ray.steps import Record, assert_close_weights, grpo_step, weights

TOL = 1e-5


def test_colocated_zones_switch_modes_and_match_local(ray_cluster, make_backend) -> None:
    placement = {**RAY_PLACEMENT, "colocate": True, "reference": {"colocate_with_policy": True}}
    colocated = make_backend(placement=placement)
    local = make_backend()
    assert colocated.info().capabilities["placement"]["colocate"] is True

    a, b = Record(), Record()
    for step in range(2):
        grpo_step(local, step, a)
        grpo_step(colocated, step, b)
    assert a.tokens == b.tokens
    assert b.losses == pytest.approx(a.losses, abs=TOL)
    assert_close_weights(weights(local), weights(colocated), TOL)

    # After a sample the policy is offloaded and the sampler awake; after training, the reverse.
    colocated.sample([[8, 9, 10]], 1, None)
    assert colocated._mode.mode == "sample"
    assert colocated.sampler.asleep is False
    memory = colocated.info().capabilities["zones_memory"]
    assert len(memory["policy"]) == 2 and len(memory["sampler"]) == 2
    assert all(m["asleep"] is False for m in memory["sampler"]), memory["sampler"]
    with pytest.raises(StateError, match="optim_step"):  # nothing accumulated: refused, after the switch
        colocated.optim_step()
    assert colocated._mode.mode == "train"
    assert colocated.sampler.asleep is True
    memory = colocated.info().capabilities["zones_memory"]
    assert all(m["asleep"] is True for m in memory["sampler"]), memory["sampler"]
    colocated.sync_weights()
    assert colocated._mode.mode == "sync" and colocated.sampler.asleep is False
