"""Saved states after crashes and damage (issue 23, items 3 and 4).

* A save killed between the two renames of an overwrite (`floe.atomic.atomic_directory`: old
  version aside, new one in) leaves the state's old version aside under a dot-name; every path
  that looks for states (`Backend.list_states`, `floe eval --checkpoint latest`,
  `floe serve --resume-latest`) finds it again, through the one listing function
  `floe.backend.state.list_states`.
* Temporary directories of killed saves are removed once their writer is dead; a live
  writer's (another process saving the same name) are never touched.
* A damaged state (a truncated or garbage file, bad state.json, a file missing) is a
  StateError naming the state, the file and what is wrong, before anything changes;
  `--resume-latest` skips it, says so, and takes the newest intact state.

The killed writers are real processes running floe.atomic, killed (SIGKILL) at the exact point
the issue names: their `os.replace` is wrapped to kill the process on the given call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import floe
from floe.backend.state import list_states, newest_intact_state
from floe.cli import local_states, pick_checkpoint
from floe.server.cli import latest_state
from tests.conftest import assert_same_state, backend_of, state_snapshot
from tests.killed_writer import WRITER


def _writer(final: Path, source: Path, kill_at: int, go: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(final), str(source), str(kill_at), str(go)],
                            stdout=subprocess.PIPE, text=True)


def _train_step(client: floe.Client) -> None:
    tok = client.tokenizer()
    batch = [floe.Group(tok.encode("ab"), [floe.Sample(tok.encode("cd"))])]
    client.forward_backward(batch, "cross_entropy")
    client.optim_step()


def _two_states(client: floe.Client, states: Path) -> None:
    """"a" at step 1, then "b" at step 2 (saved later: the newest)."""
    _train_step(client)
    client.save_state("a")
    time.sleep(0.01)  # distinct state.json times
    _train_step(client)
    client.save_state("b")


def test_an_overwrite_killed_between_the_renames_is_found_by_every_listing(make_client, tmp_path):
    client = make_client()
    states = tmp_path / "states"
    _two_states(client, states)
    scratch = tmp_path / "copy-of-b"
    scratch.mkdir()
    for f in (states / "b").iterdir():
        (scratch / f.name).write_bytes(f.read_bytes())
    writer = _writer(states / "b", scratch, 2, tmp_path / "never")
    assert writer.wait(60) == -9  # SIGKILLed between "old aside" and "new in"
    left = sorted(p.name for p in states.iterdir())
    assert "b" not in left and any(n.startswith(".b.old-") for n in left) and any(n.startswith(".b.tmp-") for n in left)

    # Every path that looks for states sees "b" again (its old version, step 2).
    assert latest_state(states) == "b"  # floe serve --resume-latest
    assert local_states(states) == ["a", "b"]  # floe eval --checkpoint
    assert pick_checkpoint("latest", local_states(states), tmp_path / "no-run") == "b"
    assert client.list_states() == ["a", "b"]
    assert client.load_state("b").step == 2
    # The killed writer's temporary directory went with the recovery (its pid is dead).
    assert sorted(p.name for p in states.iterdir()) == ["a", "b"]


def test_a_killed_save_leaves_no_temp_directory_behind(make_client, tmp_path):
    """A save killed before its first rename (temp directory written, nothing swapped): the
    temp directory is removed by the next listing, whatever name the next save has."""
    client = make_client()
    states = tmp_path / "states"
    _two_states(client, states)
    writer = _writer(states / "c", states / "a", 1, tmp_path / "never")
    assert writer.wait(60) == -9
    assert any(p.name.startswith(".c.tmp-") for p in states.iterdir())
    assert list_states(states) == ["a", "b"]
    assert sorted(p.name for p in states.iterdir()) == ["a", "b"]


def test_a_live_writers_temp_directory_is_not_deleted(make_client, tmp_path):
    """Another process saving the same name at the same time: this save neither deletes its
    temp directory nor breaks it; the later swap wins, both complete."""
    client = make_client()
    states = tmp_path / "states"
    _two_states(client, states)
    go = tmp_path / "go"
    writer = _writer(states / "b", states / "a", 0, go)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "inside"  # its temp dir is written
        client.save_state("b")  # meanwhile, in this process
        assert list_states(states) == ["a", "b"]
        assert any(p.name.startswith(".b.tmp-") for p in states.iterdir())  # the live writer's, kept
    finally:
        go.touch()  # the writer finishes (or, after a failure above, does not wait forever)
    out, _ = writer.communicate(timeout=60)
    assert writer.returncode == 0 and "done" in out
    assert (states / "b" / "writer.txt").read_text() == str(writer.pid)  # its swap came last
    assert sorted(p.name for p in states.iterdir()) == ["a", "b"]


DAMAGE = {
    "truncated policy weights": ("policy.safetensors", lambda b: b[: len(b) // 2], "policy.safetensors"),
    "garbage sampler generator": ("rng.safetensors", lambda b: os.urandom(len(b)), "rng.safetensors"),
    "empty optimizer file": ("optimizer.safetensors", lambda b: b"", "optimizer.safetensors"),
    "state.json not JSON": ("state.json", lambda b: b[:-5], "state.json"),
    "policy file missing": ("policy.safetensors", None, "policy.safetensors"),
    "a byte added": ("optimizer.safetensors", lambda b: b + b"\0", "optimizer.safetensors"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_state_is_a_state_error_naming_it_and_changes_nothing(make_client, tmp_path, kind):
    client = make_client()
    states = tmp_path / "states"
    _two_states(client, states)
    file, damage, named = DAMAGE[kind]
    path = states / "b" / file
    if damage is None:
        path.unlink()
    else:
        path.write_bytes(damage(path.read_bytes()))
    before = state_snapshot(client)
    with pytest.raises(floe.StateError) as e:
        client.load_state("b")
    message = str(e.value)
    assert "'b'" in message and named in message and "damaged" in message, message
    assert "delete_state" in message  # what to do about it
    assert_same_state(before, state_snapshot(client))
    # --resume-latest takes the newest intact state and says which it skipped, and why.
    name, skipped = newest_intact_state(states)
    assert name == "a" and [s[0] for s in skipped] == ["b"] and named in skipped[0][1]
    assert latest_state(states) == "a"
    assert client.load_state("a").step == 1
    assert backend_of(client).policy.step == 1


def test_state_json_records_every_file_and_its_size(make_client, tmp_path):
    client = make_client()
    client.save_state("s")
    directory = tmp_path / "states" / "s"
    meta = json.loads((directory / "state.json").read_text())
    assert meta["files"] == {p.name: p.stat().st_size for p in directory.iterdir() if p.name != "state.json"}


def test_a_state_whose_sampler_version_is_beyond_int64_is_refused_and_changes_nothing(make_client, tmp_path):
    """A state.json edited to a version no wire can carry (2**63) would break every sample reply."""
    client = make_client()
    client.save_state("v")
    path = tmp_path / "states" / "v" / "state.json"
    meta = json.loads(path.read_text())
    meta["sampler_version"] = 2**63
    path.write_text(json.dumps(meta))
    before = state_snapshot(client)
    with pytest.raises(floe.StateError) as e:
        client.load_state("v")
    assert "2**63 - 1" in str(e.value), str(e.value)
    assert_same_state(before, state_snapshot(client))
