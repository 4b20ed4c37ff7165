"""The same operations, in-process and over HTTP, give the same numbers (fp32): losses,
samples and the exported weights after training. Then, on the same server, graceful
shutdown: SIGTERM lets the in-flight request finish and the server stops."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import floe
from floe import Group, Sample, SamplingParams
from floe.protocol.errors import RemoteUnavailable
from floe.types import THROUGHPUT_METRICS

from .conftest import ServerProcess, free_port, write_config

PROMPTS = [[10, 11, 12, 13], [20, 21], [30, 31, 32]]


def train(client: floe.Client, export: Path, steps: int = 2) -> dict:
    """Sample, score with the reference, PPO+KL step, sync; returns what must match. Odd
    steps run at a caller's learning rate (`optim_step(lr=...)`), even ones at the schedule's."""
    out = {"tokens": [], "losses": [], "grad_norms": [], "versions": [], "lrs": [], "measured": []}
    for step in range(steps):
        res = client.sample(PROMPTS, n=4, params=SamplingParams(max_tokens=6, temperature=0.9))
        batch = []
        for g in res.groups:
            rewards = [float(len(set(s.tokens))) for s in g.samples]
            mean = sum(rewards) / len(rewards)
            batch.append(Group(g.prompt, [Sample(s.tokens, logprobs=s.logprobs, advantage=r - mean) for s, r in zip(g.samples, rewards)]))
        ref = client.forward(batch, zone="reference", temperature=0.9)
        for g, lps in zip(batch, ref.logprobs):
            for s, lp in zip(g.samples, lps):
                s.ref_logprobs = lp
        fb = client.forward_backward(batch, loss="ppo", loss_config={"kl": {"coef": 0.05}}, temperature=0.9)
        st = client.optim_step(lr=3e-4 if step % 2 else None)
        sy = client.sync_weights()
        out["lrs"].append(st.lr)
        out["tokens"].append([s.tokens for g in res.groups for s in g.samples])
        out["losses"].append(fb.metrics["loss"])
        for m in (ref.metrics, fb.metrics):  # the backend's measurement of the call (THROUGHPUT_METRICS)
            assert m["seconds"] > 0 and m["tokens_per_second"] == m["sequence_tokens"] / m["seconds"]
        # What is measured differs run to run (time); what is counted must not.
        out["measured"].append({"forward": (sorted(ref.metrics), ref.metrics["sequence_tokens"], ref.metrics["model_flops"]),
                                "forward_backward": (sorted(k for k in fb.metrics if k in THROUGHPUT_METRICS),
                                                     fb.metrics["sequence_tokens"], fb.metrics["model_flops"])})
        out["grad_norms"].append(st.grad_norm)
        out["versions"].append((st.step, sy.version, res.weights_version))
    client.export_hf(str(export))
    return out


@pytest.fixture(scope="module")
def fresh_server(tmp_path_factory: pytest.TempPathFactory, server_model: Path):
    tmp = tmp_path_factory.mktemp("fresh-server")
    proc = ServerProcess(write_config(tmp / "serve.toml", server_model, tmp / "states"), free_port(), tmp / "server.log").wait_ready()
    yield proc
    proc.stop(signal.SIGKILL)


def test_inprocess_and_http_agree(fresh_server: ServerProcess, server_model: Path, tmp_path: Path) -> None:
    with fresh_server.client() as remote:
        got = train(remote, tmp_path / "remote")
    with floe.connect(floe.BackendConfig(model=str(server_model), state_dir=str(tmp_path / "local-states"), seed=0)) as local:
        want = train(local, tmp_path / "local")

    assert got["tokens"] == want["tokens"]
    assert got["measured"] == want["measured"]
    assert want["measured"][0]["forward"][0] == ["model_flops", "seconds", "sequence_tokens", "tokens_per_second"]  # no peak on CPU: no mfu
    assert got["versions"] == want["versions"] == [(1, 1, 0), (2, 2, 1)]
    assert got["lrs"] == want["lrs"] == [floe.OptimizerConfig().lr, 3e-4]
    for a, b in zip(got["losses"] + got["grad_norms"], want["losses"] + want["grad_norms"]):
        assert abs(a - b) <= 1e-6, (a, b)
    wr, wl = load_file(str(tmp_path / "remote" / "model.safetensors")), load_file(str(tmp_path / "local" / "model.safetensors"))
    assert wr.keys() == wl.keys()
    for name in wr:
        assert torch.allclose(wr[name], wl[name], rtol=0, atol=1e-6), name
    print("max weight difference:", max(float((wr[k] - wl[k]).abs().max()) for k in wr))


def test_sigterm_finishes_in_flight_request_then_stops(fresh_server: ServerProcess) -> None:
    client = fresh_server.client(timeout=60)
    client.info()
    result: dict = {}

    def long_call() -> None:
        result["sample"] = client.sample([[1, 2, 3]], n=8, params=SamplingParams(max_tokens=200, stop_at_eos=False, seed=0))

    worker = threading.Thread(target=long_call)
    worker.start()
    time.sleep(0.5)  # the request is running on the server
    fresh_server.proc.send_signal(signal.SIGTERM)
    worker.join(60)
    assert result["sample"].num_tokens == 8 * 200  # the in-flight request completed
    assert fresh_server.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    with pytest.raises(RemoteUnavailable):
        fresh_server.client(timeout=0.5).info()
