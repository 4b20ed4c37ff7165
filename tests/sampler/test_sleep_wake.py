"""Sleep / wake of the torch engine and the sampler zone, on CPU: the state machine, the
StateError while asleep, and samples unchanged by a sleep → wake round trip. (On CPU nothing
moves; the CUDA path is measured by benchmarks/bench_gpu.py when a GPU is lent.)"""

from __future__ import annotations

import pytest
import torch

import floe
from floe.backend.sampler import SamplerZone
from floe.config import TorchEngineConfig
from floe.errors import StateError
from floe.models import load_model, load_tokenizer
from floe.sampler import EngineSource, build_engine


@pytest.fixture
def zone(tiny_model) -> SamplerZone:
    source = EngineSource(load_model(str(tiny_model)), str(tiny_model), load_tokenizer(str(tiny_model)))
    return SamplerZone(build_engine(TorchEngineConfig(max_batch_sequences=8), source), "torch", 0)


def test_sleep_wake_state_machine_and_samples_unchanged(zone):
    params = floe.SamplingParams(max_tokens=10, seed=3, stop_at_eos=False)
    before = zone.sample([[10, 11], [12]], 2, params)
    weights = {k: v.clone() for k, v in zone.model.state_dict().items()}
    size = sum(t.numel() * t.element_size() for t in weights.values())
    assert not zone.asleep
    assert zone.memory() == {"device": "cpu", "weights_on": "cpu", "weights_bytes": size, "device_bytes": size,
                             "asleep": False}
    zone.sleep()
    zone.sleep()  # idempotent
    assert zone.asleep and zone.memory()["asleep"] is True
    with pytest.raises(StateError, match=r"asleep: call wake\(\) first"):
        zone.sample([[10, 11]], 1, params)
    # Weights may still arrive while asleep (a sync lands in host memory); fingerprints work.
    assert zone.receive(weights) == zone.engine.fingerprints()
    zone.set_version(zone.version)  # what the Backend does once it verified those fingerprints
    zone.wake()
    zone.wake()
    assert not zone.asleep
    after = zone.sample([[10, 11], [12]], 2, params)
    assert [[s.tokens for s in g.samples] for g in after.groups] == [[s.tokens for s in g.samples] for g in before.groups]
    assert [[s.logprobs for s in g.samples] for g in after.groups] == [[s.logprobs for s in g.samples] for g in before.groups]
    assert all(torch.equal(v, weights[k]) for k, v in zone.model.state_dict().items())
