"""verl's real entrypoint on floe: `python -m verl.trainer.main_ppo` with a stock GRPO recipe
(3 steps, validation before training and every 2 steps, a tiny model, generated GSM8K-style
parquet) switched to floe — once on the plugin's own backend with the one-key switch
(`trainer.v1.trainer_mode=floe`, the recipe's rollout.name=vllm kept), once against a `floe serve`
process on loopback with `actor_rollout_ref.rollout.name=floe` as well. The first run also sets
a warm-up + cosine LR schedule: each step's updates run at the rate verl's own scheduler gives
that step, and `actor/lr` is the rate after it, as verl logs it; and verl's rollout correction
(token TIS + token rejection), which verl's trainer computes and the plugin applies. Runs in verl's environment
(scripts/ci/verl.sh); each run is under an outer timeout."""

from __future__ import annotations

import json
import math
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
from tests.integrations.verl.run import ON_CPU, VLLM_RECIPE_SWITCH, Run, grpo_recipe, run_main_ppo, verl_engine_rates

pytestmark = [pytest.mark.verl, pytest.mark.timeout(1200)]

STEPS = 3
TRAIN_SEQUENCES = 4 * 2  # data.train_batch_size x rollout.n, per step
VAL_SEQUENCES = 8  # val_batch_size prompts x val_kwargs.n (1), per validation
VALIDATIONS = 3  # before training, at step 2 (test_freq) and at the last step
MINI_BATCHES = TRAIN_SEQUENCES // (2 * 2)  # ppo_mini_batch_size x n per mini-batch


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory, shared_ray: str) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("verl")
    train, test = make_data(root / "data")
    return {"root": root, "model": make_model(root / "tiny"), "train": train, "test": test}


def check_throughput(step: int, m: dict[str, float], peak_tflops: float, model: Path) -> None:
    """The actor's throughput metrics (floe.integrations.verl.throughput), from the step's own
    logged numbers: tokens/s = tokens / floe's measured seconds; the tokens are the step's
    sequences as verl counts them; verl's FlopsCounter TFLOP/s lies between its values for
    the step's token total spread evenly and packed into the longest sequences; mfu = TFLOP/s /
    peak on one device (0 when the peak is unknown, as verl logs an unknown device)."""
    from transformers import AutoConfig  # noqa: PLC0415
    from verl.utils.flops_counter import ESTIMATE_FUNC  # noqa: PLC0415

    def tflops(seqlens: list[float]) -> float:  # FlopsCounter.estimate_flops(seqlens, seconds)[0], verl's own estimator
        return ESTIMATE_FUNC["qwen3"](config, sum(seqlens), seqlens, seconds)

    seconds, tokens = m["actor/floe/update_seconds"], m["actor/floe/update_tokens"]
    assert 0 < seconds < m["timing_s/update_actor"], (step, m)
    assert tokens == m["perf/total_num_tokens"], (step, m)  # one epoch: every sequence once
    assert m["actor/floe/tokens_per_second"] == pytest.approx(tokens / seconds, rel=1e-5)
    config = AutoConfig.from_pretrained(model)
    longest = 192 + 16  # data.max_prompt_length + response_length
    even = tflops([tokens / TRAIN_SEQUENCES] * TRAIN_SEQUENCES)
    packed = tflops([longest] * int(tokens // longest) + [tokens % longest])
    assert even * (1 - 1e-5) <= m["actor/floe/tflops"] <= packed * (1 + 1e-5), (step, even, m["actor/floe/tflops"], packed)
    assert m["actor/floe/peak_tflops"] == peak_tflops
    mfu = m["perf/mfu/actor"]
    assert math.isfinite(mfu)
    if peak_tflops:
        assert mfu > 0 and mfu == pytest.approx(m["actor/floe/tflops"] / peak_tflops, rel=1e-5), (step, m)
    else:
        assert mfu == 0.0


def check_run(run: Run, model: Path, peak_tflops: float = 0.0) -> dict[str, float]:
    """What every run must show; returns the last step's metrics."""
    assert run.returncode == 0, run.log[-6000:]
    assert sorted(run.steps) == list(range(STEPS + 1)), run.log[-3000:]  # step 0: validation before training
    for step, m in ((s, run.steps[s]) for s in range(1, STEPS + 1)):
        # verl's own sampler-vs-trainer check: floe's sampler and policy agree on every token.
        assert m["training/rollout_probs_diff_max"] < 1e-4, (step, m["training/rollout_probs_diff_max"])
        assert m["actor/grad_norm"] > 0, (step, m)
        assert m["training/off_policy/trajectory_staleness/max"] == 0  # versions echo verl's steps
        check_throughput(step, m, peak_tflops, model)
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
PEAK_TFLOPS = 0.05


# verl's rollout correction (decoupled): token TIS + token-level rejection, computed by verl's trainer.
ROLLOUT_CORRECTION = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1",
                      "rollout_rs_threshold": "0.5_2.0"}


def test_main_ppo_on_the_plugins_own_backend(assets):
    out = assets["root"] / "own"
    schedule = [f"actor_rollout_ref.actor.optim.{k}={v}" for k, v in SCHEDULE.items()]
    # The recipe keeps verl's rollout.name=vllm (the one-key switch); verl's environment has no
    # vLLM, so floe's torch engine stands in for it. A peak for the plugin's CPU backend, so
    # perf/mfu/actor is a real ratio (the serve run has none: 0). verl's rollout correction
    # (decoupled: token TIS + token_k1 rejection) computed by verl's trainer on floe's log-probs.
    correction = [f"algorithm.rollout_correction.{k}={v}" for k, v in ROLLOUT_CORRECTION.items()]
    run = run_main_ppo(grpo_recipe(assets["model"], assets["train"], assets["test"], out, save_freq=STEPS) + schedule
                       + correction + [ON_CPU, "+floe.backend.sampler.engine.name=torch",
                                       f"+floe.backend.compute.peak_tflops={PEAK_TFLOPS}"], assets["root"] / "own.log",
                       switch=VLLM_RECIPE_SWITCH)
    print(f"verl main_ppo on floe (own backend): {run.seconds:.0f} s")
    check_run(run, assets["model"], PEAK_TFLOPS)
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
    # the recipe's own device, precision and memory keys set the backend (hardware.py)
    assert ("floe backend settings: device=cpu dtype=float32 engine=torch placement=local "
            "gradient_checkpointing=True") in run.log
    # verl's checkpoint at the last step names the floe state the plugin saved for it.
    marker = json.loads((out / "checkpoints" / f"global_step_{STEPS}" / "actor" / "floe_state.json").read_text())
    assert marker["state"] == f"verl_step_{STEPS}" and marker["step"] == MINI_BATCHES * STEPS
    assert marker["lr_scheduler_steps"] == STEPS
    assert (out / "checkpoints" / "floe_state" / marker["state"]).is_dir()
    # trainer mode floe is verl's synchronous trainer: no TransferQueue in its checkpoints (verl's
    # async modes save one) and the sync replay buffer's gen_batch_size (async modes force 1)
    assert not (out / "checkpoints" / f"global_step_{STEPS}" / "transfer_queue").exists()
    assert "gen_batch_size defaulted to 1" not in run.log and "is overridden to 1" not in run.log
    # verl's actor/pg_loss is the policy term alone; floe's whole loss adds the KL term (use_kl_loss),
    # non-zero once the weights moved (the warm-up's first rate is 0: by the last step they have)
    last = run.steps[STEPS]
    assert last["actor/floe/loss"] - last["actor/pg_loss"] > 0, last


def test_a_gpu_recipe_without_a_gpu_is_refused_before_anything_starts(assets):
    """The recipe as it would run on a GPU box (trainer.device=cuda, no floe device key) on this
    CPU machine: main_ppo exits with floe's error naming trainer.device (the Ray cluster verl
    started has no GPU) before any model loads, not a CUDA traceback later."""
    args = grpo_recipe(assets["model"], assets["train"], assets["test"], assets["root"] / "gpu") + ["trainer.device=cuda"]
    run = run_main_ppo(args, assets["root"] / "gpu.log", timeout_s=400, switch=VLLM_RECIPE_SWITCH)
    assert run.returncode not in (0, 124, 137), run.log[-3000:]
    assert "InvalidInput" in run.log and "trainer.device" in run.log and "the Ray cluster has 0" in run.log
    assert "+floe.backend.device=cpu" in run.log, run.log[-3000:]
    assert not run.steps  # no training step ran


def test_main_ppo_with_a_batch_statistic_loss(assets):
    """loss_mode=kl_cov (tokens chosen by covariance over the whole forward_backward call, a
    pre-pass inside floe): verl's config reaches the plugin's mapping and the run trains."""
    out = assets["root"] / "kl_cov"
    extra = ["actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov", "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.2",
             "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"]
    run = run_main_ppo(grpo_recipe(assets["model"], assets["train"], assets["test"], out) + extra + [ON_CPU],
                       assets["root"] / "kl_cov.log")
    print(f"verl main_ppo on floe (kl_cov): {run.seconds:.0f} s")
    check_run(run, assets["model"])
    # floe's clip_fraction is kl_cov's share of penalised tokens: 0.2 of each mini-batch's tokens, rounded down
    assert all(0 < run.steps[s]["actor/pg_clipfrac"] <= 0.2 for s in range(1, STEPS + 1))


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
        # The plugin reads $FLOE_TOKEN in verl's TaskRunner, a Ray worker: the token stays off the
        # command line, so this run starts a Ray cluster of its own (workers of the suite's shared
        # cluster were started before the variable was set; docs/integrations.md).
        saved = {k: os.environ.pop(k, None) for k in ("RAY_ADDRESS", "FLOE_TOKEN")}
        os.environ["FLOE_TOKEN"] = token
        try:
            args = grpo_recipe(assets["model"], assets["train"], assets["test"], root / "remote") + [f"+floe.url={url}"]
            run = run_main_ppo(args, root / "remote.log")
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None)
                if v is not None:
                    os.environ[k] = v
        print(f"verl main_ppo on floe (floe serve): {run.seconds:.0f} s")
        check_run(run, assets["model"])
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
