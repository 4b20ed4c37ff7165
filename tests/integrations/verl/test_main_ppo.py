"""verl's real entrypoint on floe: `python -m verl.trainer.main_ppo` with a stock GRPO recipe
(3 steps, validation before training and every 2 steps, a tiny model, generated GSM8K-style
parquet) plus `trainer.v1.trainer_mode=floe actor_rollout_ref.rollout.name=floe` — once on the
plugin's own backend, once against a `floe serve` process on loopback. The first run also sets
a warm-up + cosine LR schedule: each step's updates run at the rate verl's own scheduler gives
that step, and `actor/lr` is the rate after it, as verl logs it; and verl's rollout correction
(token TIS + token rejection), which verl's trainer computes and the plugin applies. Runs in verl's environment
(scripts/ci/verl.sh); each run is under an outer timeout."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.integrations.verl.assets import make_data, make_model
from tests.integrations.verl.run import Run, grpo_recipe, run_main_ppo, verl_engine_rates

pytestmark = [pytest.mark.verl, pytest.mark.timeout(1200)]

STEPS = 3
TRAIN_SEQUENCES = 4 * 2  # data.train_batch_size x rollout.n, per step
VAL_SEQUENCES = 8  # val_batch_size prompts x val_kwargs.n (1), per validation
VALIDATIONS = 3  # before training, at step 2 (test_freq) and at the last step
MINI_BATCHES = TRAIN_SEQUENCES // (2 * 2)  # ppo_mini_batch_size x n per mini-batch


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("verl")
    train, test = make_data(root / "data")
    return {"root": root, "model": make_model(root / "tiny"), "train": train, "test": test}


def check_run(run: Run) -> dict[str, float]:
    """What every run must show; returns the last step's metrics."""
    assert run.returncode == 0, run.log[-6000:]
    assert sorted(run.steps) == list(range(STEPS + 1)), run.log[-3000:]  # step 0: validation before training
    for step, m in ((s, run.steps[s]) for s in range(1, STEPS + 1)):
        # verl's own sampler-vs-trainer check: floe's sampler and policy agree on every token.
        assert m["training/rollout_probs_diff_max"] < 1e-4, (step, m["training/rollout_probs_diff_max"])
        assert m["actor/grad_norm"] > 0, (step, m)
        assert m["training/off_policy/trajectory_staleness/max"] == 0  # versions echo verl's steps
    # A reward that reads the model's output: advantages are not all zero.
    assert any(run.steps[s]["critic/advantages/max"] > 0 or run.steps[s]["critic/advantages/min"] < 0
               for s in range(1, STEPS + 1))
    assert any("val-core/openai/gsm8k" in k for k in run.steps[STEPS])  # validation ran through floe
    last = run.steps[STEPS]
    assert last["floe/calls/forward"] == 2 * STEPS  # policy + reference log-probs per step
    assert last["floe/calls/forward_backward"] == last["floe/calls/optim_step"] == MINI_BATCHES * STEPS
    assert last["floe/calls/sync_weights"] == STEPS + 1  # one at init, one after every step
    # Counted at the end of the last step, before its validation runs.
    assert last["floe/calls/sampled_sequences"] == STEPS * TRAIN_SEQUENCES + (VALIDATIONS - 1) * VAL_SEQUENCES
    assert 1 <= last["floe/calls/sample"] <= last["floe/calls/sampled_sequences"] / 2  # requests were batched
    return last


SCHEDULE = {"lr_scheduler_type": "cosine", "lr_warmup_steps": 2, "min_lr_ratio": 0.1}


# verl's rollout correction (decoupled): token TIS + token-level rejection, computed by verl's trainer.
ROLLOUT_CORRECTION = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1",
                      "rollout_rs_threshold": "0.5_2.0"}


def test_main_ppo_on_the_plugins_own_backend(assets):
    out = assets["root"] / "own"
    schedule = [f"actor_rollout_ref.actor.optim.{k}={v}" for k, v in SCHEDULE.items()]
    correction = [f"algorithm.rollout_correction.{k}={v}" for k, v in ROLLOUT_CORRECTION.items()]
    run = run_main_ppo(grpo_recipe(assets["model"], assets["train"], assets["test"], out, save_freq=STEPS)
                       + schedule + correction, assets["root"] / "own.log")
    print(f"verl main_ppo on floe (own backend): {run.seconds:.0f} s")
    check_run(run)
    for s in range(1, STEPS + 1):  # verl's trainer made the weights (the plugin read them) and the mask
        m = run.steps[s]
        # floe's sampler and policy agree on every token: weights 1, nothing rejected
        assert m["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3), (s, m)
        assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0, (s, m)
    # verl's V1 sets total = steps x sync step (1); one rate more: the one actor/lr reports after the last step
    rates = verl_engine_rates({"lr": 1e-3, **SCHEDULE}, total=STEPS, steps=STEPS + 1)
    assert [run.steps[s]["actor/floe/applied_lr"] for s in range(1, STEPS + 1)] == pytest.approx(rates[:STEPS], rel=1e-9)
    assert [run.steps[s]["actor/lr"] for s in range(1, STEPS + 1)] == pytest.approx(rates[1:], rel=1e-9)
    assert rates[0] == 0.0 and rates[2] == pytest.approx(1e-3)  # the warm-up starts at 0 and reaches lr
    assert re.search(r"floe backend at http://127\.0\.0\.1:\d+ \(started by the plugin\)", run.log)
    # verl's checkpoint at the last step names the floe state the plugin saved for it.
    marker = json.loads((out / "checkpoints" / f"global_step_{STEPS}" / "actor" / "floe_state.json").read_text())
    assert marker["state"] == f"verl_step_{STEPS}" and marker["step"] == MINI_BATCHES * STEPS
    assert marker["lr_scheduler_steps"] == STEPS
    assert (out / "checkpoints" / "floe_state" / marker["state"]).is_dir()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _counter(metrics: str, route: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith("floe_http_requests_total{") and f'route="{route}"' in line and 'status="200"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_main_ppo_against_floe_serve(assets):
    root = assets["root"]
    config = root / "serve.toml"
    config.write_text(f'[backend]\nmodel = "{assets["model"]}"\nstate_dir = "{root / "serve-states"}"\n'
                      "[backend.optimizer]\nlr = 1e-3\n")
    port, token = _free_port(), "verl-test-token"
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "FLOE_TOKEN": token}
    with open(root / "serve.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "floe.server", str(config), "--port", str(port)],
                                  stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, (root / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "floe serve not ready"
            time.sleep(0.3)
        args = grpo_recipe(assets["model"], assets["train"], assets["test"], root / "remote") + [f"+floe.url={url}"]
        old = os.environ.get("FLOE_TOKEN")
        os.environ["FLOE_TOKEN"] = token  # the plugin reads it: the token stays off the command line
        try:
            run = run_main_ppo(args, root / "remote.log")
        finally:
            if old is None:
                os.environ.pop("FLOE_TOKEN")
            else:
                os.environ["FLOE_TOKEN"] = old
        print(f"verl main_ppo on floe (floe serve): {run.seconds:.0f} s")
        check_run(run)
        assert f"floe backend at {url} (given)" in run.log
        # The server itself saw the work: its own request counters and versions.
        metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10).text
        assert _counter(metrics, "/api/forward") == 2 * STEPS
        assert _counter(metrics, "/api/forward_backward") == _counter(metrics, "/api/optim_step") == MINI_BATCHES * STEPS
        assert _counter(metrics, "/api/sync_weights") == STEPS + 1
        assert _counter(metrics, "/api/sample") >= 1
        assert re.search(r"^floe_policy_step (\S+)", metrics, re.MULTILINE).group(1) == f"{float(MINI_BATCHES * STEPS)}"
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
