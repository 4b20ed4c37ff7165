"""Attacks on a real `floe serve` process (loopback), each a regression test of a fault found by
probing the server as an attacker would: paths built from client ids, the native/Tinker
namespaces, routes open on a server that has a credential, tenants reaching each other's
things, DNS rebinding and cross-site requests, and sizes checked after allocation.

The Tinker requests are sent as raw HTTP (the exact bodies the tinker SDK sends, plus hostile
ones), so this runs in the core suite without the SDK; tests/tinker covers the SDK itself."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from floe.server.protocols.tinker import schema
from tests.server.conftest import TOKEN

KEY_A, KEY_B = "tml-alice-key-0001", "tml-bob-key-0002"
KEYS = f'tinker_api_keys = ["{KEY_A}", "{KEY_B}"]'


class Tinker:
    """A raw Tinker client for one key: the SDK's requests, with futures resolved."""

    def __init__(self, url: str, key: str | None, headers: dict[str, str] | None = None):
        self.http = httpx.Client(base_url=url + "/api/v1", timeout=60,
                                 headers={**({"X-API-Key": key} if key else {}), **(headers or {})})

    def post(self, path: str, body: dict | None = None, **kw) -> httpx.Response:
        return self.http.post(path, json=body, **kw) if body is not None else self.http.post(path, **kw)

    def result(self, future: httpx.Response) -> dict:
        assert future.status_code == 200, future.text
        rid = future.json()["request_id"]
        while True:
            got = self.http.post("/retrieve_future", json={"request_id": rid})
            if got.status_code != 408:
                assert got.status_code == 200, got.text
                return got.json() if got.headers["content-type"].startswith("application/json") else {"raw": got.content}

    def session(self) -> str:
        out = self.post("/create_session", {"tags": [], "user_metadata": None, "sdk_version": "0.38.0"})
        assert out.status_code == 200, out.text
        return out.json()["session_id"]

    def run(self, model: Path, session: str, seq: int = 0) -> str:
        out = self.result(self.post("/create_model", {"session_id": session, "model_seq_id": seq, "base_model": str(model),
                                                     "lora_config": {"rank": 2, "seed": 0}}))
        assert "model_id" in out, out
        return out["model_id"]

    def save(self, model_id: str, name: str, seq: int) -> dict:
        return self.result(self.post("/save_weights", {"model_id": model_id, "path": name, "seq_id": seq}))


def _fb_body(model_id: str, seq: int) -> bytes:
    msg = schema.ForwardBackwardRequest()
    msg.model_id, msg.seq_id, msg.loss_fn = model_id, seq, "cross_entropy"
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray([1, 2, 3], dtype=np.int32).tobytes()
    t = d.loss_fn_inputs["target_tokens"]
    t.dtype, t.dense = schema.DTYPE_INT64, np.asarray([2, 3, 4], dtype=np.int64).tobytes()
    t.shape.append(3)
    return msg.SerializeToString()


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_client_ids_never_become_paths_outside_the_server_storage(start_server, server_model: Path, tmp_path: Path) -> None:
    server = start_server(server_toml=KEYS)
    alice = Tinker(server.url, KEY_A)
    before = _files(tmp_path)
    # A session id of the client's choosing: refused before any path exists (it names no session of this key).
    escape = str(tmp_path / "escaped")
    for session_id in ("../../escaped", escape, "a/../../b", "x\n"):
        out = alice.post("/create_model", {"session_id": session_id, "model_seq_id": 0, "base_model": str(server_model),
                                           "lora_config": {"rank": 2}})
        assert out.status_code == 404, out.text
        assert out.json()["field"] == "session_id"
    session = alice.session()
    run = alice.run(server_model, session)
    for name in ("../../escaped", "../x", ".hidden", "a/b", "ok\n", "x" * 200):
        out = alice.post("/save_weights", {"model_id": run, "path": name, "seq_id": 1})
        assert out.status_code == 422 and out.json()["field"] == "path", (name, out.text)
    for path in ("tinker://../../escaped/weights/x", f"tinker://{run}/weights/../../../x", "tinker://a/b", "/etc/passwd"):
        out = alice.post("/load_weights", {"session_id": session, "model_seq_id": 5, "path": path, "optimizer": False})
        assert out.status_code == 422 and out.json()["field"] == "path", (path, out.text)
    out = alice.http.get("/download/..%2F..%2F..%2Fetc/weights/x/passwd", params={"expires": "9999999999", "sig": "0"})
    assert out.status_code in (404, 422)
    created = _files(tmp_path) - before
    assert not any("escaped" in p for p in created), created
    assert all(p.startswith(("states", "server-")) for p in created), created


def test_native_state_names_cannot_reach_tinker_data(start_server, server_model: Path) -> None:
    server = start_server(server_toml=KEYS, token=TOKEN)
    alice = Tinker(server.url, KEY_A)
    run = alice.run(server_model, alice.session())
    path = alice.save(run, "keep", 1)["path"]
    native = server.client(timeout=60)
    native.save_state("tinker")  # the name that used to replace the Tinker root
    native.delete_state("tinker")
    for name in (".tinker", "..", ".tinker/runs"):
        with pytest.raises(Exception, match="name"):
            native.save_state(name)
        with pytest.raises(Exception, match="name"):
            native.delete_state(name)
    assert ".tinker" not in native.list_states()
    native.close()
    out = alice.result(alice.post("/load_weights", {"session_id": alice.session(), "model_seq_id": 0, "path": path,
                                                    "optimizer": True}))
    assert out.get("model_id"), out  # the Tinker checkpoint is intact


def test_a_server_with_a_token_leaves_no_route_open(start_server, server_model: Path) -> None:
    server = start_server(token=TOKEN)  # a bearer token, no Tinker keys
    anon = Tinker(server.url, None)
    for path in ("/client/config", "/create_session", "/telemetry", "/retrieve_future"):
        assert anon.post(path, {}).status_code == 401, path
    assert anon.http.get("/get_server_capabilities").status_code == 401
    assert anon.http.get("/training_runs").status_code == 401
    for path in ("/info", "/tokenizer", "/metrics", "/v1/models"):
        assert httpx.get(server.url + path).status_code == 401, path
    for path in ("/pause", "/resume", "/api/save_state", "/v1/completions", "/inference/v1/generate"):
        assert httpx.post(server.url + path, json={}).status_code == 401, path
    assert httpx.get(server.url + "/health").status_code == 200
    # The operator's token opens the Tinker routes too (as X-API-Key, the SDK's header, or as a bearer token).
    for headers in ({"X-API-Key": TOKEN}, {"Authorization": f"Bearer {TOKEN}"}):
        ok = Tinker(server.url, None, headers)
        assert ok.post("/create_session", {"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}).status_code == 200


def test_keys_are_tenants(start_server, server_model: Path) -> None:
    server = start_server(server_toml=KEYS, token=TOKEN)
    alice, bob = Tinker(server.url, KEY_A), Tinker(server.url, KEY_B)
    session = alice.session()
    run = alice.run(server_model, session)
    ckpt = alice.save(run, "private", 1)["path"]
    shared = alice.save(run, "shared", 2)["path"]
    sampler = alice.result(alice.post("/save_weights_for_sampler", {"model_id": run, "sampling_session_seq_id": 0,
                                                                    "seq_id": 3}))["sampling_session_id"]
    alice.result(alice.post("/forward_backward", content=_fb_body(run, 4), headers={"Content-Type": "application/x-protobuf"}))
    pending = alice.post("/optim_step", {"model_id": run, "seq_id": 5, "adam_params": {"learning_rate": 1e-3}})
    rid = pending.json()["request_id"]
    bob_session = bob.session()

    # Bob, given every id, reaches nothing of Alice's: each answer is 404, as for an id that does not exist.
    attempts = [
        bob.post("/get_info", {"model_id": run}),
        bob.post("/forward_backward", content=_fb_body(run, 9), headers={"Content-Type": "application/x-protobuf"}),
        bob.post("/optim_step", {"model_id": run, "seq_id": 9, "adam_params": {"learning_rate": 1.0}}),
        bob.post("/save_weights", {"model_id": run, "path": "private", "overwrite": True, "seq_id": 9}),
        bob.post("/load_weights", {"session_id": bob_session, "model_seq_id": 0, "path": ckpt, "optimizer": True}),
        bob.post("/load_weights", {"model_id": run, "path": ckpt, "optimizer": True, "seq_id": 9}),
        bob.post("/create_sampling_session", {"session_id": bob_session, "sampling_session_seq_id": 0,
                                              "model_path": ckpt.replace("/weights/", "/sampler_weights/")}),
        bob.post("/asample", {"sampling_session_id": sampler, "num_samples": 1,
                              "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                              "sampling_params": {"max_tokens": 2}}),
        bob.post("/retrieve_future", {"request_id": rid}),
        bob.post("/session_heartbeat", {"session_id": session}),
        bob.post(f"/sessions/{session}/finish"),
        bob.post("/create_model", {"session_id": session, "model_seq_id": 7, "base_model": str(server_model)}),
        bob.post("/weights_info", {"tinker_path": ckpt}),
        bob.http.get(f"/samplers/{sampler}"),
        bob.http.get(f"/training_runs/{run}"),
        bob.http.get(f"/training_runs/{run}/checkpoints"),
        bob.http.get(f"/sessions/{session}"),
        bob.http.delete(f"/training_runs/{run}/checkpoints/weights/private"),
        bob.http.post(f"/training_runs/{run}/checkpoints/weights/private/publish"),
        bob.http.put(f"/training_runs/{run}/checkpoints/weights/private/ttl", json={"ttl_seconds": 3600}),
    ]
    for out in attempts:
        assert out.status_code == 404, (out.request.url, out.status_code, out.text)
    assert bob.http.get("/training_runs").json()["training_runs"] == []
    assert bob.http.get("/checkpoints").json()["checkpoints"] == []
    assert session not in bob.http.get("/sessions").json()["sessions"]

    # Alice's things are untouched, and hers to use.
    assert alice.result(pending)["metrics"]["step:max"] == 1.0
    assert alice.post("/get_info", {"model_id": run}).status_code == 200
    assert {c["tinker_path"] for c in alice.http.get(f"/training_runs/{run}/checkpoints").json()["checkpoints"]} == {ckpt, shared}

    # A published checkpoint: others may read and load it, not change or delete it.
    assert alice.http.post(f"/training_runs/{run}/checkpoints/weights/shared/publish").status_code == 200
    assert bob.post("/weights_info", {"tinker_path": shared}).json()["is_lora"] is True
    loaded = bob.result(bob.post("/load_weights", {"session_id": bob_session, "model_seq_id": 0, "path": shared,
                                                   "optimizer": False}))
    assert loaded["model_id"].startswith(bob_session)
    assert bob.http.delete(f"/training_runs/{run}/checkpoints/weights/shared").status_code == 404
    assert bob.http.delete(f"/training_runs/{run}/checkpoints/weights/shared/publish").status_code == 404
    assert bob.post("/weights_info", {"tinker_path": ckpt}).status_code == 404  # the private one stays private
    # Tenants' keys do not open the shared backend.
    assert httpx.get(server.url + "/info", headers={"X-API-Key": KEY_B}).status_code == 403
    assert httpx.post(server.url + "/api/save_state", headers={"Authorization": f"Bearer {KEY_B}"}).status_code == 403


def test_host_and_origin_checks_stop_rebinding_and_cross_site_requests(start_server) -> None:
    server = start_server()  # loopback, no credentials: the server most exposed to web pages
    port = server.url.rsplit(":", 1)[1]
    rebinding = {"Host": f"attacker.example:{port}"}
    assert httpx.get(server.url + "/info", headers=rebinding).status_code == 421
    assert httpx.post(server.url + "/pause", headers=rebinding).status_code == 421
    assert httpx.get(server.url + "/info", headers={"Host": f"localhost:{port}"}).status_code == 200
    evil = {"Origin": "http://attacker.example"}
    for path in ("/pause", "/api/save_state", "/api/v1/create_session", "/v1/completions"):
        out = httpx.post(server.url + path, headers=evil, json={})
        assert out.status_code == 403 and "allowed_origins" in out.text, (path, out.text)
    assert httpx.post(server.url + "/pause", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
    info = server.client().info()  # nothing changed: the sampler is not paused and serves
    assert info.sampler_version == 0
    assert httpx.post(server.url + "/resume", headers={"Origin": server.url}).status_code == 200  # same origin is fine


def test_sizes_and_counts_are_bounded_before_work(start_server, server_model: Path) -> None:
    server = start_server(server_toml=KEYS + "\nmax_request_mb = 0.05\ntinker_max_sessions = 3", token=TOKEN)
    alice = Tinker(server.url, KEY_A)
    session = alice.session()
    run = alice.run(server_model, session)
    sampler = alice.result(alice.post("/save_weights_for_sampler", {"model_id": run, "sampling_session_seq_id": 0,
                                                                    "seq_id": 1}))["sampling_session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
    start = time.monotonic()
    huge = alice.post("/asample", {"sampling_session_id": sampler, "num_samples": 10_000_000, "prompt": prompt,
                                   "sampling_params": {"max_tokens": 4}})
    assert huge.status_code == 422 and huge.json()["field"] == "num_samples"
    assert time.monotonic() - start < 5
    many = alice.post("/asample", {"sampling_session_id": sampler, "num_samples": 1000, "prompt": prompt,
                                   "sampling_params": {"max_tokens": 10_000}})
    assert many.status_code == 422 and "max_tokens" in many.text
    big = b'{"x": "' + b"a" * 100_000 + b'"}'  # over max_request_mb on every route, not only /api/{op}
    operator = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    for path in ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate", "/api/sample", "/update_weights"):
        assert httpx.post(server.url + path, content=big, headers=operator).status_code == 413, path
    for path in ("/api/v1/create_session", "/api/v1/asample", "/api/v1/forward_backward"):
        assert httpx.post(server.url + path, content=big, headers={"X-API-Key": KEY_A}).status_code == 413, path
    deep = b"[" * 5000 + b"]" * 5000
    for body in (deep, b'{"a": ' + deep + b"}"):
        for path in ("/create_session", "/optim_step", "/asample", "/retrieve_future"):
            out = alice.post(path, content=body, headers={"Content-Type": "application/json"})
            assert out.status_code == 422, (path, out.status_code, out.text)
    for lr in ("Infinity", "NaN", "1e400", "-1"):
        raw = f'{{"model_id": "{run}", "seq_id": 2, "adam_params": {{"learning_rate": {lr}}}}}'.encode()
        out = alice.post("/optim_step", content=raw, headers={"Content-Type": "application/json"})
        assert out.status_code == 422, (lr, out.text)
    wrong_types = [("/create_model", {"session_id": session, "model_seq_id": "5", "base_model": str(server_model)}),
                   ("/create_model", {"session_id": session, "model_seq_id": 5, "base_model": str(server_model),
                                      "lora_config": {"rank": 2, "train_attn": "no"}}),
                   ("/optim_step", {"model_id": [run], "adam_params": {}}),
                   ("/save_weights", {"model_id": run, "path": 5}),
                   ("/asample", {"sampling_session_id": sampler, "prompt": "hello", "sampling_params": {}}),
                   ("/asample", {"sampling_session_id": {"a": 1}, "prompt": prompt, "sampling_params": {}})]
    for path, body in wrong_types:
        out = alice.post(path, body)
        assert 400 <= out.status_code < 500, (path, body, out.status_code, out.text)
    # Open sessions per key are bounded; finished ones are freed and do not count.
    more = [alice.session() for _ in range(2)]
    refused = alice.post("/create_session", {"tags": [], "user_metadata": None, "sdk_version": "0.38.0"})
    assert refused.status_code == 400 and "tinker_max_sessions" in refused.text  # 400: the SDK retries a 409
    assert alice.post(f"/sessions/{more[0]}/finish").status_code == 200
    assert alice.post("/create_session", {"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}).status_code == 200
    assert json.loads(httpx.get(server.url + "/health").text)["status"] == "ok"
