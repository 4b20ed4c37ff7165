"""Malformed requests never crash the server and never change its state: every one gets a
4xx JSON error, the process stays up, and step, versions, pending gradients and the policy's
log-probs on a fixed batch (a weights fingerprint) are unchanged afterwards."""

from __future__ import annotations

import json
import random
import struct
import uuid

import httpx
import numpy as np

from floe import Batch, Group, Sample
from floe.protocol import wire

from .conftest import TOKEN, ServerProcess

PROBE = Batch([Group([3, 4, 5], [Sample([6, 7, 8, 9]), Sample([10])])])
VALID_FB = Batch([Group([3, 4], [Sample([5, 6], logprobs=[-1.0, -2.0], advantage=1.0)])])


def fingerprint(server: ServerProcess) -> tuple:
    with server.client() as c:
        info = c.info()
        logprobs = c.forward(PROBE).logprobs
    return info.step, info.policy_version, info.sampler_version, info.capabilities["pending_forward_backward_calls"], logprobs


def frame(header: object) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head


def malformed_bodies() -> list[tuple[str, bytes]]:
    """(op, body) pairs that must all be refused."""
    rng = random.Random(0)
    good = wire.encode_request("forward_backward", {"batch": VALID_FB, "loss": "ppo"})
    control, tensors = wire.unpack(good)
    cases: list[tuple[str, bytes]] = [("forward_backward", b""), ("optim_step", b"{}"), ("sample", b"\x00" * 8)]
    cases += [(op, bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 2048)))) for op in ("forward_backward", "sample", "load_state") for _ in range(10)]
    cases += [("forward_backward", good[:i]) for i in range(0, len(good), max(1, len(good) // 25))]  # truncations
    cases += [
        ("forward_backward", struct.pack("<Q", 2**63 - 1) + b"{}"),  # huge declared header
        ("forward_backward", struct.pack("<Q", 6) + b"\xff\xfe{}\x80\x81"),  # not UTF-8
        ("forward_backward", frame({"__metadata__": {"floe": "\udcff"}})),
        ("forward_backward", frame({"__metadata__": {"floe": "[" * 100_000}})),  # deep nesting
        ("forward_backward", struct.pack("<Q", 200_000) + b"[" * 200_000),
        ("forward_backward", frame({"__metadata__": {"floe": json.dumps({"v": 1, "op": "forward_backward", "args": []})}})),
        ("forward_backward", frame({"__metadata__": {"floe": json.dumps({"v": 1, "op": "optim_step", "args": {}})}})),
        ("sample", frame({"__metadata__": {"floe": json.dumps({"v": 1, "op": "sample", "args": {"prompts": [[1]], "n": 1}})}})),
        ("optim_step", frame({"__metadata__": {"floe": json.dumps({"v": 1, "op": "optim_step", "args": {"lr": 1}})}})),
        ("load_state", frame({"__metadata__": {"floe": json.dumps({"v": 1, "op": "load_state", "args": {"name": "../../etc"}})}})),
        ("load_state", frame({"__metadata__": {"floe": json.dumps({"v": 1, "op": "load_state", "args": {"name": "missing"}})}})),
        ("export_hf", frame({"__metadata__": {"floe": json.dumps({"v": 1, "op": "export_hf", "args": {"path": 7}})}})),
    ]

    def with_tensor(name: str, value: np.ndarray) -> bytes:
        return wire.pack(control, {**tensors, name: value})

    cases += [
        ("forward_backward", with_tensor("tokens", np.array([5.0, 6.0], np.float32))),  # wrong dtype
        ("forward_backward", with_tensor("tokens", np.array([5, 10**6], np.int64))),  # out of vocabulary
        ("forward_backward", with_tensor("tokens", np.array([[5, 6]], np.int32))),  # bad shape
        ("forward_backward", with_tensor("tokens.lengths", np.array([-1], np.int64))),
        ("forward_backward", with_tensor("tokens.lengths", np.array([2**62], np.int64))),  # huge size
        ("forward_backward", with_tensor("group_sizes", np.array([2**40], np.int64))),
        ("forward_backward", with_tensor("logprobs", np.array([np.nan, -1.0], np.float32))),  # NaN: 422, nothing applied
        ("forward_backward", with_tensor("logprobs.present", np.array([0], np.uint8))),
        ("forward_backward", wire.pack({**control, "args": {"loss": "ppo", "loss_config": {"clip_low": "x"}}}, tensors)),
        ("forward_backward", wire.pack({**control, "args": {"loss": "nope"}}, tensors)),
        ("forward_backward", wire.pack({**control, "args": {"loss": "ppo", "temperature": -1}}, tensors)),
        ("forward_backward", wire.pack({**control, "args": {"loss": "ppo", "batch": {}}}, tensors)),
        ("sample", wire.encode_request("sample", {"prompts": [[1, 2]], "n": 0})),
        ("sample", wire.pack({"v": 1, "op": "sample", "args": {"n": 1, "params": {"max_tokens": 10**9}}}, wire.unpack(wire.encode_request("sample", {"prompts": [[1]]}))[1])),
        ("sample", wire.pack({"v": 1, "op": "sample", "args": {"n": 1, "params": {"bogus": 1}}}, wire.unpack(wire.encode_request("sample", {"prompts": [[1]]}))[1])),
    ]
    return cases


def test_fuzz_never_crashes_and_never_changes_state(shared_server: ServerProcess) -> None:
    before = fingerprint(shared_server)
    auth = shared_server.headers()
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=shared_server.url, timeout=30) as http:
        def send(method: str, path: str, expect: set[int] | None = None, **kw) -> None:
            r = http.request(method, path, **kw)
            assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:300])
            assert expect is None or r.status_code in expect, (path, r.status_code, r.text[:300])
            body = r.json()
            if path.startswith("/v1/"):  # the OpenAI protocol answers in OpenAI's error shape
                assert isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str)
            else:
                assert isinstance(body["error"], str) and isinstance(body["message"], str)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

        client_id = uuid.uuid4().hex
        for seq, (op, body) in enumerate(malformed_bodies(), start=1):
            send("POST", f"/api/{op}", content=body, headers=auth)  # unordered
            send("POST", f"/api/{op}", content=body, headers={**auth, "X-Floe-Client": client_id, "X-Floe-Seq": str(seq)})
        valid = wire.encode_request("forward_backward", {"batch": VALID_FB, "loss": "ppo"})
        send("POST", "/api/forward_backward", {401}, content=valid)  # no token: nothing runs
        send("POST", "/api/forward_backward", {401}, content=valid, headers={"Authorization": "Bearer wrong"})
        send("POST", "/api/forward_backward", {401}, content=valid, headers={"Authorization": TOKEN})
        send("POST", "/api/forward_backward", {413}, content=b"\0" * (2 << 20), headers=auth)  # over the 1 MiB limit
        send("POST", "/api/forward_backward", {400}, content=valid, headers={**auth, "X-Floe-Seq": "1"})
        for bad_seq in ("0", "-1", "abc", "1" * 30, "\u0661"):
            send("POST", "/api/optim_step", {400}, content=valid, headers={**auth, "X-Floe-Client": "x", "X-Floe-Seq": bad_seq.encode()})
        send("POST", "/api/forward_backward", {400}, content=valid, headers={**auth, "X-Floe-Client": "bad id!", "X-Floe-Seq": "1"})
        send("POST", "/api/nope", {404}, content=b"", headers=auth)
        send("GET", "/api/sample", {405}, headers=auth)
        send("GET", "/no/such/route", {404}, headers=auth)
        for body in (b"not json", b"[]", b"[" * 100_000, b'{"prompt": 5}', b'{"prompt": "hi", "frequency_penalty": 1}', b'{"prompt": "hi", "n": "2"}',
                     b'{"prompt": [[1, -5]]}', b'{"prompt": "hi", "max_tokens": 100000}', b'\xff\xfe'):
            send("POST", "/v1/completions", {400, 422}, content=body, headers=auth)
        for body in (b'{"messages": []}', b'{"messages": [{"role": "robot", "content": "x"}]}', b'{"messages": "hi"}'):
            send("POST", "/v1/chat/completions", {400, 422}, content=body, headers=auth)
    assert shared_server.alive()
    assert httpx.get(f"{shared_server.url}/health").status_code == 200
    assert fingerprint(shared_server) == before
    assert statuses.get(500) is None and sum(statuses.values()) > 150
    print("fuzz statuses:", dict(sorted(statuses.items())))
