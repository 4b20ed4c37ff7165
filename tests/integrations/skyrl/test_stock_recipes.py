"""SkyRL's own example recipes (stock_recipes.py: the keys of its examples/train/... scripts)
through the one-line switch for 2 training steps on this CPU machine, only the model, data,
sizes, placement and device overridden. Each must exit 0 with a non-zero gradient at every step
and SkyRL's own sampler-vs-trainer log-prob gap below 1e-4; docs/integrations.md has the table
of outcomes. Runs only in the SkyRL environment (scripts/ci/skyrl.sh, marker `skyrl`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integrations.skyrl.stock_recipes import RECIPES, cpu_sized
from tests.integrations.skyrl.test_skyrl_run import recipe_args, run_skyrl

pytestmark = pytest.mark.skyrl

STEPS = 2
MAX_SEQ_LEN = 192 + 16  # recipe_args' max_prompt_length + max_generate_length


# Recipes refused before training, by the key and why (docs/integrations.md's table). None now:
# clip_cov's and kl_cov's recipes (with SkyRL's KL loss) run with floe's kl.aggregation.
REFUSED: dict[str, str] = {}


# Recipes that train a LoRA adapter: the backend's settings line names it.
LORA = {"grpo_lora": "lora=rank 32 alpha 32 targets all-linear"}


@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_stock_recipe_runs_through_the_switch(assets: dict[str, Path], tmp_path: Path, name: str) -> None:
    recipe = RECIPES[name]
    base = [a for a in recipe_args(assets, tmp_path) if not a.startswith("trainer.max_training_steps=")]
    args = cpu_sized(recipe, base + [f"trainer.max_training_steps={STEPS}"], MAX_SEQ_LEN)
    proc = run_skyrl(assets, tmp_path, args=args, timeout_s=600)
    log = proc.stdout + proc.stderr
    print(f"SkyRL {recipe.source} on floe: exit {proc.returncode}")
    if name in REFUSED:
        assert proc.returncode not in (0, 124) and REFUSED[name] in log, log[-3000:]
        assert not (tmp_path / "export" / "floe_metrics.jsonl").exists()
        return
    assert proc.returncode == 0, log[-5000:]
    if name in LORA:  # the recipe's adapter is what the backend trains (floe.integrations.hardware.describe)
        assert LORA[name] in log, log[-3000:]
    records = [json.loads(line) for line in (tmp_path / "export" / "floe_metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "policy/rollout_train_logprobs_abs_diff_mean" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1)), records
    for r in train:
        assert r["policy/rollout_train_logprobs_abs_diff_mean"] < 1e-4, r
        assert r["policy/grad_norm"] > 0, r
