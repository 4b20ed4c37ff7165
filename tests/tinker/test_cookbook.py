"""tinker-cookbook 0.6.1's own loops against `floe serve`: the RL loop (arithmetic environment,
importance_sampling) runs and resumes from its checkpoint, also after the server died mid-run;
the supervised loop on a local JSONL file lowers the loss. Offline: the tokenizer is the tiny
model's local directory."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tinker.conftest import API_KEY

pytestmark = pytest.mark.tinker


def _rl_config(model: Path, log: Path, url: str, steps: int):
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder  # noqa: PLC0415
    from tinker_cookbook.rl import train  # noqa: PLC0415

    dataset = ArithmeticDatasetBuilder(batch_size=2, model_name_for_tokenizer=str(model), renderer_name="role_colon",
                                       n_batches=20, group_size=2)
    return train, train.Config(
        learning_rate=1e-3, model_name=str(model), recipe_name="floe_test", max_tokens=4, log_path=str(log),
        dataset_builder=dataset, renderer_name="role_colon", eval_every=0, save_every=2, lora_rank=4,
        base_url=url, loss_fn="importance_sampling", max_steps=steps,
    )


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_cookbook_rl_loop_runs_five_steps_then_resumes(tinker_server, tinker_model: Path, tmp_path: Path) -> None:
    server = tinker_server()
    log = tmp_path / "rl"
    train, config = _rl_config(tinker_model, log, server.url, 5)
    asyncio.run(train.main(config))
    first = _rows(log / "checkpoints.jsonl")
    assert [r["batch"] for r in first] == [2, 4, 5] and first[-1]["name"] == "final"
    assert sorted({r["step"] for r in _rows(log / "metrics.jsonl")}) == [0, 1, 2, 3, 4, 5]  # 5 = the final row

    train, config = _rl_config(tinker_model, log, server.url, 7)
    asyncio.run(train.main(config))
    rows = _rows(log / "checkpoints.jsonl")
    assert [r["batch"] for r in rows] == [2, 4, 5, 6, 7]
    resumed_run = rows[-1]["state_path"].split("/")[2]
    assert resumed_run != first[-1]["state_path"].split("/")[2]  # a new run, created by loading the checkpoint
    steps = [r["step"] for r in _rows(log / "metrics.jsonl")]
    assert sorted(set(steps)) == list(range(8)) and steps.count(4) == 1  # continued at step 5, nothing redone


def test_cookbook_supervised_loop_lowers_the_loss(tinker_server, tinker_model: Path, tmp_path: Path) -> None:
    from tinker_cookbook.supervised import train  # noqa: PLC0415
    from tinker_cookbook.supervised.data import FromConversationFileBuilder  # noqa: PLC0415
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig  # noqa: PLC0415

    server = tinker_server()
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"say {w}"},
                                 {"role": "assistant", "content": f"{w} {w} {w}"}]}) + "\n"
        for w in ("apple", "pear", "plum", "fig")
    ))
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=str(tinker_model), renderer_name="role_colon",
                                            max_length=128, batch_size=4)
    config = train.Config(
        log_path=str(tmp_path / "sl"), model_name=str(tinker_model), recipe_name="floe_sl", renderer_name="role_colon",
        dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(data)),
        learning_rate=1e-2, lr_schedule="constant", num_epochs=8, lora_rank=8, base_url=server.url,
        save_every=0, eval_every=0,
    )
    asyncio.run(train.main(config))
    nll = [r["train_mean_nll"] for r in _rows(tmp_path / "sl" / "metrics.jsonl") if "train_mean_nll" in r]
    assert len(nll) == 8
    assert nll[-1] < 0.8 * nll[0], nll


# The cookbook's RL loop as a command a user reruns (the config of _rl_config, in a process of
# its own so that the test can restart the server under it).
RL_COMMAND = """
import asyncio, sys
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.rl import train

url, model, log, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
dataset = ArithmeticDatasetBuilder(batch_size=2, model_name_for_tokenizer=model, renderer_name="role_colon",
                                   n_batches=20, group_size=2)
asyncio.run(train.main(train.Config(
    learning_rate=1e-3, model_name=model, recipe_name="floe_test", max_tokens=4, log_path=log,
    dataset_builder=dataset, renderer_name="role_colon", eval_every=0, save_every=2, lora_rank=4,
    base_url=url, loss_fn="importance_sampling", max_steps=steps)))
"""


def test_cookbook_rl_loop_resumes_after_the_server_died_mid_run(tinker_server, tinker_model: Path,
                                                                tmp_path: Path) -> None:
    """The server is killed (SIGKILL) and restarted after the run's first checkpoint: the
    running command fails (its run is lost); the same command again resumes from its last
    checkpoint (made before the restart) and finishes, no step redone. The registry lists both
    runs, the first as corrupted, with its checkpoints."""
    import tinker  # noqa: PLC0415

    server = tinker_server()
    port = int(server.url.rsplit(":", 1)[1])
    script, log = tmp_path / "rl_command.py", tmp_path / "rl"
    script.write_text(RL_COMMAND)
    command = [sys.executable, str(script), server.url, str(tinker_model), str(log), "6"]
    env = {**os.environ, "TINKER_API_KEY": API_KEY}
    with (tmp_path / "first.log").open("w") as out:
        first = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while not (log / "checkpoints.jsonl").is_file() or not _rows(log / "checkpoints.jsonl"):
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.05)
        server.stop(signal.SIGKILL)  # mid-run: the loop goes on sampling and training against nothing
        server = tinker_server(state_dir=server.state_dir, port=port)
        try:
            first_rc = first.wait(180)
        finally:
            first.kill()
    first_log = (tmp_path / "first.log").read_text()
    # It fails: on its lost run ('no longer live ... a crash or kill'), or on a request whose
    # result the killed server never kept, whichever it waits for first.
    assert first_rc != 0 and ("crash or kill" in first_log or "unknown or expired" in first_log), first_log[-3000:]
    before = _rows(log / "checkpoints.jsonl")
    assert before and before[-1]["batch"] < 6

    second = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert f"Resumed training from {before[-1]['state_path']}" in second.stdout + second.stderr
    rows = _rows(log / "checkpoints.jsonl")
    assert rows[:len(before)] == before and rows[-1]["name"] == "final" and rows[-1]["batch"] == 6
    assert [r["batch"] for r in rows[len(before):]] == [b for b in (4, 6) if b > before[-1]["batch"]] + [6]
    steps = [r["step"] for r in _rows(log / "metrics.jsonl")]
    assert sorted(steps) == list(range(7)) and len(steps) == len(set(steps))  # every step once, none redone

    rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    runs = {r.training_run_id: r for r in rest.list_training_runs().result().training_runs}
    old, new = before[-1]["state_path"].split("/")[2], rows[-1]["state_path"].split("/")[2]
    assert set(runs) == {old, new} and runs[old].corrupted and not runs[new].corrupted
    assert runs[old].user_metadata == runs[new].user_metadata == {"renderer_name": "role_colon"}
    old_paths = {c.tinker_path for c in rest.list_checkpoints(old).result().checkpoints}
    assert {r["state_path"] for r in before} <= old_paths
