"""A policy and a sampler engine of different precision, and what a failed sync leaves behind
(issue 23, item 2).

* fp32 policy + bf16 engine (and bf16 policy + fp32 engine, and an fp16 engine, which
  samples only: fp16 training is refused, FLOAT16_REFUSED): every sync casts the published
  tensors to the dtypes the engine holds, fingerprints the cast tensors and verifies them
  against what the engine holds; the sync succeeds, the engine holds exactly the policy's
  weights rounded to its dtype, and samples carry the new version. (Before: the first sync
  failed its fingerprint check after the engine had taken the new weights.)
* After ANY failed sync the sampler refuses to sample until a sync succeeds, so no sample is
  stamped with a version its weights are not. The failure here is a transfer whose report is
  wrong (a sync method that moves the weights and then reports a dropped tensor, as a broken
  transport would): a subclass of the real in-place copy, plugged in where a placement puts
  its method.

The torch engine's `dtype` key is the same as vLLM's (`sampler.engine.dtype`); the vLLM suite
runs an fp32 policy against a bf16 vLLM engine (tests/sampler/test_vllm_engine.py).
"""

from __future__ import annotations

import pytest
import torch

import floe
from floe.backend.sync import InPlaceCopy, SyncReport
from tests.conftest import backend_of


def _train(client: floe.Client) -> None:
    tok = client.tokenizer()
    batch = [floe.Group(tok.encode("ab"), [floe.Sample(tok.encode("cde"))]), floe.Group(tok.encode("x"), [floe.Sample(tok.encode("yz"))])]
    client.forward_backward(batch, "cross_entropy")
    client.optim_step()


PARAMS = floe.SamplingParams(max_tokens=4, seed=1)


@pytest.mark.parametrize(("policy_dtype", "engine_dtype"), [("float32", "bfloat16"), ("bfloat16", "float32"),
                                                          ("float32", "float16"), ("bfloat16", "float16")])
def test_a_policy_and_an_engine_of_different_precision_sync_and_sample(make_client, policy_dtype, engine_dtype):
    client = make_client(dtype=policy_dtype, optimizer={"lr": 1e-2},
                         sampler={"engine": {"name": "torch", "dtype": engine_dtype}})
    backend = backend_of(client)
    engine_model = backend.sampler.model
    assert {str(p.dtype) for p in engine_model.parameters()} == {f"torch.{engine_dtype}"}
    for version in (1, 2):
        _train(client)
        result = client.sync_weights()
        assert result.version == version
        held = engine_model.state_dict()
        for name, value in backend.policy.model.state_dict().items():
            want = value.to(getattr(torch, engine_dtype))
            assert torch.equal(held[name], want), f"{name}: the engine holds the policy's weights rounded to {engine_dtype}"
        assert result.bytes == sum(t.numel() * t.element_size() for t in held.values())  # what moved: the cast copy
        out = client.sample([[10, 11]], n=2, params=PARAMS)
        assert out.weights_version == version
        # the engine's log-probs are the policy's up to the engine's rounding (bf16: 8 bits of mantissa)
        tokens = [s.tokens for s in out.groups[0].samples]
        policy = client.forward([floe.Group([10, 11], [floe.Sample(t) for t in tokens])]).logprobs[0]
        bound = 0.03 if "bfloat16" in (policy_dtype, engine_dtype) else 0.005  # measured: 6e-3 and 5e-4 at most
        for got, want in zip([s.logprobs for s in out.groups[0].samples], policy):
            assert max(abs(a - b) for a, b in zip(got, want)) < bound
    assert client.info().sampler_version == 2


class DroppingCopy(InPlaceCopy):
    """The in-place copy whose report loses one tensor after the weights moved (a broken transport)."""

    name = "dropping"

    def sync(self, policy, sampler) -> SyncReport:
        report = super().sync(policy, sampler)
        received = dict(report.received)
        received.pop(next(iter(received)))
        return SyncReport(report.published, received, report.bytes)


def test_after_a_failed_sync_the_sampler_serves_nothing_until_a_sync_succeeds(make_client):
    client = make_client(optimizer={"lr": 1e-2})
    backend = backend_of(client)
    before = client.sample([[10, 11]], n=2, params=PARAMS)
    assert before.weights_version == 0
    _train(client)
    backend.weight_sync = DroppingCopy()
    with pytest.raises(floe.StateError, match="sampler holds different tensors"):
        client.sync_weights()
    assert client.info().sampler_version == 0
    # The engine took the new weights, the version did not move: nothing may be sampled now.
    with pytest.raises(floe.StateError, match="not those of its version 0.*run sync_weights again"):
        client.sample([[10, 11]], n=2, params=PARAMS)
    backend.weight_sync = InPlaceCopy()
    assert client.sync_weights().version == 1
    after = client.sample([[10, 11]], n=2, params=PARAMS)
    assert after.weights_version == 1


def test_a_sync_refused_before_anything_moved_leaves_the_sampler_serving(make_client):
    """Non-finite policy weights are refused before a byte moves: the sampler still holds the
    weights its version names and keeps sampling."""
    client = make_client()
    backend = backend_of(client)
    with torch.no_grad():
        next(backend.policy.model.parameters())[0, 0] = float("nan")
    with pytest.raises(floe.StateError, match="not finite"):
        client.sync_weights()
    assert client.sample([[10, 11]], n=1, params=PARAMS).weights_version == 0
