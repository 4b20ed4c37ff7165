"""tinker-cookbook 0.6.1's own loops against `floe serve`: the RL loop (arithmetic environment,
importance_sampling) runs and resumes from its checkpoint; the supervised loop on a local JSONL
file lowers the loss. Offline: the tokenizer is the tiny model's local directory."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

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
