"""`floe train recipes/reverse_text.toml` with the vLLM engine, as a user runs it: the real
CLI in a subprocess, the default recipe shortened (short warm start, 6 GRPO steps, small
batches, eval at the start and the end). The same command on the torch engine starts from the
same warm-started model, so both engines score it alike at step 0 (greedy eval). `vllm` marker."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
SHORT = ["--warm_start.steps", "40", "--warm_start.batch_size", "16", "--train.steps", "6",
         "--train.groups_per_step", "8", "--train.samples_per_group", "4", "--eval.every", "6", "--eval.size", "16",
         "--output.checkpoint_every", "6"]
VLLM = ["--backend.sampler.engine.name", "vllm", "--backend.sampler.engine.enforce_eager", "true",
        "--backend.sampler.engine.kv_cache_memory_gib", "0.25"]


def _train(run_dir: Path, cache: Path, *args: str) -> list[dict]:
    cmd = [sys.executable, "-m", "floe.cli", "train", str(REPO / "recipes" / "reverse_text.toml"), *SHORT,
           "--output.run_dir", str(run_dir), "--no-progress", *args]
    proc = subprocess.run(cmd, check=False, cwd=REPO, env={**os.environ, "FLOE_CACHE": str(cache)}, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_reverse_text_trains_on_the_vllm_engine(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    rows = _train(tmp_path / "vllm", cache, *VLLM)
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["reward_mean"]) and 0.0 <= r["reward_mean"] <= 1.0 for r in steps)
    evals = {r["step"]: r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r}
    assert sorted(evals) == [0, 6] and all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in evals.values())
    assert max(r["step"] for r in rows) == 6

    torch_rows = _train(tmp_path / "torch", cache)  # the warm start is cached: same model
    torch_evals = {r["step"]: r["eval/reward_mean"] for r in torch_rows if "eval/reward_mean" in r}
    assert evals[0] == pytest.approx(torch_evals[0], abs=0.02)
