"""Input bounds, attacked on a real `floe serve` (loopback, tiny model, two Tinker tenants and an
operator token): the security review's F1 (unbounded stop strings held the shared sampler),
F2 (`target_prompt_logprobs` with a huge K allocated rows x K int64), F5 (requests that got a
500, or a request id and a failure only inside the future, instead of a 4xx naming the field),
and a later review's two: a refused JSON training request held its seq_id (the next request
waited the gap timeout), and a published checkpoint carried its owner's run metadata to the
key that loaded it.

Each request here is the reviewer's attack sent as raw HTTP; every refusal must come at once,
name the field, and leave the server answering."""

from __future__ import annotations

import json
import signal
import struct
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from floe.backend.validation import MAX_STOP_CHARS, MAX_STOP_STRINGS
from floe.protocol import wire
from floe.server.protocols.tinker import schema
from tests.server.conftest import TOKEN, ServerProcess, free_port, write_config
from tests.server.test_security import Tinker

KEY_A, KEY_B = "tml-alice-key-0001", "tml-bob-key-0002"
GAP_S = 30  # sequence_timeout_s: a seq the sequencer did not skip would hold the next one this long
OPERATOR = {"Authorization": f"Bearer {TOKEN}"}
TENANT_A = {"Authorization": f"Bearer {KEY_A}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_model: Path):
    tmp = tmp_path_factory.mktemp("input-bounds")
    config = write_config(tmp / "serve.toml", server_model, tmp / "states",
                          f'tinker_api_keys = ["{KEY_A}", "{KEY_B}"]\nsequence_timeout_s = {GAP_S}')
    proc = ServerProcess(config, free_port(), tmp / "server.log", token=TOKEN).wait_ready()
    proc.model = server_model  # type: ignore[attr-defined]
    yield proc
    proc.stop(signal.SIGKILL)


class Tenant(Tinker):
    """test_security's raw Tinker client, with the sampling requests these tests send."""

    def __init__(self, url: str, key: str):
        super().__init__(url, key)
        self.http.timeout = httpx.Timeout(120)

    def base_sampler(self, model: Path) -> str:
        out = self.post("/create_sampling_session", {"session_id": self.session(), "sampling_session_seq_id": 1,
                                                     "base_model": str(model)})
        assert out.status_code == 200, out.text
        return out.json()["sampling_session_id"]

    def asample(self, sampler: str, prompt=(5, 6, 7), num_samples: int = 1, **extra) -> httpx.Response:
        body = {"sampling_session_id": sampler, "num_samples": num_samples,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(prompt)}]},
                "sampling_params": {"max_tokens": 4, "seed": 0}}
        body.update(extra)
        return self.post("/asample", body)


def _refused(r: httpx.Response, field: str, status: int = 422) -> str:
    """The refusal's message; asserts its status and that it names `field` (Tinker: `field`)."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    body = r.json()
    assert body.get("field") == field, body
    assert "request_id" not in body  # refused now, not accepted and failed inside a future
    return body["message"]


def _openai_refused(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def _small_sample_answers(server: ServerProcess) -> None:
    """Tenant B's 4-token sample is answered (the server was not stalled or broken)."""
    bob = Tenant(server.url, KEY_B)
    out = bob.result(bob.asample(bob.base_sampler(server.model)))  # type: ignore[attr-defined]
    assert "raw" in out  # a SampleResponse protobuf


def _native(server: ServerProcess, op: str, args: dict, tensors: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}/api/{op}", headers=OPERATOR, timeout=120,
                      content=wire.pack({"v": 1, "op": op, "args": args}, tensors or {}))


PROMPT = {"prompt": np.asarray([1, 2, 3], dtype=np.int32), "prompt.lengths": np.asarray([3], dtype=np.int64)}


# -- F1: stop strings ----------------------------------------------------------------------------


def test_stop_strings_are_bounded_on_every_route(server: ServerProcess) -> None:
    alice = Tenant(server.url, KEY_A)
    sampler = alice.base_sampler(server.model)  # type: ignore[attr-defined]
    flood = [chr(0x4E00 + i % 20000) + chr(0x4E00 + i // 20000) for i in range(100_000)]  # the 1.6 MB attack
    start = time.monotonic()
    message = _refused(alice.asample(sampler, sampling_params={"max_tokens": 40, "seed": 0, "stop": flood}),
                       "sampling_params.stop")
    assert time.monotonic() - start < 10 and f"at most {MAX_STOP_STRINGS}" in message
    assert "non-empty" in _refused(alice.asample(sampler, sampling_params={"max_tokens": 4, "stop": [""]}),
                                   "sampling_params.stop")
    too_long = "x" * (MAX_STOP_CHARS + 1)
    assert str(MAX_STOP_CHARS) in _refused(alice.asample(sampler, sampling_params={"max_tokens": 4, "stop": too_long}),
                                           "sampling_params.stop")
    assert "stop token ids" in _refused(alice.asample(sampler, sampling_params={"max_tokens": 4, "stop": [5] * 1000}),
                                        "sampling_params.stop")
    # The same field on the other routes: Tinker's OpenAI routes, /v1, prime-rl's generate, the native API.
    oai = httpx.post(server.url + "/oai/api/v1/completions", headers=TENANT_A, timeout=60,
                     json={"model": f"{server.model}", "prompt": "ab", "max_tokens": 2, "stop": flood})  # type: ignore[attr-defined]
    assert f"at most {MAX_STOP_STRINGS}" in _openai_refused(oai, "stop")
    for route, body in (("/v1/completions", {"prompt": "ab", "max_tokens": 2, "stop": flood}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2,
                                                  "stop": [""]})):
        _openai_refused(httpx.post(server.url + route, headers=OPERATOR, json=body, timeout=60), "stop")
    generate = httpx.post(server.url + "/inference/v1/generate", headers=OPERATOR, timeout=60,
                          json={"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "stop": flood}})
    assert generate.status_code == 400 and generate.json()["field"] == "sampling_params.stop", generate.text[:300]
    native = _native(server, "sample", {"n": 1, "params": {"max_tokens": 2, "stop": ["ab"] * (MAX_STOP_STRINGS + 1)}},
                     PROMPT)
    assert native.status_code == 422 and native.json()["field"] == "params.stop", native.text[:300]  # the native API's InvalidInput
    # At the bound, stop strings are served; and the other tenant is answered.
    at_bound = [chr(0x4E00 + i) * MAX_STOP_CHARS for i in range(MAX_STOP_STRINGS)]
    assert "raw" in alice.result(alice.asample(sampler, sampling_params={"max_tokens": 4, "seed": 0, "stop": at_bound}))
    ok = httpx.post(server.url + "/v1/completions", headers=OPERATOR, timeout=60,
                    json={"prompt": "ab", "max_tokens": 2, "stop": at_bound})
    assert ok.status_code == 200, ok.text[:300]
    _small_sample_answers(server)


# -- F2: target_prompt_logprobs ------------------------------------------------------------------


def test_target_prompt_logprobs_width_is_bounded_before_allocation(server: ServerProcess) -> None:
    alice = Tenant(server.url, KEY_A)
    sampler = alice.base_sampler(server.model)  # type: ignore[attr-defined]

    def targets(k: int) -> dict:  # ~330 bytes whatever K is: one id, sparse
        return {"dtype": "int64", "shape": [1, k], "data": [3], "sparse_crow_indices": [0, 1], "sparse_col_indices": [0]}

    for k in (10**13, 10**8, 21):
        start = time.monotonic()
        assert "at most 20" in _refused(alice.asample(sampler, prompt=(1, 2), target_prompt_logprobs=targets(k)),
                                        "target_prompt_logprobs.shape")
        assert time.monotonic() - start < 10
    assert "raw" in alice.result(alice.asample(sampler, prompt=(1, 2), target_prompt_logprobs=targets(20)))
    _small_sample_answers(server)


# -- F5a: forward_backward byte lengths; the sequencer moves on --------------------------------------


def _fb_body(model_id: str, seq: int, token_bytes: bytes, target_bytes: bytes, weight_bytes: bytes | None = None) -> bytes:
    msg = schema.ForwardBackwardRequest()
    msg.model_id, msg.seq_id, msg.loss_fn = model_id, seq, "cross_entropy"
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = token_bytes
    t = d.loss_fn_inputs["target_tokens"]
    t.dtype, t.dense = schema.DTYPE_INT64, target_bytes
    t.shape.append(3)
    if weight_bytes is not None:
        w = d.loss_fn_inputs["weights"]
        w.dtype, w.dense = schema.DTYPE_FLOAT32, weight_bytes
        w.shape.append(3)
    return msg.SerializeToString()


def test_forward_backward_with_partial_values_is_refused_and_skipped(server: ServerProcess) -> None:
    alice = Tenant(server.url, KEY_A)
    out = alice.result(alice.post("/create_model", {"session_id": alice.session(), "model_seq_id": 0,
                                                    "base_model": str(server.model),  # type: ignore[attr-defined]
                                                    "lora_config": {"rank": 2, "seed": 0}}))
    run = out["model_id"]
    tokens, targets = np.asarray([1, 2, 3], np.int32).tobytes(), np.asarray([2, 3, 4], np.int64).tobytes()
    proto = {"content-type": "application/x-protobuf"}
    bad_tokens = alice.post("/forward_backward", content=_fb_body(run, 1, b"\x01\x00\x00\x00\x02", targets), headers=proto)
    assert "multiple of 4" in _refused(bad_tokens, "data[0].model_input.chunks[0].tokens")
    bad_targets = alice.post("/forward_backward", content=_fb_body(run, 2, tokens, b"\x01" * 9), headers=proto)
    assert "multiple of 8" in _refused(bad_targets, "data[0].loss_fn_inputs.target_tokens")
    bad_weights = alice.post("/forward_backward", content=_fb_body(run, 3, tokens, targets, b"\x00" * 11), headers=proto)
    assert "multiple of 4" in _refused(bad_weights, "data[0].loss_fn_inputs.weights")
    # Seqs 1-3 were answered (refused): seq 4 runs now, not after sequence_timeout_s.
    start = time.monotonic()
    done = alice.result(alice.post("/forward_backward", content=_fb_body(run, 4, tokens, targets), headers=proto))
    assert "raw" in done and time.monotonic() - start < GAP_S / 2


def test_every_refused_training_request_is_skipped(server: ServerProcess) -> None:
    """The security review's sequencing finding: a JSON training request refused before it is
    queued held its seq_id, so the client's next request waited sequence_timeout_s for it. Each
    kind, refused in turn (422, or 404 for a checkpoint that does not exist), then the next
    request runs at once."""
    alice = Tenant(server.url, KEY_A)
    run = alice.run(server.model, alice.session())  # type: ignore[attr-defined]
    refusals = [
        ("/optim_step", {"adam_params": {"learning_rate": 5.0}}, "adam_params.learning_rate", 422),
        ("/save_weights", {"path": "../escape"}, "path", 422),
        ("/save_weights_for_sampler", {"path": "w", "ttl_seconds": 1}, "ttl_seconds", 422),
        ("/save_weights_external", {"path": "a/b"}, "path", 422),
        ("/load_weights", {"path": f"tinker://{run}/weights/missing", "optimizer": True}, "path", 404),
    ]
    for seq, (route, body, field, status) in enumerate(refusals, start=1):
        _refused(alice.post(route, {"model_id": run, "seq_id": seq, **body}), field, status)
    start = time.monotonic()
    done = alice.result(alice.post("/save_weights_for_sampler", {"model_id": run, "seq_id": len(refusals) + 1,
                                                                 "path": "after"}))
    assert done["path"].endswith("/sampler_weights/after") and time.monotonic() - start < GAP_S / 2
    # A refusal of another key's run skips nothing of it: B is answered 404 and A's next seq_id still counts.
    bob = Tenant(server.url, KEY_B)
    _refused(bob.post("/optim_step", {"model_id": run, "seq_id": len(refusals) + 2, "adam_params": {"learning_rate": 5.0}}),
             "model_id", 404)
    done = alice.result(alice.post("/save_weights", {"model_id": run, "seq_id": len(refusals) + 2, "path": "two"}))
    assert done["path"].endswith("/weights/two")


def test_a_published_checkpoint_loads_without_its_owners_run_metadata(server: ServerProcess) -> None:
    """The security review's metadata finding: a run loaded from another key's published
    checkpoint took the saved run's user_metadata (the owner's: project names, keys)."""
    alice, bob = Tenant(server.url, KEY_A), Tenant(server.url, KEY_B)
    secret = {"wandb_api_key": "ALICE-PRIVATE", "project": "alice-project"}
    out = alice.result(alice.post("/create_model", {"session_id": alice.session(), "model_seq_id": 0,
                                                    "base_model": str(server.model),  # type: ignore[attr-defined]
                                                    "lora_config": {"rank": 2, "seed": 0}, "user_metadata": secret}))
    run = out["model_id"]
    path = alice.save(run, "pub", seq=1)["path"]
    assert alice.http.post(f"/training_runs/{run}/checkpoints/weights/pub/publish").status_code == 200
    loaded = {}
    for name, tenant in (("alice", alice), ("bob", bob)):
        session = tenant.session()
        out = tenant.result(tenant.post("/load_weights", {"session_id": session, "model_seq_id": 0, "path": path,
                                                          "optimizer": True}))
        info = tenant.http.get(f"/training_runs/{out['model_id']}")
        assert info.status_code == 200, info.text
        loaded[name] = info.json()["user_metadata"]
    assert loaded["alice"] == secret and not loaded["bob"]


# -- F5b: lone surrogates in text ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "raw", "param"),
    [
        ("/oai/api/v1/completions", b'{"model":"M","prompt":"a\\ud800b","max_tokens":2}', "prompt"),
        ("/oai/api/v1/chat/completions", b'{"model":"M","messages":[{"role":"user","content":"a\\ud800b"}],"max_tokens":2}',
         "messages[0].content"),
        ("/v1/completions", b'{"prompt":["ok","a\\udfffb"],"max_tokens":2}', "prompt[1]"),
        ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"\\ud800"}],"max_tokens":2}',
         "messages[0].content"),
    ],
)
def test_lone_surrogates_are_refused_naming_the_field(server: ServerProcess, route: str, raw: bytes, param: str) -> None:
    headers = {**(TENANT_A if route.startswith("/oai") else OPERATOR), "content-type": "application/json"}
    raw = raw.replace(b'"M"', json.dumps(str(server.model)).encode())  # type: ignore[attr-defined]
    message = _openai_refused(httpx.post(server.url + route, headers=headers, content=raw, timeout=60), param)
    assert "surrogate" in message
    # A surrogate pair (one character outside the BMP) is text, and is served.
    ok = httpx.post(server.url + route, headers=headers, timeout=60,
                    content=raw.replace(b"\\ud800", b"\\ud83d\\ude00").replace(b"\\udfff", b"\\ud83d\\ude00"))
    assert ok.status_code == 200, ok.text[:300]


def test_a_lone_surrogate_in_a_tinker_field_is_refused(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/api/v1/create_session", headers={"X-API-Key": KEY_A, "content-type": "application/json"},
                   content=b'{"tags":["\\ud800"],"user_metadata":null,"sdk_version":"0.38.0"}')
    assert "surrogate" in _refused(r, "tags[0]", status=r.status_code) and 400 <= r.status_code < 500


# -- duplicate keys: which value was meant is ambiguous -------------------------------------------------


@pytest.mark.parametrize(
    ("route", "raw"),
    [
        ("/api/v1/create_session", b'{"tags":[],"user_metadata":null,"sdk_version":"0.38.0","tags":["x"]}'),
        ("/oai/api/v1/completions", b'{"model":"M","prompt":"ab","max_tokens":2,"max_tokens":3}'),
        ("/v1/completions", b'{"prompt":"ab","max_tokens":2,"stop":[],"max_tokens":3}'),
        ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"a","role":"system"}],"max_tokens":2}'),
        ("/inference/v1/generate", b'{"token_ids":[1,2],"sampling_params":{"max_tokens":2,"max_tokens":3}}'),
    ],
)
def test_a_key_named_twice_in_a_json_object_is_refused(server: ServerProcess, route: str, raw: bytes) -> None:
    headers = {"X-API-Key": KEY_A} if route.startswith("/api/v1") else TENANT_A if route.startswith("/oai") else OPERATOR
    raw = raw.replace(b'"M"', json.dumps(str(server.model)).encode())  # type: ignore[attr-defined]
    r = httpx.post(server.url + route, headers={**headers, "content-type": "application/json"}, content=raw, timeout=60)
    assert r.status_code in (400, 422), (r.status_code, r.text[:300])
    assert "twice" in r.text, r.text[:300]
    # The same body with the key once is served.
    once = json.dumps(json.loads(raw)).encode()  # Python's parser keeps the last value
    ok = httpx.post(server.url + route, headers={**headers, "content-type": "application/json"}, content=once, timeout=60)
    assert ok.status_code == 200, (route, ok.status_code, ok.text[:300])


def test_a_key_named_twice_in_a_native_message_is_refused(server: ServerProcess) -> None:
    control = '{"v": 1, "op": "sample", "args": {"n": 1, "n": 2}}'
    head = {"__metadata__": {"floe": control},
            "prompt": {"dtype": "I32", "shape": [3], "data_offsets": [0, 12]},
            "prompt.lengths": {"dtype": "I64", "shape": [1], "data_offsets": [12, 20]}}
    data = np.asarray([1, 2, 3], np.int32).tobytes() + np.asarray([3], np.int64).tobytes()
    for header in (json.dumps(head), json.dumps(head)[:-1] + ', "prompt": {"dtype": "I32", "shape": [0], '
                   '"data_offsets": [0, 0]}}'):
        raw = header.encode()
        raw += b" " * (-len(raw) % 8)
        r = httpx.post(server.url + "/api/sample", headers=OPERATOR, timeout=60,
                       content=struct.pack("<Q", len(raw)) + raw + data)
        assert r.status_code == 400 and "twice" in r.json()["message"], (r.status_code, r.text[:300])
    assert _native(server, "sample", {"n": 1, "params": {"max_tokens": 2}}, PROMPT).status_code == 200


# -- F5c: native wire, an empty tensor with a huge dimension ---------------------------------------


@pytest.mark.parametrize("shape", [[0, 2**70], [0, 2**62, 2**62], [0, 2**31, 2**31, 2**31]])
def test_native_empty_tensor_with_a_huge_shape_is_a_400(server: ServerProcess, shape: list[int]) -> None:
    head = {"__metadata__": {"floe": json.dumps({"v": 1, "op": "sample", "args": {"n": 1}})},
            "prompt": {"dtype": "I32", "shape": shape, "data_offsets": [0, 0]},
            "prompt.lengths": {"dtype": "I64", "shape": [0], "data_offsets": [0, 0]}}
    raw = json.dumps(head).encode()
    raw += b" " * (-len(raw) % 8)
    r = httpx.post(server.url + "/api/sample", headers=OPERATOR, content=struct.pack("<Q", len(raw)) + raw, timeout=60)
    assert r.status_code == 400 and r.json()["field"] == "body.prompt.shape", (r.status_code, r.text[:300])
    assert _native(server, "sample", {"n": 1, "params": {"max_tokens": 2}}, PROMPT).status_code == 200


# -- F5d: num_samples above the sampler's limit ----------------------------------------------------------


def test_num_samples_above_the_samplers_batch_is_refused_at_once(server: ServerProcess) -> None:
    alice = Tenant(server.url, KEY_A)
    sampler = alice.base_sampler(server.model)  # type: ignore[attr-defined]
    message = _refused(alice.asample(sampler, num_samples=257, sampling_params={"max_tokens": 1}), "num_samples")
    assert "max_batch_sequences" in message and "256" in message
    assert "raw" in alice.result(alice.asample(sampler, num_samples=256, sampling_params={"max_tokens": 1, "seed": 0}))
