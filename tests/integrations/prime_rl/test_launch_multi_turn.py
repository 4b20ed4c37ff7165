"""`floe prime-rl` runs prime-rl's stock alphabet-sort recipe (multi-turn, LoRA) end to end. The
command and its overrides: launch.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integrations.prime_rl.launch import KL_TOLERANCE, STEPS, launch

pytestmark = [pytest.mark.prime_rl, pytest.mark.timeout(900)]


def test_alphabet_sort_stock_recipe_trains_its_lora_adapter_over_several_turns(tmp_path: Path) -> None:
    # examples/basic/alphabet-sort: multi-turn (3 to 5 user turns per episode) with trainer.model.lora
    # (rank 32, alpha 64): floe serve trains that adapter, prime-rl's orchestrator syncs it through
    # /load_lora_adapter and samples by the adapter's name, as it does with vLLM. (A random model
    # earns reward 0 here, so these steps do not move the adapter; test_trainer.py and
    # test_vllm_compat.py show the adapter training and being served.) The run also splits "2 training
    # GPUs" (--deployment.num-train-gpus 2): prime-rl's orchestrator then writes two ranks' batches per
    # step and floe's trainer takes both ([floe] ranks follows it); the overlay's device places floe
    # serve on this CPU, and the GPU split is listed as not applying here.
    out = launch(tmp_path, "examples/basic/alphabet-sort/rl.toml", "--deployment.num-train-gpus", "2",
                 "--floe.backend.device", "cpu", seq_len=2048)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    run_dir = tmp_path / "outputs" / "floe-run"
    reports = [json.loads(line) for line in (run_dir / "floe_trainer.jsonl").read_text().splitlines()]
    assert [r["step"] for r in reports] == list(range(1, STEPS + 1))
    versions = [r["weights_version"] for r in reports]
    assert versions == sorted(set(versions)) and len(versions) == STEPS
    first = reports[0]["metrics"]
    assert abs(first["kl_sampler_k3"]) < KL_TOLERANCE, first  # sampled by the policy the trainer holds
    logs = next((run_dir / "logs").glob("attempt_*"))
    assert "the server trains a LoRA adapter (rank 32, alpha 64.0)" in (logs / "trainer.log").read_text()
    # prime-rl's auto_setup_lora gave the orchestrator the adapter's name: with it set, prime-rl's
    # update_weights posts /load_lora_adapter (raise_for_status: a refusal stops the run) and every
    # request names the adapter (a 404 otherwise), so exit 0 means floe serve answered both
    orch_config = json.loads((run_dir / "configs" / "orchestrator.json").read_text())
    assert orch_config["model"]["lora"]["name"] == "r32-a64.0", orch_config["model"]
    assert orch_config["num_train_workers"] == 2
    assert "accepted without effect here: deployment.num_train_gpus ([floe.backend] places floe serve" in out.stdout
    assert "gradient_checkpointing=True" in out.stdout  # trainer.model.ac (the recipe's freq = 1)
    orch = [line for line in out.stdout.splitlines() if "orchestrator:" in line and "Reward" in line]
    assert len(orch) >= STEPS, out.stdout[-4000:]
    # every episode ran the recipe's 3 to 5 turns (prime-rl's orchestrator metrics, per step)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    turns = [(m["train/alphabet-sort/all/num_turns/min"], m["train/alphabet-sort/all/num_turns/max"])
             for m in metrics if "train/alphabet-sort/all/num_turns/min" in m]
    assert len(turns) == STEPS and all(3 <= lo <= hi <= 5 for lo, hi in turns), turns
