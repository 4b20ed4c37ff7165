"""Assets for the verl runs: a tiny model (floe.models.make_tiny) and small GSM8K-style
parquet files in verl's RL dataset format. Generated, nothing downloaded."""

from __future__ import annotations

import random
from pathlib import Path

from floe.models import make_tiny


def make_model(path: Path) -> Path:
    return make_tiny(path, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=512)


def _rows(split: str, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        question = f"Tom has {a} apples and buys {b} more. How many apples? End with #### and the number."
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": i, "answer": f"#### {a + b}", "question": question},
        })
    return rows


def make_data(directory: Path, train_rows: int = 24, test_rows: int = 8) -> tuple[Path, Path]:
    import pandas as pd  # noqa: PLC0415 - in the verl environment only

    directory.mkdir(parents=True, exist_ok=True)
    train, test = directory / "train.parquet", directory / "test.parquet"
    pd.DataFrame(_rows("train", train_rows, 0)).to_parquet(train)
    pd.DataFrame(_rows("test", test_rows, 1)).to_parquet(test)
    return train, test
