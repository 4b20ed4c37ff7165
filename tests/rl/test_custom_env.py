"""A user's own environment, named "pkg.module:Class" in a recipe, trains through `floe train`.

The environment is docs/examples/custom_env.py (the example docs/environments.md shows),
copied into a package outside floe and run by the real CLI in a subprocess.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

from floe.rl.metrics import read_jsonl

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "custom_env.py"


def test_docs_show_the_example_verbatim():
    docs = (ROOT / "docs" / "environments.md").read_text()
    assert EXAMPLE.read_text().strip() in docs


def test_custom_env_from_a_user_package_trains_with_floe_train(recipe_file, tmp_path):
    package = tmp_path / "user_code" / "my_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    shutil.copy(EXAMPLE, package / "tasks.py")
    rng = random.Random(0)
    words = {"".join(rng.choice("abcdef") for _ in range(rng.randint(2, 4))) for _ in range(200)}
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"prompt": w, "answer": w[::-1]}) + "\n" for w in sorted(words)))
    recipe = recipe_file(steps=2, name="qa")  # the tiny test recipe, pointed at the user's env:
    overrides = ["--env.name", '"my_pkg.tasks:QAFamily"', "--env.options", f'{{ path = "{data}", instruction = "Rev:" }}']
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "user_code"))  # FLOE_CACHE is set by recipe_file
    proc = subprocess.run([sys.executable, "-m", "floe.cli", "train", recipe, *overrides, "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]

    run_dir = tmp_path / "qa"
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert math.isfinite(r["reward_mean"]) and 0.0 <= r["reward_mean"] <= 1.0
        assert "reward/qa_mean" in r and "env/exact" in r  # the family's own name and metrics
    assert all(math.isfinite(records[i]["eval/reward_mean"]) for i in (0, 2))  # eval at the start and the end
    rollouts = read_jsonl(run_dir / "rollouts.jsonl")
    assert rollouts and all(r["task"].startswith("qa/train/") for r in rollouts)
