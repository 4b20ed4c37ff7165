"""The GRPO loop end to end on a tiny model: outputs, async staleness, kill and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from floe.cli import load_recipe, main
from floe.errors import InvalidInput
from floe.rl import train
from floe.rl.metrics import read_jsonl


def test_sync_run_writes_metrics_checkpoints_rollouts_and_plots(recipe_file, capsys):
    path = recipe_file(steps=4)
    assert main(["train", path, "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    run = Path(summary["run_dir"])
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert all("eval/reward_mean" in records[i] for i in (0, 2, 4))
    for r in records[1:]:
        for key in ("reward_mean", "reward_std", "reward/reverse_text_mean", "tokens_sampled", "staleness_mean",
                    "time/sample", "time/score", "time/train", "time/sync", "weights_version"):
            assert key in r, key
        assert r["staleness_max"] == 0 and r["weights_version"] == r["step"]
        if r["groups_dropped"] < 3:
            for key in ("loss", "entropy", "clip_fraction", "grad_norm", "lr", "tokens_trained"):
                assert key in r, key
            assert 0 < r["time/forward_backward"] < r["time/train"] and r["tokens_per_second"] > 0
            assert "mfu" not in r  # float32 on CPU: no peak known
    assert json.loads((run / "loop_state.json").read_text()) == {"step": 4, "checkpoint": "run.step_000004"}
    assert sorted(p.name for p in (run / "states").iterdir()) == ["run.step_000002", "run.step_000004"]
    rollouts = read_jsonl(run / "rollouts.jsonl")
    assert rollouts and all(r["turns"][0]["completion"] is not None for r in rollouts)
    assert {p.name for p in run.glob("*.png")} >= {"reward.png", "entropy.png"}
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 4
    # Running again into the same directory without --resume is refused.
    with pytest.raises(FileExistsError, match="--resume"):
        train(load_recipe([path])[0], progress=False)
    assert main(["train", path, "--no-progress"]) == 2  # the CLI says so without a traceback
    assert "--resume" in capsys.readouterr().err


def test_async_mode_overlaps_and_bounds_staleness(recipe_file):
    summary = train(load_recipe([recipe_file(steps=6, async_k=1, name="async")])[0], progress=False)
    records = [r for r in read_jsonl(Path(summary.run_dir) / "metrics.jsonl") if r["step"] > 0]
    assert len(records) == 6
    assert all(0 <= r["staleness_max"] <= 1 for r in records)
    assert any(r["staleness_max"] == 1 for r in records)  # sampling really ran ahead


def _steps_and_rewards(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r.get("reward_mean", r.get("eval/reward_mean"))) for r in read_jsonl(run / "metrics.jsonl")]


def test_killed_run_resumes_with_no_lost_or_repeated_step(recipe_file, tmp_path):
    reference = train(load_recipe([recipe_file(steps=6, name="straight")])[0], progress=False)
    path = recipe_file(steps=6, name="killed")
    run = tmp_path / "killed"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "floe.cli", "train", path, "--no-progress"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    state = run / "loop_state.json"
    while time.time() < deadline and proc.poll() is None:
        if state.exists() and json.loads(state.read_text())["step"] >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed; make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = json.loads(state.read_text())["step"]
    assert 2 <= killed_at < 6
    assert main(["train", path, "--resume", "--no-progress"]) == 0
    steps = [s for s, _ in _steps_and_rewards(run)]
    assert steps == [0, 1, 2, 3, 4, 5, 6]
    # Every step's data and seeds derive from (seed, step) and the weights resume exactly,
    # so the resumed run reproduces the uninterrupted one.
    assert _steps_and_rewards(run) == _steps_and_rewards(Path(reference.run_dir))


def test_resume_of_a_run_that_never_started_is_an_error(recipe_file, tmp_path):
    with pytest.raises(InvalidInput, match="no run in .* to resume .*drop --resume") as err:
        train(load_recipe([recipe_file(name="fresh")])[0], resume=True, progress=False)
    assert err.value.field == "--resume" and not (tmp_path / "fresh").exists()


def test_kl_penalty_uses_the_reference_zone_and_minibatches(recipe_file):
    recipe, _ = load_recipe([recipe_file(steps=2, name="kl"), "--train.loss.kl.coef", "0.1",
                             "--train.minibatches", "2"])
    summary = train(recipe, progress=False)
    records = [r for r in read_jsonl(Path(summary.run_dir) / "metrics.jsonl") if r["step"] > 0]
    assert all("kl_ref_k3" in r and r["kl_ref_k3"] >= 0 for r in records)
    assert [r["policy_step"] for r in records] == [2, 4]  # two optimizer steps per loop step


def test_tensorboard_logging_when_asked(recipe_file):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recipe, _ = load_recipe([recipe_file(steps=2, name="tb"), "--output.tensorboard", "true"])
    summary = train(recipe, progress=False)
    events = EventAccumulator(str(Path(summary.run_dir) / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "reward_mean" in tags and "eval/reward_mean" in tags
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2]


def test_wandb_without_the_package_is_a_clear_error(recipe_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail as if not installed
    recipe, _ = load_recipe([recipe_file(steps=1, name="wb"), "--output.wandb", "true"])
    with pytest.raises(InvalidInput, match=r"pip install 'floe-rl\[wandb\]'") as err:
        train(recipe, progress=False)
    assert err.value.field == "recipe.output.wandb"  # found before any model is built


def test_staleness_is_measured_from_the_backends_own_version(recipe_file, tmp_path):
    """A backend that synced before the run (a long-lived server) still shows staleness 0 in
    synchronous mode: staleness counts versions behind, not absolute versions."""
    import floe
    from floe.rl import Trainer
    from floe.rl.warmstart import prepare_model

    recipe, _ = load_recipe([recipe_file(steps=2, name="presynced")])
    client = floe.connect(recipe.backend_config(prepare_model(recipe)))
    client.sync_weights()
    client.sync_weights()
    summary = Trainer(recipe, progress=False).run(client)
    records = [r for r in read_jsonl(Path(summary.run_dir) / "metrics.jsonl") if r["step"] > 0]
    assert [r["staleness_max"] for r in records] == [0, 0]
    assert [r["weights_version"] for r in records] == [3, 4]


def test_old_checkpoints_are_pruned_through_the_client(recipe_file, tmp_path):
    """Pruning uses client.list_states / delete_state, so it works wherever the backend keeps its
    states (here a state_dir the recipe does not know, as on a remote server) and touches only
    this run's checkpoints."""
    import floe
    from floe.rl import Trainer
    from floe.rl.warmstart import prepare_model

    recipe, _ = load_recipe([recipe_file(steps=4, name="pruned"), "--output.keep_checkpoints", "1",
                             "--eval.every", "0"])
    elsewhere = tmp_path / "server_states"
    client = floe.connect(recipe.backend_config(prepare_model(recipe)).model_copy(update={"state_dir": str(elsewhere)}))
    client.save_state("other_run.step_000002")
    client.save_state("pruned_notes")
    Trainer(recipe, progress=False).run(client)
    assert sorted(client.list_states()) == ["other_run.step_000002", "pruned.step_000004", "pruned_notes"]
    assert not (tmp_path / "pruned" / "states").exists()
    client.close()


def test_resume_skips_a_damaged_last_checkpoint_for_the_newest_intact_one(recipe_file, tmp_path, capsys):
    """Issue 23 item 4 on `floe train --resume`: the last checkpoint (step 4) is cut short; the
    run resumes from step 2, says so, and still reproduces the uninterrupted run."""
    reference = train(load_recipe([recipe_file(steps=6, name="straight")])[0], progress=False)
    path = recipe_file(steps=4, name="damaged")
    train(load_recipe([path])[0], progress=False)
    run = tmp_path / "damaged"
    last = json.loads((run / "loop_state.json").read_text())
    assert last["step"] == 4
    weights = run / "states" / last["checkpoint"] / "policy.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    assert main(["train", path, "--resume", "--no-progress", "--train.steps", "6"]) == 0
    err = capsys.readouterr().err
    assert f"the last checkpoint {last['checkpoint']!r} (step 4) could not be loaded" in err and "(step 2)" in err
    assert "damaged" in err and "policy.safetensors" in err
    assert [s for s, _ in _steps_and_rewards(run)] == [0, 1, 2, 3, 4, 5, 6]
    assert _steps_and_rewards(run) == _steps_and_rewards(Path(reference.run_dir))


def test_an_interrupt_whose_keyboardinterrupt_was_swallowed_still_stops_the_run(recipe_file):
    """Ctrl-C that lands in a finalizer loses its KeyboardInterrupt (Python prints "Exception
    ignored" and goes on); the CLI's handler also sets Trainer.interrupted, and the step loop
    stops at the next step boundary: nothing is trained after the interrupt."""
    import floe
    from floe.rl import Trainer
    from floe.rl.warmstart import prepare_model

    recipe, _ = load_recipe([recipe_file(steps=3, name="swallowed")])
    client = floe.connect(recipe.backend_config(prepare_model(recipe)))
    trainer = Trainer(recipe, progress=False)
    trainer.interrupted.set()  # what the handler leaves behind when its KeyboardInterrupt is lost
    with pytest.raises(KeyboardInterrupt):
        trainer.run(client)
    assert trainer.steps_done == 0 and client.info().step == 0
    assert [r["step"] for r in read_jsonl(Path(recipe.output.run_dir) / "metrics.jsonl")] == [0]
    client.close()
