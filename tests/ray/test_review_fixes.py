"""Fixes from the scale-out review (R3): a hung worker is named correctly, bad input moves nothing
on a colocated backend, infeasible resources and wrong connections are refused at once, a
WorkerFailed keeps its type, zone and rank over HTTP, and a failed backend releases its workers
and refuses every later operation at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import floe
from floe import Group, Sample, SamplingParams
from floe.errors import InvalidInput, StateError, WorkerFailed
from tests.ray.conftest import RAY_PLACEMENT

REPO = Path(__file__).resolve().parents[2]


class _Member:
    """A worker that can sit in a (simulated) collective: `nap` blocks its main thread."""

    def pid(self) -> int:
        return os.getpid()

    def nap(self, seconds: float) -> str:
        time.sleep(seconds)
        return "woke"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@contextmanager
def _stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGCONT)


def test_a_timeout_names_the_worker_that_does_not_answer_not_a_peer_waiting_for_it(ray_cluster) -> None:
    from floe.placement.ray.actors import remote_class
    from floe.placement.ray.calls import PING_GROUPS, Call, gather, track, untrack

    cls = remote_class(_Member, num_cpus=0, concurrency_groups=PING_GROUPS)
    waiting, hung = cls.remote(), cls.remote()
    track("policy", 0, waiting)
    track("sampler", 1, hung)
    pid = ray_cluster.get(hung.pid.remote(), timeout=60)
    ray_cluster.get(waiting.pid.remote(), timeout=60)
    try:
        with _stopped(pid):
            began = time.monotonic()
            # policy 0 is first in call order and still busy (as a healthy peer blocked in a
            # collective is); sampler 1 is stopped: it is the one named.
            with pytest.raises(WorkerFailed) as failed:
                gather([Call("policy", 0, waiting.nap.remote(30.0)), Call("sampler", 1, hung.nap.remote(0.0))], 2.0)
            elapsed = time.monotonic() - began
        assert (failed.value.zone, failed.value.rank) == ("sampler", 1)
        message = str(failed.value)
        assert "not answering (hung or lost): sampler 1" in message
        assert "alive but waiting (e.g. in a collective): policy 0" in message
        assert "\n" not in message
        assert elapsed < 2.0 + 5.0 + 2.0  # the bound, then at most PING_S of pinging
    finally:
        untrack([waiting, hung])
        ray_cluster.kill(waiting)
        ray_cluster.kill(hung)


def test_untracked_workers_are_all_named_when_none_answers(ray_cluster) -> None:
    from floe.placement.ray.actors import remote_class
    from floe.placement.ray.calls import Call, gather

    a, b = remote_class(_Member, num_cpus=0).remote(), remote_class(_Member, num_cpus=0).remote()
    try:
        with pytest.raises(WorkerFailed) as failed:
            gather([Call("policy", 0, a.nap.remote(30.0)), Call("policy", 1, b.nap.remote(30.0))], 1.0)
        assert "from policy 0, policy 1 (one of them hangs or is lost" in str(failed.value)
    finally:
        ray_cluster.kill(a)
        ray_cluster.kill(b)


class _Counting:
    """Counts every actor method call this process makes (Ray's own ActorMethod, not floe's)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        import ray.actor

        self.calls: list[str] = []
        original = ray.actor.ActorMethod._remote

        def counted(method: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls.append(method._method_name)
            return original(method, *args, **kwargs)

        monkeypatch.setattr(ray.actor.ActorMethod, "_remote", counted)


def _group(tokens: list[int]) -> Group:
    return Group([8, 9], [Sample(tokens, logprobs=[-1.0] * len(tokens), advantage=1.0)])


def test_colocated_bad_input_is_refused_before_any_mode_switch_or_worker_call(
    ray_cluster, make_backend, tmp_path, monkeypatch
) -> None:
    placement = {**RAY_PLACEMENT, "colocate": True, "policy": {"workers": 1, "cpus": 1},
                 "sampler": {"workers": 1, "cpus": 1}, "reference": {"colocate_with_policy": True}}
    backend = make_backend(placement=placement)
    backend.sample([[8, 9, 10]], 1, SamplingParams(max_tokens=3, seed=1))
    assert backend._mode.mode == "sample" and backend.sampler.asleep is False
    before = (backend.policy.step, backend.sampler.version, backend.info().capabilities["zones_memory"])
    vocab = backend.vocab_size
    bad = [
        (lambda: backend.forward_backward([_group([vocab + 5])], "ppo"), InvalidInput),
        (lambda: backend.forward([_group([vocab + 5])]), InvalidInput),
        (lambda: backend.save_state("../x"), InvalidInput),
        (lambda: backend.export_hf(str(REPO)), InvalidInput),
    ]
    counter = _Counting(monkeypatch)
    for call, error in bad:  # in "sample" mode: training calls that must not offload the sampler
        with pytest.raises(error):
            call()
    assert counter.calls == [] and backend._mode.mode == "sample"
    monkeypatch.undo()

    backend.forward([_group([8])])  # now in "train" mode (the sampler asleep)
    assert backend._mode.mode == "train" and backend.sampler.asleep is True
    memory = backend.info().capabilities["zones_memory"]
    counter = _Counting(monkeypatch)
    bad = [
        (lambda: backend.sample([[8, 9], [vocab + 5]]), InvalidInput),
        (lambda: backend.sync_weights(version=0), InvalidInput),
        (lambda: backend.load_state("nope"), StateError),
    ]
    for call, error in bad:
        with pytest.raises(error):
            call()
    assert counter.calls == [] and backend._mode.mode == "train"
    monkeypatch.undo()
    assert backend.info().capabilities["zones_memory"] == memory
    assert (backend.policy.step, backend.sampler.version) == before[:2]


def test_resources_that_can_never_fit_are_refused_at_once_naming_the_keys(ray_cluster, make_backend) -> None:
    began = time.monotonic()
    placement = {**RAY_PLACEMENT, "policy": {"workers": 2, "cpus": 100}, "start_timeout_s": 120}
    with pytest.raises(InvalidInput) as e:
        make_backend(placement=placement)
    assert time.monotonic() - began < 10
    assert e.value.field == "placement"
    assert "policy.workers 2 × policy.cpus 100" in e.value.message and "the Ray cluster has CPU 8 in all" in e.value.message
    assert "worker" not in e.value.field


def test_a_connection_that_contradicts_the_config_is_refused(ray_cluster, make_backend) -> None:
    with pytest.raises(InvalidInput) as e:
        make_backend(placement={**RAY_PLACEMENT, "namespace": "elsewhere"})
    assert e.value.field == "placement.namespace" and "'floe-tests'" in e.value.message
    with pytest.raises(InvalidInput) as e:
        make_backend(placement={**RAY_PLACEMENT, "address": "ray://127.0.0.1:10001"})
    assert e.value.field == "placement.address" and "already connected" in e.value.message


def test_connecting_a_ray_client_is_bounded_by_start_timeout_s() -> None:
    # A fresh process (this one is connected already): nothing listens on port 1.
    code = ("import time; from floe.config import RayPlacement; from floe.errors import InvalidInput\n"
            "from floe.placement.ray import cluster\n"
            "t = time.monotonic()\n"
            "try:\n"
            "    cluster.connect(RayPlacement(address='ray://127.0.0.1:1', start_timeout_s=3))\n"
            "except InvalidInput as e:\n"
            "    print('FIELD', e.field, round(time.monotonic() - t, 1))\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    line = [x for x in done.stdout.splitlines() if x.startswith("FIELD")]
    assert line, done.stdout[-2000:] + done.stderr[-2000:]
    _, field, seconds = line[0].split()
    assert field == "placement.address" and float(seconds) < 6.0  # Ray's own client retries take ~30 s


def test_a_hung_worker_over_http_is_worker_failed_and_the_failed_backend_is_released(
    ray_cluster, make_backend
) -> None:
    from tests.protocol.surface import serve_in_thread

    backend = make_backend(placement={**RAY_PLACEMENT, "call_timeout_s": 5})
    pids = [ray_cluster.get(a.pid.remote(), timeout=60) for a in [*backend.policy.ranks, *backend.sampler.replicas]]
    victim = pids[-1]  # sampler replica 1
    with serve_in_thread(backend) as url:
        client = floe.connect(url)  # the default client timeout, above the server's call bound
        prompts = [[8, 9, 10], [11, 12], [13, 14], [15, 16]]
        client.sample(prompts, 1, SamplingParams(max_tokens=3, seed=1))
        with _stopped(victim):
            began = time.monotonic()
            with pytest.raises(WorkerFailed) as failed:
                client.sample(prompts, 1, SamplingParams(max_tokens=3, seed=2))
            assert time.monotonic() - began < 5 + 10
        assert failed.value.zone == "sampler" and "sampler 1" in str(failed.value)
        # Every later request is refused at once, naming the first failure.
        began = time.monotonic()
        with pytest.raises(WorkerFailed, match="this backend failed earlier .*close it and start a fresh one"):
            client.info()
        with pytest.raises(WorkerFailed):
            client.forward_backward([_group([8])], "ppo")
        assert time.monotonic() - began < 3
        client.close()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "the failed backend's workers were not released"


def test_a_dead_reference_fails_the_backend_in_one_short_line(ray_cluster, make_backend) -> None:
    backend = make_backend(placement=RAY_PLACEMENT)
    actor = backend.reference.actor
    ray_cluster.kill(actor)
    with pytest.raises(WorkerFailed) as failed:
        backend.forward([_group([8, 9])], zone="reference")
    message = str(failed.value)
    assert (failed.value.zone, failed.value.rank) == ("reference", 0)
    assert "died" in message and "\n" not in message and len(message) < 400, message
    assert "Some common causes" not in message
    began = time.monotonic()
    with pytest.raises(WorkerFailed, match="this backend failed earlier"):
        backend.forward([_group([8, 9])])  # the policy is fine, but the backend is failed
    with pytest.raises(WorkerFailed):
        backend.sample([[8, 9]])
    assert time.monotonic() - began < 2


def test_a_sampler_that_hangs_during_a_sync_is_the_worker_named(ray_cluster, make_backend) -> None:
    # The review's case: policy rank 0 is blocked in the broadcast to the stopped replica, so the
    # first pending call is a healthy peer; the ping round must name the replica.
    backend = make_backend(placement={**RAY_PLACEMENT, "call_timeout_s": 5})
    victim = ray_cluster.get(backend.sampler.replicas[0].pid.remote(), timeout=60)
    with _stopped(victim):
        began = time.monotonic()
        with pytest.raises(WorkerFailed) as failed:
            backend.sync_weights()
        elapsed = time.monotonic() - began
    assert (failed.value.zone, failed.value.rank) == ("sampler", 0), str(failed.value)
    assert "not answering (hung or lost): sampler 0" in str(failed.value)
    assert elapsed < 5 + 10
