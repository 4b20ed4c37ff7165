"""SkyRL's real entrypoint with the one-line switch to floe: 3 GRPO steps with eval, embedded
and against a `floe serve` process on loopback.

    python -m skyrl.train.entrypoints.main_base trainer.override_entrypoint=floe.integrations.skyrl.entrypoint ...

runs SkyRL 0.4.0's own dataset, SkyRLGymGenerator, skyrl-gym environment, GRPO advantages,
loss reduction and RayPPOTrainer loop on a tiny model. Asserted: exit 0; floe's call counts;
SkyRL's own sampler-vs-trainer log-prob gap `policy/rollout_train_logprobs_abs_diff_mean`
below 1e-4 at every step; a reward that depends on the model's output (non-zero, varying, so
advantages and gradients are non-zero); eval metrics before training and at step 2. The
embedded run sets off-policy correction (deprecated use_tis + a geometric sequence mask) and
finds SkyRL's correction metrics at every step. The
`floe serve` run also keeps a warm-up + cosine LR schedule: the rate floe applied at each
step's last optimizer step is the one SkyRL's own scheduler gives it. A dppo run takes its
ratio against the rollout log-probs (SkyRL skips the policy forward).
Runs only in the SkyRL environment (scripts/ci/skyrl.sh, marker `skyrl`).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

from floe.compute.flops import TransformerShape, training_flops
from tests.integrations.skyrl.assets import REPO, STOCK_GPUS, run_env, skyrl_rates
from tests.server.conftest import ServerProcess, free_port, write_config

pytestmark = pytest.mark.skyrl

STEPS = 3
TRAIN_BATCH, MINI_BATCH, N_SAMPLES = 4, 2, 2
RUN_TIMEOUT_S = 900
PEAK_TFLOPS = 0.05  # the embedded run's configured peak (the serve run has none)


def recipe_args(assets: dict[str, Path], out: Path) -> list[str]:
    """A small GRPO recipe for SkyRL's main_base on this CPU machine (model, data, sizes, device)."""
    return [
        "floe.import_modules=[tests.integrations.skyrl.shaped_env]",
        f"data.train_data=['{assets['train']}']", f"data.val_data=['{assets['val']}']",
        f"trainer.policy.model.path={assets['model']}",
        "trainer.placement.colocate_all=false", "trainer.strategy=fsdp", "trainer.flash_attn=false",
        # CPU precision: fp32 (SkyRL's default is bf16), so sampler and trainer log-probs agree to fp32 rounding
        "trainer.bf16=false", "generator.inference_engine.model_dtype=float32",
        f"trainer.train_batch_size={TRAIN_BATCH}", f"trainer.policy_mini_batch_size={MINI_BATCH}",
        "trainer.micro_train_batch_size_per_gpu=2", "trainer.micro_forward_batch_size_per_gpu=2",
        "trainer.epochs=1", f"trainer.max_training_steps={STEPS}",
        "trainer.eval_interval=2", "trainer.eval_before_train=true", "trainer.eval_batch_size=8",
        "trainer.ckpt_interval=-1", "trainer.hf_save_interval=-1", "trainer.resume_mode=none",
        f"trainer.ckpt_path={out / 'ckpt'}", f"trainer.export_path={out / 'export'}", f"trainer.log_path={out / 'logs'}",
        "trainer.logger=console", "trainer.enable_ray_gpu_monitor=false", "trainer.max_prompt_length=192",
        "trainer.algorithm.advantage_estimator=grpo", "trainer.algorithm.use_kl_loss=true",
        "trainer.algorithm.kl_loss_coef=0.01", "trainer.policy.optimizer_config.lr=1e-3",
        f"generator.n_samples_per_prompt={N_SAMPLES}", "generator.sampling_params.max_generate_length=16",
        "generator.eval_sampling_params.max_generate_length=16",
        "environment.env_class=gsm8k_shaped", "environment.skyrl_gym.max_env_workers=1", "data.dataloader.num_workers=0",
    ]


def run_skyrl(assets: dict[str, Path], out: Path, *extra: str, args: list[str] | None = None,
              timeout_s: int = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """SkyRL's command line (`args`, default `recipe_args`) plus the override (and `extra` keys),
    under an outer timeout; its output also in `out`/run.log."""
    cmd = [sys.executable, "-m", "skyrl.train.entrypoints.main_base",
           "trainer.override_entrypoint=floe.integrations.skyrl.entrypoint",
           *(recipe_args(assets, out) if args is None else args), *extra]
    proc = subprocess.run(["timeout", str(timeout_s), *cmd], check=False, cwd=REPO, env=run_env(), capture_output=True,
                          text=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.log").write_text(proc.stdout + proc.stderr)
    return proc


def check_throughput(r: dict[str, float], model: Path, peak_tflops: float) -> None:
    """floe's throughput of a training step (FloeDispatch.step_throughput), from its own logged
    numbers: tokens/s = tokens / floe's measured seconds; the tokens are those SkyRL's own
    trainer/tokens_per_second_per_gpu counts (× its timer); floe's model TFLOP/s lies between
    the formula's values for the step's tokens spread evenly and packed into the longest
    sequences; floe/mfu = TFLOP/s / peak on one device, absent when the peak is unknown."""
    seconds, tokens = r["floe/train_seconds"], r["floe/train_tokens"]
    assert 0 < seconds < r["timing/train_critic_and_policy"], r
    assert r["floe/tokens_per_second"] == pytest.approx(tokens / seconds, rel=1e-12)
    skyrl_tokens = r["trainer/tokens_per_second_per_gpu"] * r["timing/train_critic_and_policy"]  # 1 device
    assert tokens == pytest.approx(skyrl_tokens, rel=1e-9), r
    shape = TransformerShape.from_config(AutoConfig.from_pretrained(model))
    assert shape is not None
    n, longest = TRAIN_BATCH * N_SAMPLES, 192 + 16  # sequences per step; max_prompt_length + max_generate_length
    even = training_flops(shape, [tokens / n] * n) / seconds / 1e12
    packed = training_flops(shape, [longest] * int(tokens // longest) + [tokens % longest]) / seconds / 1e12
    assert even * (1 - 1e-9) <= r["floe/model_tflops"] <= packed * (1 + 1e-9), (even, r["floe/model_tflops"], packed)
    assert r["floe/peak_tflops"] == pytest.approx(peak_tflops, rel=1e-12)
    if peak_tflops:
        assert r["floe/mfu"] == pytest.approx(r["floe/model_tflops"] / peak_tflops, rel=1e-9) and r["floe/mfu"] > 0
    else:
        assert "floe/mfu" not in r


def check_run(proc: subprocess.CompletedProcess[str], out: Path, model: Path, lrs: list[float] | None = None,
              peak_tflops: float = 0.0, policy_forward: bool = True) -> dict[str, int]:
    """`lrs`: when given, the rate of every optimizer step; each training step logs its last one.
    `peak_tflops`: the backend's configured peak (0: none, so no floe/mfu). `policy_forward`:
    SkyRL computes old log-probs (False: a loss on the rollout log-probs)."""
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    calls = json.loads((out / "export" / "floe_calls.json").read_text())
    mini_batches = STEPS * TRAIN_BATCH // MINI_BATCH
    assert calls["forward_backward"] == calls["optim_step"] == mini_batches, calls
    # per step: one reference forward of the whole batch + one policy forward per mini-batch
    assert calls["forward"] == STEPS * (1 + (TRAIN_BATCH // MINI_BATCH if policy_forward else 0)), calls
    assert calls["sync_weights"] == STEPS, calls  # after each step; the first sampler already has the weights
    assert 0 < calls["sample"] <= STEPS * TRAIN_BATCH * N_SAMPLES + 3 * 8 * 1, calls

    records = [json.loads(line) for line in (out / "export" / "floe_metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "policy/final_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        # SkyRL's old-vs-rollout gap (not logged when it skips the policy forward: no old log-probs;
        # the plugin then had only the rollout log-probs to send, or it would have raised)
        if policy_forward:
            assert r["policy/rollout_train_logprobs_abs_diff_mean"] < 1e-4, r
        assert r["reward/avg_raw_reward"] > 0, r  # the shaped reward reads the model's text
        assert r["policy/grad_norm"] > 0, r  # non-zero advantages reached the loss
        # The loss itself may be exactly 0 at ratio 1: with group-normalised advantages (zero mean
        # per group) and every response the same length (all hit max_tokens), the token-mean
        # policy loss is -mean(A) = 0 while its gradient is not (seen in CI, 2026-12-07).
        assert math.isfinite(r["policy/final_loss"]), r
        # SkyRL's own loss metrics: the policy term, and the KL term's value (k3 here: non-negative)
        assert math.isfinite(r["policy/policy_loss"]) and r["policy/policy_kl"] >= 0, r
        check_throughput(r, model, peak_tflops)
    if lrs is not None:
        per_step = TRAIN_BATCH // MINI_BATCH
        assert [r["policy/policy_lr"] for r in train] == pytest.approx(lrs[per_step - 1 :: per_step], rel=1e-12, abs=0.0)
    assert any(r["step"] == 0 and any(k.startswith("eval/") for k in r) for r in records)  # eval before training
    assert any(r["step"] == 2 and any(k.startswith("eval/") for k in r) for r in records)  # eval_interval=2
    return calls


# SkyRL has no CPU mode: floe.backend.device=cpu; SkyRL's environment has no vLLM, so floe's
# torch engine stands in for the recipe's (default) vllm backend.
ON_CPU = ("floe.backend.device=cpu", "floe.backend.sampler.engine.name=torch")


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_skyrl_main_base_with_embedded_floe(assets: dict[str, Path], tmp_path: Path) -> None:
    # Off-policy correction: the deprecated use_tis (validate_cfg turns it into token TIS) + a geometric sequence mask.
    correction = ["trainer.algorithm.use_tis=true", "trainer.algorithm.tis_imp_ratio_cap=2.0",
                  "trainer.algorithm.off_policy_correction.sequence_mask_metric=geometric"]
    # the stock recipes' GPU counts (4 per role): with floe.backend.device=cpu they ask floe for nothing
    proc = run_skyrl(assets, tmp_path, *ON_CPU, f"floe.backend.compute.peak_tflops={PEAK_TFLOPS}", *correction,
                     *STOCK_GPUS)
    check_run(proc, tmp_path, assets["model"], peak_tflops=PEAK_TFLOPS)
    log = (tmp_path / "run.log").read_text()
    assert "floe backend settings: device=cpu dtype=float32 engine=torch placement=local" in log, log[-3000:]
    records = [json.loads(line) for line in (tmp_path / "export" / "floe_metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "policy/rollout_train_logprobs_abs_diff_mean" in r]
    assert train
    for r in train:  # SkyRL's compute_off_policy_correction ran on every mini-batch
        # floe's sampler and policy agree on every token: ratios 1, nothing masked, nothing capped
        assert r["policy/loss_metrics/is_ratio_mean"] == pytest.approx(1.0, abs=1e-3), r
        assert r["policy/loss_metrics/geo_sequence_mask_masked_ratio"] == 0.0, r
        assert r["policy/loss_metrics/tis_token_clip_high_ratio"] == 0.0, r


@pytest.mark.timeout(300)
def test_a_gpu_recipe_without_a_gpu_is_refused_before_anything_starts(assets: dict[str, Path], tmp_path: Path) -> None:
    """SkyRL's recipe as on a GPU box (no floe device key, the stock recipes' 4 GPUs per role) on
    this CPU machine: exits with floe's error naming the placement key before any model loads
    (not after SkyRL's 180 s wait for a 2-GPU node, which its NCCL probe would start)."""
    proc = run_skyrl(assets, tmp_path, *STOCK_GPUS)
    log = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124), log[-3000:]
    assert "InvalidInput" in log and "trainer.placement.policy_num_gpus_per_node" in log, log[-3000:]
    assert "the Ray cluster has 0" in log and "floe.backend.device=cpu" in log, log[-3000:]
    assert not (tmp_path / "export" / "floe_metrics.jsonl").exists()


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_skyrl_main_base_dppo_on_the_rollout_log_probs(assets: dict[str, Path], tmp_path: Path) -> None:
    """policy_loss_type=dppo with the generator's log-probs: SkyRL skips the policy forward
    (RayPPOTrainer._skip_policy_forward), so the batches carry no old log-probs and the plugin
    sends the rollout log-probs as the samples' log-probs, as SkyRL's dppo_policy_loss uses them."""
    proc = run_skyrl(assets, tmp_path, "trainer.algorithm.policy_loss_type=dppo", "trainer.algorithm.dppo.delta_low=0.01",
                     "trainer.algorithm.dppo.delta_high=0.01", "generator.sampling_params.logprobs=0", *ON_CPU)
    check_run(proc, tmp_path, assets["model"], policy_forward=False)


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_skyrl_main_base_against_floe_serve(assets: dict[str, Path], tmp_path: Path) -> None:
    port, token = free_port(), "skyrl-test-token"
    config = write_config(tmp_path / "server.toml", assets["model"], tmp_path / "states")
    server = ServerProcess(config, port, tmp_path / "server.log", token=token).wait_ready()
    try:
        schedule = ["trainer.policy.optimizer_config.scheduler=cosine", "trainer.policy.optimizer_config.num_warmup_steps=3"]
        proc = run_skyrl(assets, tmp_path, f"floe.url={server.url}", f"floe.token={token}", *schedule)
        check_run(proc, tmp_path, assets["model"], lrs=skyrl_rates("cosine", lr=1e-3, warmup=3, total=STEPS * TRAIN_BATCH // MINI_BATCH))
        assert server.alive()
        info = server.client().info()
        assert info.step == STEPS * TRAIN_BATCH // MINI_BATCH  # the server's policy took every optimizer step
        assert info.sampler_version == STEPS  # the last sync carried SkyRL's step as the version
    finally:
        server.stop()
