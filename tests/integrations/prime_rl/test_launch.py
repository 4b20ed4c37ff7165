"""`floe prime-rl` runs prime-rl's stock reverse-text recipe end to end and resumes it; a dying
child stops the run; a GPU split is refused on this CPU machine. The command and its overrides:
launch.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.integrations.prime_rl.launch import KL_TOLERANCE, STEPS, alive, command, launch

pytestmark = [pytest.mark.prime_rl, pytest.mark.timeout(900)]


def test_reverse_text_stock_recipe_runs_through_one_command_and_resumes(tmp_path: Path) -> None:
    out = launch(tmp_path, "examples/basic/reverse-text/rl.toml")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    run_dir = tmp_path / "outputs" / "floe-run"
    reports = [json.loads(line) for line in (run_dir / "floe_trainer.jsonl").read_text().splitlines()]
    assert [r["step"] for r in reports] == list(range(1, STEPS + 1))
    versions = [r["weights_version"] for r in reports]
    assert versions == sorted(set(versions)) and len(versions) == STEPS  # a new version each step, in order
    for step in range(STEPS + 1):
        assert (run_dir / "broadcasts" / f"step_{step}" / "STABLE").is_file()
    # step 1 trains on rollouts of the startup weights: sampler and trainer log-probs agree
    first = reports[0]["metrics"]
    assert first["tokens"] > 0
    assert abs(first["kl_sampler_k3"]) < KL_TOLERANCE, first
    assert abs(first["ratio_mean"] - 1) < 1e-2 and first["ratio_min"] > 0.9 and first["ratio_max"] < 1.1, first
    # the orchestrator's own step lines, with the reward it logged, echoed by the launcher
    orch = [line for line in out.stdout.splitlines() if "orchestrator:" in line and "Reward" in line]
    assert len(orch) >= STEPS, out.stdout[-4000:]
    assert "prime-trainer: step 2" in out.stdout
    assert not list(run_dir.glob("rollouts/step_*/rank_*.bin"))  # they came over zmq
    # the recipe's [ckpt] (a checkpoint at the end): prime-rl's orchestrator and floe's trainer both wrote step 2
    final = run_dir / "checkpoints" / f"step_{STEPS}"
    assert (final / "orchestrator").is_dir() and (final / "trainer" / "floe.json").is_file(), list(final.iterdir())

    # prime-rl's `--resume` (the latest checkpoint), one more step: the orchestrator continues its
    # progress, the trainer its floe state, and the new step gets the next weights version
    again = launch(tmp_path, "examples/basic/reverse-text/rl.toml", "--max-steps", str(STEPS + 1), "--resume")
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert f"resuming from step {STEPS}" in again.stdout, again.stdout[-3000:]
    logs = sorted((run_dir / "logs").glob("attempt_*"))
    assert len(logs) == 2  # prime-rl's per-attempt log directories
    assert f"Resuming orchestrator from checkpoint step {STEPS}" in (logs[-1] / "orchestrator.log").read_text()
    assert f"resumed step {STEPS}" in (logs[-1] / "trainer.log").read_text()
    reports = [json.loads(line) for line in (run_dir / "floe_trainer.jsonl").read_text().splitlines()]
    assert [r["step"] for r in reports] == list(range(1, STEPS + 2))
    assert reports[-1]["weights_version"] == versions[-1] + 1
    assert abs(reports[-1]["metrics"]["kl_sampler_k3"]) < KL_TOLERANCE  # sampled by the restored policy
    assert (run_dir / "checkpoints" / f"step_{STEPS + 1}" / "trainer" / "floe.json").is_file()


def test_a_dying_child_stops_the_run_and_is_named(tmp_path: Path) -> None:
    # prime-rl's orchestrator is killed once it has started: the launcher stops everything else
    args, env = command(tmp_path, "examples/basic/reverse-text/rl.toml")
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: dict[str, int] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        found = re.search(r"started (.+?) \(pid (\d+)\)", line)
        if found:
            pids["env server" if "env server" in found.group(1) else found.group(1)] = int(found.group(2))
        if "orchestrator" in pids:
            break
    assert set(pids) == {"env server", "orchestrator"}, pids
    os.kill(pids["orchestrator"], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-3000:]
    assert "orchestrator exited with status -9" in err and "orchestrator.log" in err, err[-3000:]
    assert not alive(pids["env server"])  # stopped with the run: no orphan


def test_a_gpu_split_on_this_cpu_machine_is_refused_before_anything_starts(tmp_path: Path) -> None:
    # wordle's [deployment] asks for 2 + 6 GPUs; the machine (CUDA_VISIBLE_DEVICES="") has none
    out = launch(tmp_path, "examples/basic/wordle/rl.toml", timeout_s=300)
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert "deployment.num_train_gpus" in out.stderr and "2 training + 6 inference GPUs" in out.stderr, out.stderr[-3000:]
    assert "started" not in out.stdout  # nothing was launched
