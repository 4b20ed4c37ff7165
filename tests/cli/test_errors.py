"""First use, items 3, 4 and 6: every user error of `floe` is one line naming the field and the
fix, found before any model loads; trivial errors are fast; no traceback. The real command runs
in a subprocess."""

from __future__ import annotations

import json

import pytest

from floe import __version__
from floe.cli import load_recipe

from .conftest import run_floe


def _one_line_error(result, command: str) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"floe {command}: error: ") or lines[0].startswith("floe: error: ")
    return lines[0]


def test_a_mistyped_command_suggests_the_closest_one_fast():
    result = run_floe("trian")
    line = _one_line_error(result, "")
    assert line == "floe: error: unknown command 'trian'; did you mean 'train'? (commands: train, sft, eval, serve, plot, prime-trainer, prime-rl; floe --help)"
    assert result.cpu_seconds < 1.0, result.cpu_seconds


def test_version_is_printed_fast():
    result = run_floe("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"floe {__version__}"
    assert result.cpu_seconds < 1.0, result.cpu_seconds


def test_an_unknown_flag_is_one_line_before_the_recipe_is_read(recipe):
    result = run_floe("train", recipe(), "--resumee")
    line = _one_line_error(result, "train")
    assert line == "floe train: error: arguments: unrecognized arguments: --resumee; see floe train --help"
    assert result.cpu_seconds < 1.0, result.cpu_seconds


def test_errors_in_backend_keys_name_the_path_the_user_wrote(recipe):
    result = run_floe("train", recipe(), "--backend.optimizer.lrr", "3")
    assert _one_line_error(result, "train") == (
        "floe train: error: recipe.backend.optimizer.lrr: unknown key; allowed keys: betas, eps, grad_clip, lr, "
        "min_lr_ratio, schedule, total_steps, warmup_steps, weight_decay")
    result = run_floe("train", recipe(), "--backend.dtype", '"float8"')
    assert _one_line_error(result, "train").startswith("floe train: error: recipe.backend.dtype: Input should be")


def test_a_date_like_value_stays_text(recipe, tmp_path):
    loaded, _ = load_recipe([recipe(), "--output.run_dir", "2024-01-01"])
    assert loaded.output.run_dir == "2024-01-01"
    loaded, _ = load_recipe([recipe(), "--output.run_dir=1979-05-27T07:32:00Z"])
    assert loaded.output.run_dir == "1979-05-27T07:32:00Z"


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--env.name", "reverse_txt"], {},
         "recipe.env.name: unknown env 'reverse_txt'; built-in: reverse_text, math, alphabet_sort, text2sql"),
        (["--env.options.max_lenght", "5"], {},
         "recipe.env.options.max_lenght: unknown option 'max_lenght' for env family 'reverse_text'"),
        (["--backend.device", "cuda"], {},
         "recipe.backend.device: 'cuda' is not available: torch "),
        (["--model.path", "floe-test/no-such-model"], {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"},
         "recipe.model.path: cannot reach the Hugging Face hub (http://127.0.0.1:9) to fetch 'floe-test/no-such-model'"),
        (["--model.path", "floe-test/no-such-model"], {"HF_HUB_OFFLINE": "1"},
         "recipe.model.path: 'floe-test/no-such-model' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"),
        (["--model.path", "./no/such/dir"], {},
         "recipe.model.path: no such model directory: ./no/such/dir; give an existing directory or a hub id"),
        (["--output.wandb", "true"], {"PYTHONPATH": ""},
         "recipe.output.wandb: needs the wandb package, which is not installed: pip install 'floe-rl[wandb]'"),
    ],
    ids=["env-name", "env-option", "cuda-on-cpu", "hub-unreachable", "hub-offline", "no-such-dir", "missing-extra"],
)
def test_user_errors_are_one_line_before_any_model_loads(recipe, tmp_path, args, env, expected):
    result = run_floe("train", recipe(name="bad"), *args, "--no-progress", env=env, timeout=120)
    line = _one_line_error(result, "train")
    assert line.startswith(f"floe train: error: {expected}"), line
    assert not (tmp_path / "cache").exists() and not (tmp_path / "bad").exists()  # no model built, no run started
    assert result.cpu_seconds < 15, result.cpu_seconds  # the hub check gives up fast; nothing waits ~60 s


def test_a_data_file_with_too_few_rows_fails_before_the_warm_start(recipe, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in ("abc", "hello", "floe")))
    path = recipe(name="few", extra="\n[warm_start]\nsteps = 5\nbatch_size = 2\n")
    result = run_floe("train", path, "--env.options.data_path", json.dumps(str(rows)), "--no-progress")
    line = _one_line_error(result, "train")
    assert line.startswith("floe train: error: recipe.eval.size: reverse_text: count=4 but the data file has only")
    assert line.endswith("lower eval.size or give a data file with more rows")
    assert not (tmp_path / "cache").exists()  # the warm start never ran


DEVICE_FIRST = """
import json, resource, sys
from floe.cli import main
rc = main([sys.argv[1], sys.argv[2], "--backend.device", "cuda:0", "--output.run_dir", sys.argv[3]])
loaded = sorted(m for m in ("transformers", "floe.rl.loop", "floe.rl.warmstart", "floe.backend") if m in sys.modules)
print(json.dumps({"rc": rc, "loaded": loaded}))
"""


@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_wrong_device_is_one_line_before_the_model_stack_is_imported(recipe, tmp_path, command):
    """Issue 23 item 6: `--backend.device cuda:0` on a CPU-only torch is checked right after the
    recipe, with torch alone; the training loop and transformers (seconds of imports, 12 s in the
    issue's measurement against 4 s for torch) are never imported. (`floe eval` parses its
    recipe through the same `_flags_then_recipe` as these two.)"""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    proc = subprocess.run([sys.executable, "-c", DEVICE_FIRST, command, recipe(), str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120, check=False)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["rc"] == 2 and "recipe.backend.device: 'cuda:0' is not available" in proc.stderr, proc.stderr
    assert out["loaded"] == [], out
