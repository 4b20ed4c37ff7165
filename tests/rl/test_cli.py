"""`floe sft`, `floe eval` and `floe plot` on the tiny recipe."""

from __future__ import annotations

import json
from pathlib import Path

from floe.cli import main
from floe.models import load_model


def test_sft_exports_a_model_that_eval_and_train_can_use(recipe_file, tmp_path, capsys):
    recipe = recipe_file(steps=2, name="cli")
    out = tmp_path / "sft_model"
    assert main(["sft", recipe, "--warm_start.steps", "3", "--warm_start.batch_size", "4", "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"model": str(out)}
    assert load_model(str(out)).config.model_type == "qwen3"
    # Evaluate the exported model through the recipe: --model.path replaces its [model.tiny].
    capsys.readouterr()
    assert main(["eval", recipe, "--model.path", str(out)]) == 0
    assert 0.0 <= json.loads(capsys.readouterr().out)["eval/reward_mean"] <= 1.0


def test_eval_reports_held_out_reward(recipe_file, capsys):
    assert main(["eval", recipe_file(name="ev")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert 0.0 <= result["eval/reward_mean"] <= 1.0 and "eval/tag_found" in result


def test_plot_writes_pngs(recipe_file, tmp_path, capsys):
    recipe = recipe_file(steps=2, name="plotted")
    assert main(["train", recipe, "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "plotted")]) == 0
    written = [Path(p) for p in capsys.readouterr().out.split()]
    assert {p.name for p in written} >= {"reward.png", "entropy.png"}
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in written)


def test_sft_refuses_to_replace_a_directory_it_did_not_write(recipe_file, tmp_path, capsys):
    recipe = recipe_file(steps=2, name="sftout")
    mine = tmp_path / "my_notes"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert main(["sft", recipe, "--warm_start.steps", "1", "--out", str(mine)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"floe sft: error: --out: {mine} exists and is not a floe export; choose a new or empty directory"
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"
    assert not list(tmp_path.glob(".my_notes*"))  # no scratch left behind
    # An earlier floe export is replaced (it carries export_hf's marker).
    out = tmp_path / "exported"
    args = ["sft", recipe, "--warm_start.steps", "1", "--warm_start.batch_size", "2", "--out", str(out)]
    assert main(args) == 0
    first = json.loads((out / "floe_export.json").read_text())
    assert main([*args, "--warm_start.seed", "1"]) == 0
    second = json.loads((out / "floe_export.json").read_text())
    assert (out / "config.json").is_file() and second["model"] != first["model"]  # the new export replaced it
    assert not list(tmp_path.glob(".exported*"))
