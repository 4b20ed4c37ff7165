"""Must-shows 2 and 3: sharded state across rank counts and placements; a dead or hung worker
becomes WorkerFailed within the bound, and a fresh backend resumes from the last state."""

from __future__ import annotations

import time

import pytest

from floe.errors import WorkerFailed
from floe.server.cli import latest_state
from tests.ray.conftest import RAY_PLACEMENT
from tests.ray.steps import Record, assert_close_weights, grpo_step, weights

TOL = 1e-5
ONE_RANK = {**RAY_PLACEMENT, "policy": {"workers": 1, "cpus": 1}, "sampler": {"workers": 1, "cpus": 1},
            "reference": {"colocate_with_policy": True}}


def test_state_moves_between_rank_counts_and_placements(ray_cluster, make_backend) -> None:
    two = make_backend(placement=RAY_PLACEMENT)
    a = Record()
    grpo_step(two, 0, a)
    saved = two.save_state("two_ranks")
    assert (saved.step, saved.version) == (1, 1)
    grpo_step(two, 1, a)

    one = make_backend(placement=ONE_RANK)  # 2 ranks -> 1 rank (reference inside policy rank 0)
    assert one.info().capabilities["placement"]["reference"] == "policy rank 0"
    loaded = one.load_state("two_ranks")
    assert (loaded.step, loaded.version) == (1, 1)
    b = Record()
    grpo_step(one, 1, b)
    assert b.tokens == a.tokens[1:] and b.steps == a.steps[1:] == [2]
    assert b.losses == pytest.approx(a.losses[1:], abs=TOL)
    assert b.grad_norms == pytest.approx(a.grad_norms[1:], abs=TOL)
    assert_close_weights(weights(one), weights(two), TOL)
    one.save_state("one_rank")
    one.close()

    local = make_backend()  # Ray (1 rank) -> local
    local.load_state("one_rank")
    grpo_step(two, 2, a)
    c = Record()
    grpo_step(local, 2, c)
    assert c.tokens == a.tokens[2:] and c.steps == a.steps[2:] == [3]
    assert c.losses == pytest.approx(a.losses[2:], abs=TOL)
    assert_close_weights(weights(local), weights(two), TOL)

    local.save_state("local")  # local -> Ray (2 ranks)
    two.load_state("local")
    grpo_step(local, 3, c)
    grpo_step(two, 3, a)
    assert c.tokens[-1] == a.tokens[-1] and c.steps[-1] == a.steps[-1] == 4
    assert c.losses[-1] == pytest.approx(a.losses[-1], abs=TOL)
    assert c.grad_norms[-1] == pytest.approx(a.grad_norms[-1], abs=TOL)
    assert_close_weights(weights(local), weights(two), TOL)


BOUND_S = 20.0


def test_killed_sampler_is_worker_failed_within_the_bound_and_a_fresh_backend_resumes(
    ray_cluster, make_backend, tmp_path
) -> None:
    placement = {**RAY_PLACEMENT, "call_timeout_s": BOUND_S}
    first = make_backend(placement=placement)
    done = Record()
    grpo_step(first, 0, done)
    first.save_state("step1")
    victim = first.sampler.replicas[1]
    ray_cluster.kill(victim)
    began = time.monotonic()
    with pytest.raises(WorkerFailed) as failed:
        grpo_step(first, 1, Record())
    elapsed = time.monotonic() - began
    assert failed.value.zone == "sampler" and failed.value.rank == 1
    assert "died" in str(failed.value)
    assert elapsed < BOUND_S + 5, f"WorkerFailed after {elapsed:.1f} s, bound {BOUND_S} s"
    first.close()

    # A fresh backend (as `floe serve --resume-latest` starts one) continues from the last state:
    # step 2 follows step 1 (none repeated) with the numbers an uninterrupted run gets.
    fresh = make_backend(placement=placement)
    name = latest_state(tmp_path / "states")
    assert name == "step1"
    resumed = fresh.load_state(name)
    assert (resumed.step, resumed.version) == (1, 1)
    after = Record()
    grpo_step(fresh, 1, after)
    assert after.steps == [2] and after.versions == [1]

    local = make_backend()
    reference = Record()
    grpo_step(local, 0, reference)
    grpo_step(local, 1, reference)
    assert after.tokens == reference.tokens[1:]
    assert after.losses == pytest.approx(reference.losses[1:], abs=TOL)


class _Sleeper:
    def nap(self, seconds: float) -> str:
        time.sleep(seconds)
        return "woke"


def test_a_hung_worker_is_worker_failed_within_the_bound(ray_cluster) -> None:
    from floe.placement.ray.actors import remote_class
    from floe.placement.ray.calls import Call, gather

    sleeper = remote_class(_Sleeper, num_cpus=0).remote()
    assert gather([Call("sampler", 0, sleeper.nap.remote(0.0))], 30) == ["woke"]
    began = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"sampler worker 3: no answer within call_timeout_s = 2 s"):
        gather([Call("policy", 0, sleeper.nap.remote(0.0)), Call("sampler", 3, sleeper.nap.remote(60.0))], 2.0)
    assert time.monotonic() - began < 4.0
    ray_cluster.kill(sleeper)
