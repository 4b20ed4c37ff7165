"""Shared fixtures: a tiny model built once per session and fresh embedded clients."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import floe
from floe.models import make_tiny


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("models") / "tiny", hidden_size=64, num_hidden_layers=2)


@pytest.fixture
def make_client(tiny_model: Path, tmp_path: Path):
    """Factory: an embedded client on the tiny model; keyword args override config fields."""
    clients = []

    def build(**overrides) -> floe.Client:
        cfg = {"model": str(tiny_model), "state_dir": str(tmp_path / "states"), **overrides}
        client = floe.connect(floe.BackendConfig(**cfg))
        clients.append(client)
        return client

    yield build
    for c in clients:
        c.close()


MEASURED = ("seconds", "tokens_per_second", "mfu")  # throughput metrics that vary with time (floe.types)


def counted(metrics: dict[str, float]) -> dict[str, float]:
    """A result's metrics without those measured in time: what two identical calls must agree on."""
    return {k: v for k, v in metrics.items() if k not in MEASURED}


def backend_of(client: floe.Client):
    """The live Backend behind an in-process client (tests inspect real state through it)."""
    return client.transport.backend


def state_snapshot(client: floe.Client) -> dict:
    """Everything a rejected request must leave unchanged."""
    b = backend_of(client)
    opt = b.policy.optimizer.state_dict()
    return {
        "weights": {k: v.detach().clone() for k, v in b.policy.model.state_dict().items()},
        "sampler": {k: v.detach().clone() for k, v in b.sampler.model.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in b.policy.trained],
        "opt_state": {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for i, s in opt["state"].items()},
        "step": b.policy.step,
        "pending": b.policy.pending_calls,
        "version": b.sampler.version,
    }


def assert_same_state(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] and a["pending"] == b["pending"] and a["version"] == b["version"]
    for key in ("weights", "sampler"):
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), f"{key}.{name} changed"
    assert len(a["grads"]) == len(b["grads"])
    for ga, gb in zip(a["grads"], b["grads"]):
        assert (ga is None and gb is None) or torch.equal(ga, gb)
    assert a["opt_state"].keys() == b["opt_state"].keys()
    for i in a["opt_state"]:
        for k, v in a["opt_state"][i].items():
            w = b["opt_state"][i][k]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w
