"""Weight sync: published vs received fingerprints, and a version that moves only on success."""

from __future__ import annotations

import pytest
import torch

import floe
from floe.backend.sync import InPlaceCopy, SyncReport, WeightsSnapshot, WeightSync, fingerprints, verify
from floe.backend.zones import PolicyWorker, ReferenceWorker, SamplerWorker
from tests.conftest import backend_of


def test_zones_implement_their_protocols(make_client):
    backend = backend_of(make_client())
    assert isinstance(backend.policy, PolicyWorker)
    assert isinstance(backend.sampler, SamplerWorker)
    assert isinstance(backend.reference, ReferenceWorker)
    assert isinstance(backend.weight_sync, InPlaceCopy)


def test_publish_is_plain_tensors_with_matching_fingerprints(make_client):
    backend = backend_of(make_client())
    snap = backend.policy.publish()
    assert isinstance(snap, WeightsSnapshot) and snap.step == 0
    assert all(isinstance(t, torch.Tensor) for t in snap.tensors.values())
    assert snap.fingerprints == fingerprints(backend.policy.model.state_dict())
    assert snap.bytes == sum(t.numel() * t.element_size() for t in backend.policy.model.state_dict().values())


def test_sync_moves_the_weights_and_reports_them(make_client):
    client = make_client(optimizer={"lr": 1e-2})
    backend = backend_of(client)
    tok = client.tokenizer()
    client.forward_backward(floe.Batch([floe.Group(tok.encode("q"), [floe.Sample(tok.encode("ab"))])]), "cross_entropy")
    client.optim_step()
    assert backend.sampler.engine.fingerprints() != backend.policy.publish().fingerprints
    result = client.sync_weights()
    assert (result.version, result.bytes) == (1, backend.policy.publish().bytes) and result.seconds > 0
    assert backend.sampler.engine.fingerprints() == backend.policy.publish().fingerprints
    assert client.sync_weights().version == 2


class _LossyCopy(WeightSync):
    """A transfer method that damages one tensor on the way (what verification is for)."""

    name = "lossy"

    def sync(self, policy, sampler):
        snapshot = policy.publish()
        name = next(iter(snapshot.tensors))
        damaged = dict(snapshot.tensors)
        damaged[name] = snapshot.tensors[name] + 1.0
        return SyncReport(snapshot.fingerprints, sampler.receive(damaged), snapshot.bytes)


def test_a_transfer_that_does_not_verify_raises_and_keeps_the_version(make_client):
    client = make_client()
    backend = backend_of(client)
    backend.weight_sync = _LossyCopy()
    with pytest.raises(floe.StateError, match="fingerprints differ"):
        client.sync_weights()
    assert client.info().sampler_version == 0


def test_verify_names_what_differs():
    a = {"w": (1.0, 2.0), "b": (0.0, 0.0)}
    verify(a, dict(a))
    with pytest.raises(floe.StateError, match=r"\['w'\]"):
        verify(a, {**a, "w": (1.0, 2.5)})
    with pytest.raises(floe.StateError, match="different tensors"):
        verify(a, {"w": (1.0, 2.0)})


def test_sampler_refuses_weights_of_another_shape_before_changing_anything(make_client):
    backend = backend_of(make_client())
    tensors = dict(backend.policy.publish().tensors)
    name = next(iter(tensors))
    before = backend.sampler.engine.fingerprints()
    with pytest.raises(floe.StateError, match="shape"):
        backend.sampler.receive({**tensors, name: tensors[name][:1]})
    with pytest.raises(floe.StateError, match="differ in tensors"):
        backend.sampler.receive({k: v for k, v in tensors.items() if k != name})
    assert backend.sampler.engine.fingerprints() == before
