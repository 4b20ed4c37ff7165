"""What happens when things go wrong inside an operation: nothing half-done survives."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import floe
from floe.atomic import owner_tag
from floe.models import make_tiny
from tests.conftest import assert_same_state, backend_of, state_snapshot


def _batch(tok, advantage: float = 1.0) -> floe.Batch:
    return floe.Batch([floe.Group(tok.encode("abc"), [
        floe.Sample(tok.encode("xy"), logprobs=[-1.0, -2.0], advantage=advantage),
        floe.Sample(tok.encode("zzz"), logprobs=[-1.0, -1.0, -3.0], advantage=-advantage),
    ])])


def test_overflowing_gradients_are_discarded_and_nothing_is_applied(make_client):
    client = make_client()
    tok = client.tokenizer()
    client.forward_backward(_batch(tok, advantage=1e20), "importance_sampling", {"aggregation": "sum"})
    before = state_snapshot(client)
    with pytest.raises(floe.StateError, match="discarded"):
        client.optim_step()
    after = state_snapshot(client)
    # Weights, optimizer state, step and version are untouched; the unusable sum is gone.
    assert after["pending"] == 0 and all(g is None for g in after["grads"])
    before.update(pending=0, grads=after["grads"])
    assert_same_state(before, after)
    with pytest.raises(floe.StateError, match="nothing to apply"):
        client.optim_step()


def test_a_forward_backward_failing_midway_leaves_no_partial_gradients(make_client):
    client = make_client(compute={"max_tokens_per_microbatch": 6, "prefix_dedup": "off"})
    tok = client.tokenizer()
    model = backend_of(client).policy.model
    calls = []

    def fail_on_second_microbatch(module, args, kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated out-of-memory")

    handle = model.get_decoder().register_forward_pre_hook(fail_on_second_microbatch, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="simulated"):
            client.forward_backward(_batch(tok), "ppo")
    finally:
        handle.remove()
    assert len(calls) == 2  # the first micro-batch did run its backward
    snap = state_snapshot(client)
    assert snap["pending"] == 0 and all(g is None for g in snap["grads"])


def test_gradient_checkpointing_never_reenables_attention_dropout(tmp_path, make_client):
    path = make_tiny(tmp_path / "dropout", hidden_size=32, num_hidden_layers=2)
    config = json.loads((path / "config.json").read_text())
    config["attention_dropout"] = 0.5
    (path / "config.json").write_text(json.dumps(config))
    client = make_client(model=str(path), compute={"gradient_checkpointing": True})
    tok = client.tokenizer()
    batch = _batch(tok)
    trained = client.forward_backward(batch, "ppo").logprobs
    scored = client.forward(batch).logprobs
    diff = max(abs(a - b) for g1, g2 in zip(trained, scored) for s1, s2 in zip(g1, g2) for a, b in zip(s1, s2))
    assert diff < 1e-5


def test_export_never_replaces_a_foreign_directory(make_client, tmp_path):
    client = make_client()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("keep me")
    with pytest.raises(floe.InvalidInput) as e:
        client.export_hf(str(victim))
    assert e.value.field == "path" and (victim / "notes.txt").read_text() == "keep me"
    out = tmp_path / "export"
    client.export_hf(str(out))
    client.export_hf(str(out))  # an earlier floe export may be replaced
    assert (out / "floe_export.json").is_file() and oct(out.stat().st_mode & 0o777) == "0o755"


def test_a_save_interrupted_between_its_two_renames_is_recovered(make_client, tmp_path):
    client = make_client()
    client.save_state("ckpt")
    states = tmp_path / "states"
    # A crash after moving the old version aside and before moving the new one in (the writer,
    # a process that has exited, left its temp directory too):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    tag = f"{gone.pid}@{owner_tag().split('@')[1]}"
    os.replace(states / "ckpt", states / f".ckpt.old-{tag}")
    (states / f".ckpt.tmp-{tag}-abc123").mkdir()
    assert client.list_states() == ["ckpt"]
    assert client.load_state("ckpt").step == 0
    client.save_state("ckpt")
    assert sorted(p.name for p in states.iterdir()) == ["ckpt"]


def test_sync_refuses_non_finite_weights_and_leaves_the_sampler_alone(make_client):
    client = make_client()
    backend = backend_of(client)
    sampler_before = {k: v.clone() for k, v in backend.sampler.model.state_dict().items()}
    with torch.no_grad():
        next(backend.policy.model.parameters())[0, 0] = float("nan")
    with pytest.raises(floe.StateError, match="not finite"):
        client.sync_weights()
    after = backend.sampler.model.state_dict()
    assert all(torch.equal(sampler_before[k], after[k]) for k in after)
    assert client.info().sampler_version == 0
