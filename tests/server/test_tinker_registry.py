"""The Tinker registry stays bounded and honest, against a real `floe serve` (raw HTTP, the SDK's
bodies; real SQLite): regression tests of a prober's faults. Client metadata has a size bound
(422 naming the field, nothing stored); finished sessions and runs that can never train again
leave the registry; `tinker_max_runs` counts open runs, so closing sessions frees it; listing
query parameters are checked as ASCII integers in range; a signed download link serves only
the checkpoint it was made for, while the registry still holds it; a reused seq_id is a 400
(the SDK retries a 409)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.server.test_security import KEY_A, KEYS, Tinker

# A server per test (about a minute in all): run by scripts/ci/tinker.sh, not the core suite.
pytestmark = pytest.mark.tinker

BIG = "v" * 20_000  # over the 16 KiB a metadata record may hold


def _sessions(alice: Tinker) -> list[str]:
    return alice.http.get("/sessions", params={"limit": 1000}).json()["sessions"]


def _runs(alice: Tinker) -> list[str]:
    return [r["training_run_id"] for r in alice.http.get("/training_runs", params={"limit": 1000}).json()["training_runs"]]


def test_metadata_is_bounded_and_finished_sessions_and_unused_runs_are_freed(start_server, server_model: Path,
                                                                            tmp_path: Path) -> None:
    server = start_server(server_toml=KEYS)
    alice = Tinker(server.url, KEY_A)
    for body, field in (({"tags": ["t" * 5000]}, "tags[0]"), ({"tags": ["t" * 255] * 64}, "tags"),
                        ({"user_metadata": {"k": BIG}}, "user_metadata"),
                        ({"user_metadata": {"k" * 5000: "v"}}, "user_metadata.")):
        out = alice.post("/create_session", {**body, "sdk_version": "0.38.0"})
        assert out.status_code == 422 and out.json()["field"].startswith(field), (field, out.text)
        assert len(out.text) < 2000  # the refusal does not echo the value
    assert _sessions(alice) == []  # refused before anything was stored
    session = alice.post("/create_session", {"tags": ["a"], "user_metadata": {"k": "v" * 10_000}}).json()["session_id"]
    big_run = alice.post("/create_model", {"session_id": session, "model_seq_id": 0, "base_model": str(server_model),
                                           "lora_config": {"rank": 2}, "user_metadata": {"k": BIG}})
    assert big_run.status_code == 422 and big_run.json()["field"] == "user_metadata"
    kept, unused = alice.run(server_model, session, 1), alice.run(server_model, session, 2)
    big_save = alice.post("/save_weights", {"model_id": kept, "path": "s", "seq_id": 1, "user_metadata": {"k": BIG}})
    assert big_save.status_code == 422 and big_save.json()["field"] == "user_metadata"
    assert "path" in alice.save(kept, "s", 2)
    assert sorted(_runs(alice)) == sorted([kept, unused])

    # Finished: its metadata goes at once, its id answers "finished" for one more timeout, then
    # it goes; the run without a checkpoint goes with it, the one with a checkpoint still lists.
    assert alice.post(f"/sessions/{session}/finish").status_code == 200
    assert alice.http.get(f"/sessions/{session}").json()["user_metadata"] == {}
    assert alice.post("/session_heartbeat", {"session_id": session}).status_code == 410
    assert _runs(alice) == [kept]
    assert alice.http.get(f"/training_runs/{kept}").status_code == 200
    assert alice.http.get(f"/training_runs/{kept}/checkpoints").json()["checkpoints"][0]["checkpoint_id"] == "weights/s"

    # After that one timeout (here 1 s; no model, so no request outlives it), the id goes too.
    server.stop()
    short = Tinker(start_server(server_toml=KEYS + "\ntinker_session_timeout_s = 1", state_dir=tmp_path / "short").url,
                   KEY_A)
    ended = [short.session() for _ in range(3)]
    for sid in ended:
        assert short.post(f"/sessions/{sid}/finish").status_code == 200
    deadline = time.monotonic() + 20
    while _sessions(short) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _sessions(short) == []
    assert short.post("/session_heartbeat", {"session_id": ended[0]}).status_code == 404


def test_the_run_limit_counts_open_runs_and_closing_a_session_frees_it(start_server, server_model: Path) -> None:
    server = start_server(server_toml=KEYS + "\ntinker_max_runs = 2")
    alice = Tinker(server.url, KEY_A)
    first = alice.session()
    saved, other = alice.run(server_model, first, 0), alice.run(server_model, first, 1)
    alice.save(saved, "s", 1)
    refused = alice.post("/create_model", {"session_id": first, "model_seq_id": 2, "base_model": str(server_model),
                                           "lora_config": {"rank": 2}})
    assert refused.status_code == 400 and "tinker_max_runs" in refused.text and "close()" in refused.text
    assert alice.post(f"/sessions/{first}/finish").status_code == 200
    second = alice.session()
    fresh = [alice.run(server_model, second, 0), alice.run(server_model, second, 1)]  # both places free again
    assert sorted(_runs(alice)) == sorted([saved, *fresh]) and other not in _runs(alice)
    # A new run from the closed run's checkpoint: the checkpoint outlives its closed run's place.
    assert alice.post(f"/sessions/{second}/finish").status_code == 200
    third = alice.session()
    loaded = alice.result(alice.post("/load_weights", {"session_id": third, "model_seq_id": 0,
                                                       "path": f"tinker://{saved}/weights/s", "optimizer": True}))
    assert loaded["model_id"] in _runs(alice)


def test_listing_parameters_are_ascii_integers_in_range(start_server) -> None:
    server = start_server(server_toml=KEYS)
    alice = Tinker(server.url, KEY_A)
    for route in ("/checkpoints", "/training_runs", "/sessions"):
        for name, raw in (("offset", "99999999999999999999999"), ("limit", "\u00b2"), ("offset", "\u00b2"),
                          ("offset", "\u0663"), ("limit", "0"), ("limit", "1001"), ("offset", "-1"), ("offset", "1e3")):
            out = alice.http.get(route, params={name: raw})
            assert out.status_code == 422 and out.json()["field"] == name, (route, name, raw, out.status_code, out.text)
        assert alice.http.get(route, params={"offset": "1000000000", "limit": "1000"}).status_code == 200
    assert "Traceback" not in server.log_path.read_text()


def test_a_download_link_serves_only_the_checkpoint_it_was_made_for(start_server, server_model: Path) -> None:
    server = start_server(server_toml=KEYS)
    alice = Tinker(server.url, KEY_A)
    run = alice.run(server_model, alice.session())

    def export(seq: int) -> dict[str, str]:
        out = alice.result(alice.post("/save_weights_external", {"model_id": run, "path": "e", "seq_id": seq}))
        assert out["path"] == f"tinker://{run}/external_weights/e", out
        got = alice.http.get(f"/training_runs/{run}/checkpoints/external_weights/e/external_weights_urls")
        assert got.status_code == 200, got.text
        return got.json()["urls"]

    old = export(1)
    assert old and all(httpx.get(u).status_code == 200 for u in old.values())
    assert alice.http.delete(f"/training_runs/{run}/checkpoints/external_weights/e").status_code == 200
    assert all(httpx.get(u).status_code == 404 for u in old.values())
    new = export(2)  # made again under the same name: the old links stay dead, the new ones work
    assert all(httpx.get(u).status_code == 404 for u in old.values())
    assert all(httpx.get(u).status_code == 200 for u in new.values())
    broken = next(iter(new.values())).replace("expires=", "expires=\u00b2")
    assert httpx.get(broken).status_code == 404  # not a 500


def test_a_reused_seq_id_is_refused_with_400_not_the_409_the_sdk_retries(start_server, server_model: Path) -> None:
    server = start_server(server_toml=KEYS)
    alice = Tinker(server.url, KEY_A)
    run = alice.run(server_model, alice.session())
    step = {"model_id": run, "seq_id": 1, "adam_params": {"learning_rate": 0.0}}
    first = alice.post("/optim_step", step)
    assert alice.post("/optim_step", step).json()["request_id"] == first.json()["request_id"]  # a retry
    other = alice.post("/optim_step", {**step, "adam_params": {"learning_rate": 0.5}})
    assert other.status_code == 400 and other.json()["error"] == "sequence_reused", other.text
    assert other.json()["field"] == "seq_id"


def test_a_seq_id_whose_successor_overflows_the_registry_is_refused(start_server, server_model: Path) -> None:
    """A prober's fault: `seq_id = 2**63 - 1` was accepted; the run's next expected seq_id (2**63)
    then overflowed SQLite's INTEGER when the run was offloaded, failing the request that evicted
    it (another tenant's create_model) and leaving the run gone but recorded live."""
    server = start_server(server_toml=KEYS)
    alice = Tinker(server.url, KEY_A)
    run = alice.run(server_model, alice.session())
    for field, body in (("seq_id", {"model_id": run, "seq_id": 2**63 - 1, "adam_params": {"learning_rate": 0.0}}),
                        ("model_seq_id", {"session_id": alice.session(), "model_seq_id": 2**63 - 1,
                                          "base_model": str(server_model), "lora_config": {"rank": 2, "seed": 0}})):
        reply = alice.post("/optim_step" if field == "seq_id" else "/create_model", body)
        assert reply.status_code in (400, 422), reply.text
        assert field in reply.text
    # The run's own sequence is untouched: seq_id 1 runs at once (no gap to wait out).
    start = time.monotonic()
    out = alice.save(run, "after-refusal", seq=1)
    assert "error" not in out and out["path"].startswith("tinker://"), out
    assert time.monotonic() - start < 20


def test_error_messages_scrub_the_state_dir_however_it_is_spelled(start_server, server_model: Path, tmp_path: Path) -> None:
    """A prober's fault: only the resolved state dir was scrubbed from tenants' error messages, so
    a state dir reached through a symlink (or a relative one, floe's default) leaked the server's
    paths. The load is queued behind seq 2, its checkpoint deleted, then seq 2 lets it run."""
    real = tmp_path / "real-states"
    real.mkdir()
    (tmp_path / "link-states").symlink_to(real)
    server = start_server(server_toml=KEYS + "\nsequence_timeout_s = 600\n", state_dir=tmp_path / "link-states")
    alice = Tinker(server.url, KEY_A)
    run = alice.run(server_model, alice.session())
    alice.save(run, "c1", seq=1)
    load = alice.post("/load_weights", {"model_id": run, "path": f"tinker://{run}/weights/c1", "optimizer": True, "seq_id": 3})
    assert load.status_code == 200, load.text
    assert alice.http.delete(f"/training_runs/{run}/checkpoints/weights/c1").status_code == 200
    alice.save(run, "c2", seq=2)
    out = alice.result(load)
    assert "error" in out, out
    for spelling in (str(tmp_path), "link-states", "real-states"):
        assert spelling not in out["error"], out["error"]
    assert "<server storage>" in out["error"], out["error"]
