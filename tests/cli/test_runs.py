"""First use, items 1, 2, 3 (Ctrl-C), 5, 7 and 8: runs stopped early, resume, model switching,
a remote backend, the quick overlay, checkpoints for eval, rollouts and pass@k / maj@k."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import floe
from floe.cli import load_recipe, main
from floe.envs import Task
from floe.protocol.errors import RemoteError
from floe.rl.evaluation import pass_and_majority
from floe.rl.metrics import read_jsonl
from floe.rl.rollouts import Episode, Turn

from .conftest import run_floe

ROOT = Path(__file__).parents[2]


def test_ctrl_c_before_the_first_checkpoint_then_resume_restarts_from_step_0(recipe, tmp_path):
    path = recipe(steps=40, name="early", extra="")
    run = tmp_path / "early"
    proc = subprocess.Popen([sys.executable, "-m", "floe.cli", "train", path, "--no-progress",
                             "--output.checkpoint_every", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if len(read_jsonl(run / "metrics.jsonl")) >= 2:  # step 0 (eval) and step 1
            break
        time.sleep(0.1)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("floe train: interrupted at step ")
    step = int(last.split("interrupted at step ")[1].split()[0])
    assert step >= 1
    assert last.endswith(f"(no checkpoint yet, so --resume restarts it from step 0); resume with: floe train {path} "
                         "--no-progress --output.checkpoint_every 0 --resume")
    assert (run / "reward.png").is_file()  # the plots are still written
    assert not (run / "loop_state.json").exists()
    # Rerunning says what --resume would do; --resume restarts from step 0 and says so.
    again = run_floe("train", path, "--no-progress")
    assert again.returncode == 2 and again.stderr.strip() == (
        f"floe train: error: {run} already holds a run stopped before its first checkpoint; pass --resume to restart "
        "it from step 0, or set output.run_dir to start a new run")
    resumed = run_floe("train", path, "--no-progress", "--train.steps", "2", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"{run} has no checkpoint yet; restarting it from step 0" in resumed.stderr
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2]
    assert json.loads((run / "loop_state.json").read_text())["step"] == 2


def test_resume_refuses_a_changed_config_and_keeps_its_history(recipe, tmp_path, capsys):
    path = recipe(steps=2, name="hist")
    run = tmp_path / "hist"
    assert main(["train", path, "--no-progress"]) == 0
    records = read_jsonl(run / "rollouts.jsonl")
    assert records and {"prompt", "target", "stop_reason", "error", "task", "reward", "turns"} <= records[0].keys()
    first = records[0]
    assert first["prompt"].startswith("<|user|>Reverse:") and first["target"]  # the tiny chat template, the answer
    assert first["stop_reason"] in ("done", "env_error", "context_limit")
    assert first["turns"][0]["stop_reason"] in ("stop_token", "stop_string", "length")
    capsys.readouterr()
    # A key that changes the numbers is refused, naming it; nothing is overwritten.
    refused = run_floe("train", path, "--no-progress", "--resume", "--backend.optimizer.lr", "0.5")
    assert refused.returncode == 2 and refused.stderr.strip().startswith(
        "floe train: error: recipe.backend.optimizer.lr: was 0.001 in the run being resumed, now 0.5; only train.steps, ")
    assert json.loads((run / "config.json").read_text())["backend"]["optimizer"]["lr"] == 0.001
    # More steps (and other listed keys) may change: the run continues and the history says what changed.
    assert main(["train", path, "--no-progress", "--resume", "--train.steps", "3", "--eval.every", "3"]) == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2, 3]
    history = read_jsonl(run / "config_history.jsonl")
    assert [h["step"] for h in history] == [0, 2]
    assert history[1]["changed"] == {"eval.every": [2, 3], "train.steps": [2, 3]}
    assert history[0]["config"]["train"]["steps"] == 2 and json.loads((run / "config.json").read_text())["train"]["steps"] == 3
    # floe eval: the latest checkpoint by name, and a typo lists the saved ones.
    capsys.readouterr()
    assert main(["eval", path, "--checkpoint", "latest"]) == 0
    assert 0.0 <= json.loads(capsys.readouterr().out)["eval/reward_mean"] <= 1.0
    typo = run_floe("eval", path, "--checkpoint", "hist.step_00003")
    assert typo.returncode == 2 and typo.stderr.strip() == (
        "floe eval: error: --checkpoint: no saved state 'hist.step_00003'; did you mean 'hist.step_000003'? "
        "saved states: hist.step_000002, hist.step_000003 (or 'latest')")


def test_a_later_layer_or_flag_replaces_the_model_choice(recipe, tmp_path):
    loaded, _ = load_recipe([recipe(), "--model.path", "/models/x"])
    assert loaded.model.path == "/models/x" and loaded.model.tiny is None
    overlay = tmp_path / "path.toml"
    overlay.write_text('[model]\npath = "/models/y"\n')
    loaded, _ = load_recipe([str(ROOT / "recipes" / "math.toml"), "@", str(overlay)])
    assert loaded.model.path == "/models/y" and loaded.model.tiny is None
    loaded, _ = load_recipe([str(ROOT / "recipes" / "text2sql.toml"), "--model.tiny.hidden_size", "32"])
    assert loaded.model.path is None and loaded.model.tiny.hidden_size == 32


def test_the_quick_overlay_shortens_the_warm_start():
    base, _ = load_recipe([str(ROOT / "recipes" / "alphabet_sort.toml")])
    quick, _ = load_recipe([str(ROOT / "recipes" / "alphabet_sort.toml"), "@", str(ROOT / "recipes/overlays/quick.toml")])
    assert base.warm_start.steps == 150 and quick.warm_start.steps == 20
    assert quick.warm_start.batch_size == base.warm_start.batch_size and quick.train.steps == 4


def _episode(group: int, text: str, reward: float) -> Episode:
    ep = Episode(Task(id=f"t{group}", data={}), group, reward=reward)
    ep.turns.append(Turn([1], [2], [0.0], 0, text, reward))
    return ep


def test_pass_at_k_and_majority_vote():
    groups = [
        [_episode(0, "a", 0.0), _episode(0, " b", 1.0), _episode(0, "b ", 1.0)],  # majority b passes
        [_episode(1, "x", 0.0), _episode(1, "x", 0.0), _episode(1, "y", 1.0)],   # one passes, majority fails
        [_episode(2, "p", 0.1), _episode(2, "q", 0.2), _episode(2, "r", 0.5)],   # none passes (tie: first)
    ]
    assert pass_and_majority(groups, 1.0) == {"eval/pass@3": 2 / 3, "eval/maj@3": 1 / 3}
    assert pass_and_majority(groups, 0.1) == {"eval/pass@3": 1.0, "eval/maj@3": 2 / 3}


def test_eval_reports_pass_and_maj_at_k_when_it_samples_several_answers(recipe, capsys):
    assert main(["eval", recipe(name="k"), "--eval.samples_per_task", "3", "--eval.greedy", "false"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert 0.0 <= result["eval/maj@3"] <= result["eval/pass@3"] <= 1.0


def test_train_drives_a_remote_backend_with_backend_url(recipe, tmp_path):
    from tests.server.conftest import ServerProcess, free_port

    path = recipe(steps=2, name="remote")
    server = ServerProcess(Path(path), free_port(), tmp_path / "server.log", token="s3cret").wait_ready(timeout=240)
    try:
        result = run_floe("train", path, "--no-progress", "--backend.url", json.dumps(server.url),
                          "--backend.token", '"s3cret"')
        assert result.returncode == 0, result.stderr
        run = tmp_path / "remote"
        assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2]
        assert json.loads((run / "config.json").read_text())["backend"]["token"] == "***"  # never written down
        client = server.client()
        assert client.info().step == 2 and "remote.step_000002" in client.list_states()  # trained on the server
        client.close()
        wrong = run_floe("train", path, "--no-progress", "--backend.url", json.dumps(server.url),
                         "--backend.token", '"nope"', "--output.run_dir", json.dumps(str(tmp_path / "r2")))
        assert wrong.returncode == 2 and wrong.stderr.strip() == (
            f"floe train: error: recipe.backend.token: the floe serve at {server.url} refused the token (HTTP 401); "
            "set backend.token (or $FLOE_TOKEN) to the token it was started with")
        assert not (tmp_path / "r2").exists()  # a failed start creates nothing
        before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
        wrong = run_floe("train", path, "--no-progress", "--resume", "--train.steps", "4", "--backend.url",
                         json.dumps(server.url), "--backend.token", '"nope"')
        assert wrong.returncode == 2 and "recipe.backend.token: " in wrong.stderr
        assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before  # nor changes anything
        library = floe.connect(server.url, token="nope")
        with pytest.raises(RemoteError) as e:
            library.info()
        assert e.value.status == 401 and "set $FLOE_TOKEN or pass token= to floe.connect" in str(e.value)
        library.close()
    finally:
        server.stop()
