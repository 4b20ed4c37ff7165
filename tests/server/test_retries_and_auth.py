"""Idempotent retries (a used request id replays its first result, a different payload under
it is refused), sequence gaps, the client's own retry on transient failures, bearer-token
auth, error mapping back to floe's exceptions, and the refusal to serve beyond loopback
without a token."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

import floe
from floe import Group, Sample
from floe.client.http import HttpTransport
from floe.protocol import wire
from floe.protocol.errors import RemoteError, RemoteUnavailable

from .conftest import TOKEN, ServerProcess, free_port

BATCH = [Group([3, 4], [Sample([5, 6], weights=[1.0, 0.5])])]


def test_duplicate_request_id_replays_without_running_again(shared_server: ServerProcess, shared_client: floe.Client) -> None:
    start = shared_client.info().step
    client_id, auth = uuid.uuid4().hex, shared_server.headers()
    fb = wire.encode_request("forward_backward", {"batch": BATCH, "loss": "cross_entropy"})
    step = wire.encode_request("optim_step", {})
    with httpx.Client(base_url=shared_server.url, headers=auth, timeout=30) as http:
        def post(op: str, seq: int, body: bytes) -> httpx.Response:
            return http.post(f"/api/{op}", content=body, headers={"X-Floe-Client": client_id, "X-Floe-Seq": str(seq)})

        first, again = post("forward_backward", 1, fb), post("forward_backward", 1, fb)
        assert first.status_code == again.status_code == 200
        assert again.headers.get("X-Floe-Replayed") == "1" and again.content == first.content
        assert shared_client.info().capabilities["pending_forward_backward_calls"] == 1  # ran once
        r1, r2 = post("optim_step", 2, step), post("optim_step", 2, step)
        assert wire.decode_result("optim_step", r1.content).step == start + 1
        assert r2.content == r1.content and shared_client.info().step == start + 1  # not stepped twice
        conflict = post("optim_step", 2, wire.encode_request("info", {}))
        assert conflict.status_code == 409 and conflict.json()["error"] == "sequence_reused"
        gap = post("info", 5, wire.encode_request("info", {}))  # 3 and 4 never come (timeout 1.5 s)
        assert gap.status_code == 425 and gap.json()["error"] == "sequence_gap"
        refused = post("optim_step", 3, step)  # nothing pending: the error is a result too, and replayed
        assert refused.status_code == 409 and post("optim_step", 3, step).content == refused.content


def test_server_errors_come_back_as_the_same_exceptions(shared_server: ServerProcess, shared_client: floe.Client, make_client) -> None:
    bad = [Group([3, 4], [Sample([5, 6], logprobs=[-1.0, float("nan")], advantage=1.0)])]
    with pytest.raises(floe.InvalidInput) as remote:
        shared_client.forward_backward(bad, loss="ppo")
    with pytest.raises(floe.InvalidInput) as local:
        make_client().forward_backward(bad, loss="ppo")
    assert (remote.value.field, remote.value.message) == (local.value.field, local.value.message)
    with pytest.raises(floe.StateError, match="no saved state"):
        shared_client.load_state("never-saved")
    with pytest.raises(floe.InvalidInput) as e:
        shared_client.forward(BATCH, zone="nowhere")
    assert e.value.field == "zone"


def test_token_is_required(shared_server: ServerProcess, shared_client: floe.Client) -> None:
    shared_client.info()
    for token in (None, "wrong"):
        with pytest.raises(RemoteError) as e:
            floe.connect(shared_server.url, token=token).info()
        assert e.value.status == 401
    assert httpx.get(f"{shared_server.url}/health").status_code == 200  # liveness needs no token
    assert httpx.get(f"{shared_server.url}/metrics").status_code == 401
    metrics = httpx.get(f"{shared_server.url}/metrics", headers=shared_server.headers()).text
    assert "floe_weights_version" in metrics and "floe_tokens_trained_total" in metrics
    assert 'floe_http_requests_total{route="/api/info",status="200"}' in metrics
    assert 'route="/api/nope"' not in metrics  # unknown names share the template label


def test_client_retries_connection_failures_until_its_timeout() -> None:
    transport = HttpTransport(f"http://127.0.0.1:{free_port()}", timeout=1.0, backoff_initial=0.05)
    start = time.monotonic()
    with pytest.raises(RemoteUnavailable, match="failed [3-9]|failed [1-9][0-9]"):
        transport.call("info")
    assert 0.5 < time.monotonic() - start < 3


def test_refuses_to_listen_beyond_loopback_without_token(server_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "b.toml"
    config.write_text(f'model = "{server_model}"\n')
    env = {"PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "floe.server", str(config), "--host", "0.0.0.0"], capture_output=True, text=True, env=env, timeout=60, check=False)
    assert proc.returncode == 2 and "needs a credential" in proc.stderr
    assert TOKEN not in proc.stderr
