"""Recipe typos fail in `floe train` (the real CLI, in a subprocess) before any model is built,
in a few seconds of CPU, naming the key and what is allowed."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from floe.cli import load_recipe
from floe.compute.losses import loss_names
from floe.errors import InvalidInput

LOSSES = loss_names()  # the registry grows; the message lists whatever it holds


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (["--train.loss.name", '"ppoo"'],
         f"recipe.train.loss.name: unknown loss 'ppoo'; choose one of {LOSSES}"),
        (["--train.loss.clip_hgh", "0.3"],
         ("recipe.train.loss.clip_hgh: unknown key; allowed keys: aggregation, clip_high, clip_low, dual_clip, "
          "entropy, kl, name, norm_length")),
        (["--env.options.max_lenght", "5"],
         ("recipe.env.options.max_lenght: unknown option 'max_lenght' for env family 'reverse_text'; valid options: "
          "data_path, eval_data_path, instruction, max_length, min_length, system_prompt")),
    ],
    ids=["loss-name", "loss-key", "env-option"],
)
def test_typos_fail_fast_in_floe_train(recipe_file, tmp_path, override, expected):
    recipe = recipe_file(name="typo")
    cache = tmp_path / "cache"
    env = dict(os.environ, FLOE_CACHE=str(cache))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "floe.cli", "train", recipe, *override, "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU time, not wall time: a loaded machine must not fail it. Today about 1.7 s, most of it
    # the torch import that floe.compute.losses does at import time.
    seconds = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"floe train: error: {expected}"
    assert seconds < 3.0, f"took {seconds:.1f} s of CPU"
    assert not cache.exists() and not (tmp_path / "typo").exists()  # no model built, no run started


@pytest.mark.parametrize(
    ("override", "field", "message"),
    [
        (["--train.loss", '"ppo"'], "recipe.train.loss", "[train.loss] name = "),
        (["--train.loss_config.clip_high", "0.3"], "recipe.train.loss_config", "[train.loss] name = "),
        (["--train.loss.kl.beta", "0.1"], "recipe.train.loss.kl.beta", "allowed keys: aggregation, coef, estimator"),
        (["--train.loss.name", '"cispo"', "--train.loss.dual_clip", "2"], "recipe.train.loss.dual_clip",
         "allowed keys: aggregation, clip_high, clip_low, entropy, kl, name, norm_length"),
        (["--train.stepz", "3"], "recipe.train.stepz", "allowed keys: advantage, groups_per_step"),
        (["--env.name", '"reverse_txt"'], "recipe.env.name", "built-in: reverse_text, math, alphabet_sort, text2sql"),
        (["--env.name", '"no_such_pkg.tasks:Family"'], "recipe.env.name",
         "cannot import module 'no_such_pkg.tasks'"),
        (["--env.options.max_length", "0"], "recipe.env.options.max_length", "greater than or equal to 1"),
    ],
)
def test_recipe_errors_name_the_key_and_the_allowed_values(recipe_file, override, field, message):
    with pytest.raises(InvalidInput) as err:
        load_recipe([recipe_file(name="bad"), *override])
    assert err.value.field == field
    assert message in err.value.message


def test_loss_table_keys_reach_the_loss(recipe_file):
    recipe, _ = load_recipe([recipe_file(name="ok"), "--train.loss.clip_high", "0.3"])
    assert recipe.train.loss.name == "ppo" and recipe.train.loss.clip_high == 0.3  # name defaults to ppo
    recipe, _ = load_recipe([recipe_file(name="ok2"), "--train.loss.name", '"gspo"'])
    assert (recipe.train.loss.name, recipe.train.loss.clip_low) == ("gspo", 3e-4)  # gspo's own defaults
