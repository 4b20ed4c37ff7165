"""verl's real entrypoint, `python -m verl.trainer.main_ppo`, on floe: the command line of a
stock GRPO recipe plus the two keys that switch it to floe, run under an outer timeout, and
the per-step metrics parsed from verl's console logger."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).parent
FLOE_SWITCH = ["trainer.v1.trainer_mode=floe", "actor_rollout_ref.rollout.name=floe"]
# The one-key switch on a recipe that keeps verl's vLLM rollout: floe's sampler takes the vLLM
# engine then (verl's environment has no vLLM: the test runs name floe's torch engine instead).
VLLM_RECIPE_SWITCH = ["trainer.v1.trainer_mode=floe", "actor_rollout_ref.rollout.name=vllm"]

# What every run's environment sets (and so the suite's shared Ray cluster's: its workers inherit it).
RUN_ENV = {"CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "disabled", "RAY_DEDUP_LOGS": "0",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
# Logical CPUs of a run's Ray cluster: verl's workers and agent loops fit on the 2 cores; verl's
# one-step off-policy TaskRunner alone asks for 10 (test_one_step.py).
RAY_CPUS = 12


def grpo_recipe(model: Path, train: Path, test: Path, out: Path, steps: int = 3, save_freq: int = -1) -> list[str]:
    """A small GRPO recipe for verl's main_ppo (CPU-sized), validation before training and every 2 steps."""
    return [
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        # CPU precision: fp32 everywhere (verl's default is bf16 compute), so the sampler's and the
        # trainer's log-probs agree to float32 rounding
        "actor_rollout_ref.actor.fsdp_config.dtype=float32", "actor_rollout_ref.ref.fsdp_config.dtype=float32",
        "actor_rollout_ref.rollout.dtype=float32",
        f"trainer.total_training_steps={steps}", "trainer.total_epochs=1",
        "trainer.val_before_train=True", "trainer.test_freq=2", f"trainer.save_freq={save_freq}",
        "trainer.logger=[console]", "trainer.resume_mode=disable", f"trainer.default_local_dir={out}/checkpoints",
        f"data.train_files={train}", f"data.val_files={test}", "data.train_batch_size=4", "data.val_batch_size=8",
        "data.max_prompt_length=192", "data.max_response_length=16", "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.01", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.response_length=16", "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.agent.num_workers=1", "reward.num_workers=1",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        f"reward.custom_reward_function.path={HERE / 'reward_fn.py'}", "reward.custom_reward_function.name=compute_score",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        # a cluster of its own only without $RAY_ADDRESS (the suite's shared cluster, conftest.py, has RAY_CPUS)
        *([] if os.environ.get("RAY_ADDRESS") else [f"+ray_kwargs.ray_init.num_cpus={RAY_CPUS}",
                                                    "+ray_kwargs.ray_init.include_dashboard=False"]),
    ]


@dataclass
class Run:
    returncode: int
    seconds: float
    log: str
    steps: dict[int, dict[str, float]]  # verl's console metrics by training step


_STEP = re.compile(r"step:(\d+) - (.*)")
_PAIR = re.compile(r"([\w/@.\-]+):(-?[\d.]+(?:e[-+]?\d+)?|nan|inf)")


def parse_steps(log: str) -> dict[int, dict[str, float]]:
    """verl's console lines `step:N - key:value - key:value ...` -> {N: {key: value}}."""
    steps: dict[int, dict[str, float]] = {}
    for line in log.splitlines():
        m = _STEP.search(re.sub(r"np\.\w+\(([^()]*)\)", r"\1", line))  # np.float64(0.5) -> 0.5
        if m:
            steps.setdefault(int(m.group(1)), {}).update({k: float(v) for k, v in _PAIR.findall(m.group(2))})
    return steps


# verl 0.9.1 cannot ask for the CPU itself (main_ppo's auto_set_device makes trainer.device "cuda"
# on any machine): the plugin's own backend is told so (floe.integrations.verl.hardware).
ON_CPU = "+floe.backend.device=cpu"


def run_main_ppo(args: list[str], log_path: Path, timeout_s: int = 900, switch: list[str] = FLOE_SWITCH,
                 entrypoint: str = "verl.trainer.main_ppo", cwd: Path | None = None) -> Run:
    """`python -m <entrypoint> ARGS` (verl's main_ppo, or another of verl's entrypoints, e.g.
    `verl.experimental.one_step_off_policy.main_ppo`) with floe's switch keys; killed after
    `timeout_s` (verl waits forever when an agent loop fails, so every run needs an outer timeout).
    `cwd`: where it runs (verl's experimental configs find their base config relative to it)."""
    env = {**os.environ, **RUN_ENV}
    # hydra.run.dir: hydra's own outputs go next to the log, not into the checkout's outputs/
    cmd = ["timeout", "-k", "30", str(timeout_s), sys.executable, "-m", entrypoint, *switch, *args,
           f"hydra.run.dir={log_path.parent / (log_path.stem + '.hydra')}"]
    start = time.monotonic()
    with open(log_path, "wb") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, check=False, cwd=cwd)
    log = log_path.read_text(errors="replace")
    return Run(proc.returncode, time.monotonic() - start, log, parse_steps(log))


def verl_engine_rates(optim: dict, total: int, steps: int | None = None) -> list[float]:
    """The rate of each of `steps` (default `total`) training steps under verl's FSDP engine: the scheduler its
    `_build_lr_scheduler` makes from FSDPOptimizerConfig(**optim, total_training_steps=total) on
    a real AdamW, read before the step's updates and advanced after them (engine_workers)."""
    import torch  # noqa: PLC0415 - verl's environment only
    from verl.workers.config import FSDPOptimizerConfig  # noqa: PLC0415
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine  # noqa: PLC0415

    config = FSDPOptimizerConfig(total_training_steps=total, **optim)
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=config.lr)
    # _build_lr_scheduler reads only these two attributes of the engine
    scheduler = FSDPEngine._build_lr_scheduler(SimpleNamespace(optimizer_config=config, rank=1), opt)
    rates = []
    for _ in range(total if steps is None else steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return rates
