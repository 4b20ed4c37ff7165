"""Inputs for the SkyRL plugin's end-to-end runs: a tiny model and GSM8K-style parquet files.

`make_parquet` writes rows in SkyRL's dataset format (chat `prompt`, `env_class`,
`reward_spec.ground_truth`, `data_source`, `extra_info`) for generated two-number sums;
`skyrl_rates` is the learning rate of each optimizer step as SkyRL's own scheduler gives it;
`run_env` is the environment of every SkyRL run (and of the suite's shared Ray cluster).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def run_env() -> dict[str, str]:
    """A SkyRL run's environment: this one, with the checkout importable (`tests.integrations...`
    modules named in the recipes), no GPU, no W&B, Ray's logs not deduplicated. The suite's Ray
    cluster (conftest.py) has it too: its workers inherit it, as from a driver that starts Ray."""
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "disabled", "RAY_DEDUP_LOGS": "0"}


def make_parquet(path: Path, rows: int, seed: int, env_class: str = "gsm8k_shaped") -> Path:
    """`rows` questions "What is a + b?" with their answer as ground truth."""
    import pandas as pd  # noqa: PLC0415 - only the SkyRL environment (which has pandas) writes these files
    rng = random.Random(seed)
    records = []
    for i in range(rows):
        a, b = rng.randrange(10, 50), rng.randrange(10, 50)
        question = f"What is {a} + {b}? End with #### and the number."
        records.append({
            "data_source": "synthetic_gsm8k",
            "prompt": [{"role": "user", "content": question}],
            "env_class": env_class,
            "reward_spec": {"method": "rule", "ground_truth": str(a + b)},
            "extra_info": {"index": i},
        })
    pd.DataFrame(records).to_parquet(path)
    return path


def skyrl_rates(scheduler: str, lr: float, warmup: int, total: int) -> list[float]:
    """The rate of each optimizer step under SkyRL's FSDP strategy: its get_scheduler call, stepped
    after every optimizer step."""
    import torch  # noqa: PLC0415 - keeps collection light
    from transformers.trainer import get_scheduler  # noqa: PLC0415 - the import SkyRL's strategy uses

    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = get_scheduler(scheduler, opt, num_warmup_steps=warmup, num_training_steps=total)
    rates = []
    for _ in range(total):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


# Every stock SkyRL recipe asks for 4 GPUs per role (examples/train/gsm8k/run_gsm8k.sh); SkyRL's
# validate_cfg then wants micro-batches that divide each GPU's share of a mini-batch (here 1 row).
STOCK_GPUS = ("trainer.placement.policy_num_gpus_per_node=4", "trainer.placement.ref_num_gpus_per_node=4",
              "trainer.placement.critic_num_gpus_per_node=4", "generator.inference_engine.num_engines=4",
              "trainer.micro_train_batch_size_per_gpu=1", "trainer.micro_forward_batch_size_per_gpu=1")
