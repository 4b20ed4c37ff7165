"""The Ray placement with vLLM sampler replicas (marker `vllm`; scripts/ci/vllm.sh).

vLLM's in-process engine initialises torch.distributed's default process group in its own
process (a world of one; asserted below), so a replica actor must join floe's weight-sync group without one
(`floe.backend.sync.groups.standalone_group`). One policy rank and two vLLM replicas run
sample → forward_backward → optim_step → sync_weights → sample beside a local backend with
the same config (one vLLM engine in this process), and:
* before and after the sync, the Ray backend's seeded samples equal the local backend's
  (tokens exactly: per-prompt seeds make the split over two replicas invisible, as
  tests/sampler's conformance asserts for vLLM; log-probs within 1e-5);
* the sync (broadcast over the standalone gloo group, verified by fingerprints of what each
  replica's vLLM holds) moves the version to 1, and every new sample carries it;
* the new samples' log-probs equal the Ray policy's forward(temperature) within 1e-4 (fp32,
  tests/sampler's tolerance), and the old samples' no longer do (the weights moved);
* the policy weights of both backends agree within 1e-5 after the step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import floe
from floe.grpo import batch_from_samples
from tests.ray.steps import reward
from tests.sampler.conftest import VLLM_ENGINE

pytestmark = pytest.mark.vllm

PLACEMENT = {
    "kind": "ray",
    "policy": {"workers": 1, "cpus": 1},
    "sampler": {"workers": 2, "cpus": 1},
    "call_timeout_s": 300,
    "start_timeout_s": 600,
}
PROMPTS = [[8 + (3 * i + j) % 40 for j in range(3 + i % 4)] for i in range(5)]
PARAMS = floe.SamplingParams(max_tokens=8, temperature=1.0, seed=11, stop_at_eos=False)
PPO = {"clip_low": 0.2, "clip_high": 0.28}


def _config(model: Path, state_dir: Path, **overrides: Any) -> floe.BackendConfig:
    return floe.BackendConfig(model=str(model), state_dir=str(state_dir), num_threads=1, optimizer={"lr": 1e-2},
                              reference={"enabled": False}, sampler={"engine": VLLM_ENGINE}, **overrides)


def _tokens(out: floe.SampleResult) -> list[list[list[int]]]:
    return [[list(s.tokens) for s in g.samples] for g in out.groups]


def _logprobs(out: floe.SampleResult) -> list[float]:
    return [lp for g in out.groups for s in g.samples for lp in s.logprobs]


def _policy_gap(backend: Any, out: floe.SampleResult) -> float:
    """Largest |sampled log-prob - the policy's forward log-prob| over every sampled token."""
    batch = floe.Batch([floe.Group(g.prompt, [floe.Sample(s.tokens) for s in g.samples]) for g in out.groups])
    fwd = backend.forward(batch, temperature=PARAMS.temperature)
    diffs = [abs(a - b) for g, fg in zip(out.groups, fwd.logprobs, strict=True)
             for s, fs in zip(g.samples, fg, strict=True) for a, b in zip(s.logprobs, fs, strict=True)]
    assert len(diffs) == out.num_tokens > 0
    return max(diffs)


def _default_group(_host: Any) -> int:
    """In a sampler actor: the world size of its process's default group (0: none)."""
    import torch.distributed as dist  # noqa: PLC0415

    return dist.get_world_size() if dist.is_initialized() else 0


def _weights(backend: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu() for k, v in backend.policy.publish().tensors.items()}


def test_ray_placement_with_vllm_replicas_trains_syncs_and_samples_like_local(
    ray_cluster: Any, engine_model: Path, tmp_path: Path
) -> None:
    from floe.backend import Backend  # noqa: PLC0415

    local = Backend(_config(engine_model, tmp_path / "local"))
    remote = Backend(_config(engine_model, tmp_path / "ray", placement=PLACEMENT))
    try:
        placement = remote.info().capabilities["placement"]
        assert (placement["kind"], placement["policy_ranks"], placement["sampler_replicas"]) == ("ray", 1, 2)
        # The case this test is about: in each replica's process vLLM owns the default group.
        worlds = ray_cluster.get([actor.__ray_call__.remote(_default_group) for actor in remote.sampler.replicas])
        assert worlds == [1, 1]

        before, before_local = remote.sample(PROMPTS, 4, PARAMS), local.sample(PROMPTS, 4, PARAMS)
        assert before.weights_version == before_local.weights_version == 0
        assert _tokens(before) == _tokens(before_local)
        assert max(abs(a - b) for a, b in zip(_logprobs(before), _logprobs(before_local), strict=True)) <= 1e-5
        assert _policy_gap(remote, before) < 1e-4  # replicas start from the policy's weights

        batch = batch_from_samples(before, [[reward(s.tokens) for s in g.samples] for g in before.groups])
        assert batch.groups  # some group has rewards that differ, so the step moves the weights
        results = []
        for backend in (remote, local):
            fb = backend.forward_backward(batch, "ppo", PPO)
            step = backend.optim_step()
            sync = backend.sync_weights()
            results.append((fb.metrics["loss"], step.grad_norm, sync.version, sync.bytes))
        (loss, norm, version, size), (loss_l, norm_l, version_l, size_l) = results
        assert (version, version_l) == (1, 1) and size == size_l > 0
        assert loss == pytest.approx(loss_l, abs=1e-5) and norm == pytest.approx(norm_l, abs=1e-5)
        trained, trained_local = _weights(remote), _weights(local)
        assert trained.keys() == trained_local.keys()
        for name, value in trained_local.items():
            assert (value - trained[name]).abs().max().item() <= 1e-5, name

        after, after_local = remote.sample(PROMPTS, 4, PARAMS), local.sample(PROMPTS, 4, PARAMS)
        assert after.weights_version == 1
        assert {s.weights_version for g in after.groups for s in g.samples} == {1}
        assert _tokens(after) == _tokens(after_local)
        assert max(abs(a - b) for a, b in zip(_logprobs(after), _logprobs(after_local), strict=True)) <= 1e-5
        assert _policy_gap(remote, after) < 1e-4  # the replicas hold the trained weights
        assert _policy_gap(remote, before) > 1e-3  # ... which differ from those the old samples came from
    finally:
        remote.close()
        local.close()
