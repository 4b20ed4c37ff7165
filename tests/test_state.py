"""save_state / load_state: exact resume, atomic writes, and nothing changes on failure."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import floe
from floe.models import make_tiny
from tests.conftest import assert_same_state, backend_of, counted, state_snapshot


def _batch(tok, text: str) -> floe.Batch:
    return floe.Batch([floe.Group(tok.encode("q:"), [floe.Sample(tok.encode(text)), floe.Sample(tok.encode(text[::-1]))])])


def test_resume_is_exact(make_client, tmp_path):
    opt = {"lr": 3e-3, "schedule": "cosine", "warmup_steps": 2, "total_steps": 10}
    a = make_client(optimizer=opt)
    tok = a.tokenizer()
    for text in ("first", "second", "third"):
        a.forward_backward(_batch(tok, text), "cross_entropy")
        a.optim_step()
    a.sync_weights()
    saved = a.save_state("ckpt")
    assert saved.step == 3 and saved.version == 1
    # Continue the original.
    next_a = a.forward_backward(_batch(tok, "fourth"), "cross_entropy")
    step_a = a.optim_step()
    # A fresh client loads the state and does the same.
    b = make_client(optimizer=opt)
    loaded = b.load_state("ckpt")
    assert (loaded.step, loaded.version) == (3, 1)
    info = b.info()
    assert info.step == 3 and info.sampler_version == 1
    next_b = b.forward_backward(_batch(tok, "fourth"), "cross_entropy")
    step_b = b.optim_step()
    assert next_a.metrics["loss"] == next_b.metrics["loss"]
    assert (step_a.step, step_a.lr) == (step_b.step, step_b.lr)
    wa, wb = backend_of(a).policy.model.state_dict(), backend_of(b).policy.model.state_dict()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    # The sampler of the loaded client holds the restored policy weights.
    sa = a.sample([tok.encode("z")], n=2, params=floe.SamplingParams(max_tokens=5, seed=4))
    sb = b.sample([tok.encode("z")], n=2, params=floe.SamplingParams(max_tokens=5, seed=4))
    assert [s.tokens for s in sa.groups[0].samples] == [s.tokens for s in sb.groups[0].samples]


def test_state_directory_is_complete_and_overwrite_is_atomic(make_client, tmp_path):
    c = make_client()
    tok = c.tokenizer()
    c.save_state("s")
    c.forward_backward(_batch(tok, "abc"), "cross_entropy")
    c.optim_step()
    c.save_state("s")  # overwrite
    states = tmp_path / "states"
    assert sorted(p.name for p in states.iterdir()) == ["s"]  # no temp or old dirs left behind
    assert sorted(p.name for p in (states / "s").iterdir()) == [
        "optimizer.safetensors", "policy.safetensors", "policy_rng.safetensors", "rng.safetensors", "state.json",
    ]
    assert c.list_states() == ["s"]


def test_failed_load_and_bad_saves_change_nothing(make_client, tmp_path):
    c = make_client()
    tok = c.tokenizer()
    c.forward_backward(_batch(tok, "abc"), "cross_entropy")
    before = state_snapshot(c)
    with pytest.raises(floe.StateError, match="optim_step first"):
        c.save_state("pending")
    with pytest.raises(floe.StateError, match="no saved state"):
        c.load_state("missing")
    for bad in ("../escape", ".hidden", "", "a/b"):
        with pytest.raises(floe.InvalidInput) as e:
            c.save_state(bad)
        assert e.value.field == "name"
    assert_same_state(before, state_snapshot(c))
    assert not (tmp_path / "escape").exists()


def test_load_rejects_a_different_model(make_client, tmp_path):
    other = make_tiny(tmp_path / "other", hidden_size=32, num_hidden_layers=1)
    big = make_client(model=str(other))
    big.save_state("other")
    c = make_client()
    before = state_snapshot(c)
    with pytest.raises(floe.StateError, match="do not match|shape"):
        c.load_state("other")
    assert_same_state(before, state_snapshot(c))


def test_export_hf_loads_back(make_client, tmp_path):
    c = make_client(optimizer={"lr": 1e-2})
    tok = c.tokenizer()
    c.forward_backward(_batch(tok, "abc"), "cross_entropy")
    c.optim_step()
    path = c.export_hf(str(tmp_path / "export"))
    d = make_client(model=path)
    batch = _batch(tok, "hello")
    assert c.forward(batch).logprobs == d.forward(batch).logprobs


def test_export_marker_is_json_whatever_the_model_path(make_client, tmp_path):
    odd = make_tiny(tmp_path / 'we"ird\\name', hidden_size=32, num_hidden_layers=1)
    c = make_client(model=str(odd))
    out = c.export_hf(str(tmp_path / "export"))
    marker = json.loads((tmp_path / "export" / "floe_export.json").read_text())
    assert marker == {"step": 0, "model": str(odd)} and out == str(tmp_path / "export")


def test_format_1_states_still_load(make_client, tmp_path):
    """A state in the old layout (format 1: the policy's RNG next to the sampler's in
    rng.safetensors, no policy_layout) loads and resumes exactly."""
    a = make_client(optimizer={"lr": 1e-2})
    tok = a.tokenizer()
    a.forward_backward(_batch(tok, "abc"), "cross_entropy")
    a.optim_step()
    a.sync_weights()
    a.save_state("old")
    d = tmp_path / "states" / "old"
    rng = {**load_file(str(d / "rng.safetensors")), **load_file(str(d / "policy_rng.safetensors"))}
    save_file(rng, str(d / "rng.safetensors"))
    (d / "policy_rng.safetensors").unlink()
    meta = json.loads((d / "state.json").read_text())
    del meta["policy_layout"], meta["files"]  # format 1 had neither
    (d / "state.json").write_text(json.dumps({**meta, "format": 1}))
    assert sorted(p.name for p in d.iterdir()) == [
        "optimizer.safetensors", "policy.safetensors", "rng.safetensors", "state.json",
    ]
    next_a = a.forward_backward(_batch(tok, "next"), "cross_entropy")
    step_a = a.optim_step()
    b = make_client(optimizer={"lr": 1e-2})
    assert (b.load_state("old").step, b.info().sampler_version) == (1, 1)
    assert counted(b.forward_backward(_batch(tok, "next"), "cross_entropy").metrics) == counted(next_a.metrics)
    assert b.optim_step() == step_a
    wa, wb = backend_of(a).policy.model.state_dict(), backend_of(b).policy.model.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
