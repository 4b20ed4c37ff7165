"""Must-shows 4 and 5 through the command line: `floe train RECIPE @ recipes/overlays/ray.toml`
follows the local run's reward curve (and `--resume` continues a local run under Ray), and
`floe serve ... @ recipes/overlays/ray.toml` answers the client API over HTTP on loopback like a
local backend, and `--resume-latest` continues from the last state on a fresh cluster.

The subprocesses start their own Ray cluster (placement.address = "local"): the overlay's
logical CPU shares (0.25 per worker) fit this 2-core machine."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import floe
from floe import Group, Sample, SamplingParams
from tests.server.conftest import ServerProcess, free_port

REPO = Path(__file__).resolve().parents[2]
OVERLAY = str(REPO / "recipes" / "overlays" / "ray.toml")
RECIPE = str(REPO / "recipes" / "reverse_text.toml")
STEPS = 4
SHORT = ["--train.steps", str(STEPS), "--train.groups_per_step", "8", "--eval.every", str(STEPS), "--eval.size", "8",
         "--output.checkpoint_every", "2", "--no-progress"]
REWARD_MARGIN = 0.02
# A process that started Ray has Ray's SIGTERM handler (it exits with status 15 after cleaning
# up); uvicorn hands the signal on to it once its graceful shutdown has finished.
STOPPED = (0, 15)


def train(run_dir: Path, *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "floe.cli", "train", RECIPE, *extra, *SHORT, "--output.run_dir", str(run_dir)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900, cwd=run_dir.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def curve(rows: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in rows if key in r}


def test_floe_train_with_the_ray_overlay_follows_the_local_run(tmp_path: Path) -> None:
    local = train(tmp_path / "local")
    on_ray = train(tmp_path / "ray", "@", OVERLAY)
    a, b = curve(local, "reward_mean"), curve(on_ray, "reward_mean")
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:  # same seeds, same numbers up to fp32 rounding: the curves coincide
        assert abs(a[step] - b[step]) <= REWARD_MARGIN, (step, a[step], b[step])
    assert curve(local, "eval/reward_mean") == pytest.approx(curve(on_ray, "eval/reward_mean"), abs=REWARD_MARGIN)

    # --resume across placements: the local run continues under Ray from its last checkpoint.
    more = [*SHORT]
    more[more.index("--train.steps") + 1] = str(STEPS + 2)
    cmd = [sys.executable, "-m", "floe.cli", "train", RECIPE, "@", OVERLAY, *more, "--output.run_dir",
           str(tmp_path / "local"), "--resume"]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "local" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "reward_mean" in r]
    assert steps == list(range(1, STEPS + 3))  # no step repeated, none skipped


PROMPTS = [[8, 9, 10], [11, 12]]


def api_session(client: floe.Client) -> dict:
    out = client.sample(PROMPTS, n=3, params=SamplingParams(max_tokens=5, seed=7))
    batch = [Group(g.prompt, [Sample(s.tokens, logprobs=s.logprobs, advantage=float(j) - 1.0) for j, s in enumerate(g.samples)])
             for g in out.groups]
    loss = client.forward_backward(batch, loss="ppo").metrics["loss"]
    step = client.optim_step()
    sync = client.sync_weights()
    ref = client.forward(batch, zone="reference")
    client.save_state("after-step-1")
    return {"tokens": [s.tokens for g in out.groups for s in g.samples], "loss": loss, "grad_norm": step.grad_norm,
            "step": step.step, "version": sync.version, "ref": ref.logprobs}


def test_floe_serve_with_the_ray_overlay_answers_like_a_local_backend(tmp_path: Path, tiny_model: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(f'[backend]\nmodel = "{tiny_model}"\nstate_dir = "{tmp_path / "states"}"\nseed = 0\nnum_threads = 1\n')
    port = free_port()
    server = ServerProcess(config, port, tmp_path / "ray-server.log", "@", OVERLAY, "--resume-latest")
    try:
        server.wait_ready(timeout=240)
        client = server.client(timeout=240)
        info = client.info()
        assert info.capabilities["placement"]["kind"] == "ray"
        assert info.capabilities["placement"]["policy_ranks"] == 2
        remote = api_session(client)
        client.close()
    finally:
        assert server.stop(signal.SIGTERM, timeout=120) in STOPPED

    local = floe.connect(floe.BackendConfig(model=str(tiny_model), state_dir=str(tmp_path / "local-states"), seed=0))
    expected = api_session(local)
    local.close()
    assert remote["tokens"] == expected["tokens"]
    assert (remote["step"], remote["version"]) == (expected["step"], expected["version"]) == (1, 1)
    assert remote["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert remote["grad_norm"] == pytest.approx(expected["grad_norm"], abs=1e-5)
    for a, b in zip(remote["ref"], expected["ref"]):
        for x, y in zip(a, b):
            assert x == pytest.approx(y, abs=1e-5)

    # A fresh server (and a fresh Ray cluster) with --resume-latest continues from the saved state.
    again = ServerProcess(config, free_port(), tmp_path / "ray-server-2.log", "@", OVERLAY, "--resume-latest")
    try:
        again.wait_ready(timeout=240)
        client = again.client(timeout=240)
        info = client.info()
        assert (info.step, info.sampler_version) == (1, 1)
        client.close()
    finally:
        assert again.stop(signal.SIGTERM, timeout=120) in STOPPED
