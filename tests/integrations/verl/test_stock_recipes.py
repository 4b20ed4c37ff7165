"""verl's own example recipes (stock_recipes.py: the keys of examples/<algorithm>_trainer/
run_qwen3_8b_fsdp.sh) through the one-key switch for 2 training steps on this CPU machine, only
the model, data, sizes and device overridden. Each must exit 0 with finite, non-zero gradients
and the sampler's log-probs matching the trainer's; docs/integrations.md has the table of
outcomes. Runs in verl's environment (scripts/ci/verl.sh)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.integrations.verl.assets import make_data, make_model
from tests.integrations.verl.run import FLOE_SWITCH, VLLM_RECIPE_SWITCH, grpo_recipe, run_main_ppo
from tests.integrations.verl.stock_recipes import RECIPES, cpu_sized, needs_vllm

pytestmark = [pytest.mark.verl, pytest.mark.timeout(900)]

STEPS = 2


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory, shared_ray: str) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("verl-stock")
    train, test = make_data(root / "data")
    return {"root": root, "model": make_model(root / "tiny"), "train": train, "test": test}


# Recipes refused before training, by the key and why (docs/integrations.md's table).
REFUSED = {
    # verl 0.9.1's V1 trainer, which trainer_mode=floe builds on, has no REMAX greedy baseline:
    # without floe it fails inside verl (compute_remax_outcome_advantage without reward_baselines).
    "remax": "algorithm.adv_estimator: remax needs a greedy baseline rollout",
}


# Recipes that train a LoRA adapter: the backend's settings line names it.
LORA = {"grpo_lora": "lora=rank 64 alpha 32 targets all-linear"}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_stock_recipe_runs_through_the_switch(assets, name):
    recipe = RECIPES[name]
    out = assets["root"] / name
    args = cpu_sized(recipe, grpo_recipe(assets["model"], assets["train"], assets["test"], out, steps=STEPS))
    switch = FLOE_SWITCH if needs_vllm(recipe) else VLLM_RECIPE_SWITCH  # stock_recipes.needs_vllm
    run = run_main_ppo(args, assets["root"] / f"{name}.log", timeout_s=600, switch=switch)
    print(f"verl {recipe.source} on floe: exit {run.returncode}, {run.seconds:.0f} s")
    if name in REFUSED:
        assert run.returncode not in (0, 124, 137) and REFUSED[name] in run.log, run.log[-3000:]
        assert not any(s > 0 for s in run.steps)
        return
    assert run.returncode == 0, run.log[-5000:]
    if name in LORA:  # the recipe's adapter is what the backend trains (floe.integrations.hardware.describe)
        assert LORA[name] in run.log, run.log[-3000:]
    assert sorted(s for s in run.steps if s > 0) == list(range(1, STEPS + 1)), run.log[-3000:]
    for step in range(1, STEPS + 1):
        m = run.steps[step]
        assert math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0, (step, m)
        assert m["training/rollout_probs_diff_max"] < 1e-4, (step, m)
