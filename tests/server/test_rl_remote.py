"""The RL loop runs unchanged against a remote backend, asynchronous mode included."""

from __future__ import annotations

from pathlib import Path

from floe.rl import Recipe, Trainer
from floe.rl.metrics import read_jsonl


def test_grpo_loop_over_http(start_server, server_model, tmp_path):
    server = start_server()
    recipe = Recipe.model_validate({
        "model": {"path": str(server_model)},
        "env": {"name": "reverse_text", "options": {"min_length": 2, "max_length": 3, "instruction": "Reverse:"}},
        "train": {"steps": 3, "groups_per_step": 2, "samples_per_group": 3, "max_tokens": 8,
                  "max_off_policy_steps": 1, "advantage": {"drop_constant_groups": False}},
        "eval": {"every": 0, "size": 2},
        "output": {"run_dir": str(tmp_path / "run"), "checkpoint_every": 0, "progress": False},
    })
    client = server.client(timeout=120)
    summary = Trainer(recipe).run(client)
    records = read_jsonl(Path(summary.run_dir) / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["staleness_max"] <= 1 for r in records[1:])
    info = client.info()
    assert info.step == 3 and info.sampler_version == 3
    assert "run.step_000003" in client.list_states()  # the final checkpoint lives on the server
    client.close()
