"""First use, item 12: `floe sft` on a user's chat or prompt/completion data: a JSONL file, a
parquet file and a dataset saved by `datasets`, each checked before the model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import floe
from floe.cli import main
from floe.models import make_tiny
from floe.rl.config import SftDataConfig
from floe.rl.sft import load_rows

from .conftest import run_floe

CHAT = [{"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi there"}]}]


def _target_logprob(model: Path, prompt: str, answer: str) -> float:
    client = floe.connect(floe.BackendConfig(model=str(model), reference={"enabled": False}))
    tok = client.tokenizer()
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    answer_ids = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
    res = client.forward(floe.Batch([floe.Group(prompt_ids, [floe.Sample(answer_ids)])]))
    client.close()
    return float(sum(res.logprobs[0][0]))


def test_sft_on_a_chat_jsonl_learns_the_assistant_turns(recipe, tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    out = tmp_path / "sft_chat"
    path = recipe(name="sft", extra=f'\n[sft]\ndata = "{data}"\n\n[warm_start]\nsteps = 15\nbatch_size = 2\nlr = 3e-3\nwarmup_steps = 0\n')
    assert main(["sft", path, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1]) == {"model": str(out)}
    assert "sft 1/15 loss " in captured.err and "sft 15/15 loss " in captured.err  # floe sft, not a warm start
    assert "warm start" not in captured.err
    base = make_tiny(tmp_path / "base", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    prompt = "<|user|>Say hi<|end|><|assistant|>"
    before, after = _target_logprob(base, prompt, "hi there"), _target_logprob(out, prompt, "hi there")
    assert after > before + 5.0, (before, after)  # the target became far more likely


def test_parquet_and_a_saved_datasets_dataset_read_the_same_rows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "2+2=", "completion": "4"}, {"prompt": "3+3=", "completion": "6"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pc.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    assert load_rows(SftDataConfig(data=str(tmp_path / "pc.parquet"))) == rows
    assert load_rows(SftDataConfig(data=str(tmp_path / "saved"))) == rows
    with pytest.raises(floe.InvalidInput, match="has no split 'test'; splits: train"):
        load_rows(SftDataConfig(data=str(tmp_path / "saved"), split="test"))


@pytest.mark.parametrize("source", ["parquet", "saved"])
def test_floe_sft_trains_on_parquet_and_saved_datasets(recipe, tmp_path, source):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": a}]}
            for q, a in (("2+2=", "4"), ("3+3=", "6"))]  # conversational prompt/completion rows
    if source == "parquet":
        data = tmp_path / "pc.parquet"
        pq.write_table(pa.Table.from_pylist([{"prompt": "2+2=", "completion": "4"}] * 2), data)
    else:
        data = tmp_path / "saved"
        datasets.Dataset.from_list(rows).save_to_disk(str(data))
    out = tmp_path / f"out_{source}"
    result = run_floe("sft", recipe(name=source), "--sft.data", json.dumps(str(data)), "--warm_start.steps", "2",
                      "--warm_start.batch_size", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert (out / "config.json").is_file() and (out / "floe_export.json").is_file()


def test_a_bad_row_fails_naming_it_before_the_model_loads(recipe, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(CHAT[0]) + "\n" + json.dumps({"question": "x", "answer": "y"}) + "\n")
    result = run_floe("sft", recipe(name="bad"), "--sft.data", json.dumps(str(data)), "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "floe sft: error: recipe.sft.data: row 1: has neither 'messages' nor 'prompt' + 'completion' (columns: "
        "question, answer); set [sft] messages_field / prompt_field / completion_field")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "o").exists()
