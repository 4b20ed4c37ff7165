"""delete_state: removes a saved state (atomically enough), reports what it held, refuses
unknown or bad names without changing anything."""

from __future__ import annotations

import os

import pytest

import floe
from tests.conftest import assert_same_state, backend_of, state_snapshot


def test_delete_state_removes_it_and_reports_it(make_client, tmp_path):
    client = make_client()
    backend = backend_of(client)
    tok = client.tokenizer()
    client.forward_backward(floe.Batch([floe.Group(tok.encode("q"), [floe.Sample(tok.encode("ab"))])]), "cross_entropy")
    client.optim_step()
    client.sync_weights()
    client.save_state("keep")
    saved = client.save_state("old")
    assert client.list_states() == ["keep", "old"]
    before = state_snapshot(client)
    deleted = backend.delete_state("old")
    assert isinstance(deleted, floe.StateResult)
    assert (deleted.name, deleted.path, deleted.step, deleted.version) == ("old", saved.path, 1, 1)
    assert client.list_states() == ["keep"]
    assert sorted(p.name for p in (tmp_path / "states").iterdir()) == ["keep"]  # nothing left aside
    assert_same_state(before, state_snapshot(client))  # the live zones are not touched
    with pytest.raises(floe.StateError, match="no saved state"):
        client.load_state("old")
    assert client.load_state("keep").step == 1


def test_delete_state_refuses_missing_and_bad_names(make_client, tmp_path):
    client = make_client()
    backend = backend_of(client)
    client.save_state("s")
    with pytest.raises(floe.StateError, match="no saved state named 'nope'"):
        backend.delete_state("nope")
    for bad in ("", "../s", ".s", "a/b", 3):
        with pytest.raises(floe.InvalidInput) as e:
            backend.delete_state(bad)
        assert e.value.field == "name"
    assert client.list_states() == ["s"]


def test_delete_finds_a_state_whose_save_was_interrupted(make_client, tmp_path):
    """A crash between the two renames of a save leaves the old version aside; delete
    recovers it first and removes it (it does not come back later)."""
    client = make_client()
    backend = backend_of(client)
    client.save_state("ckpt")
    states = tmp_path / "states"
    os.replace(states / "ckpt", states / f".ckpt.old-{os.getpid()}")
    assert backend.delete_state("ckpt").name == "ckpt"
    assert client.list_states() == [] and list(states.iterdir()) == []
