"""Helpers shared by the benchmark scripts: tiny models, GRPO batches, fair timing, output.

Timing is noisy on small shared machines, so arms are *interleaved* (every repetition runs
each arm once, in a rotating order) after a warm-up, and the minimum over repetitions is
reported next to the median. Results go to benchmarks/results/<name>.json and plots to
docs/img/<name>.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import floe
from floe.models import make_tiny

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
IMAGES = ROOT / "docs" / "img"
MODELS = Path(tempfile.gettempdir()) / "floe-bench-models"


def tiny_model_dir(hidden_size: int = 256, layers: int = 4, heads: int = 4, kv_heads: int = 2) -> Path:
    """A random-init tiny Qwen3 (char tokenizer), built once and cached in the temp dir."""
    path = MODELS / f"qwen3_d{hidden_size}_l{layers}_h{heads}_kv{kv_heads}"
    if not (path / "config.json").exists():
        make_tiny(
            path, hidden_size=hidden_size, intermediate_size=3 * hidden_size, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=8192,
        )
    return path


def response_lengths(rng: random.Random, n: int, max_len: int) -> list[int]:
    """Variable-length responses: uniform in [max_len / 2, max_len]."""
    return [rng.randint(max(1, max_len // 2), max_len) for _ in range(n)]


def grpo_batch(vocab: int, prompt_len: int, response_len: int, n: int, groups: int = 1, seed: int = 0) -> floe.Batch:
    """`groups` GRPO groups of n variable-length samples, with advantages and old log-probs."""
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        prompt = [rng.randrange(8, vocab) for _ in range(prompt_len)]
        samples = []
        for r in response_lengths(rng, n, response_len):
            samples.append(
                floe.Sample(
                    tokens=[rng.randrange(8, vocab) for _ in range(r)],
                    logprobs=[-4.6 + rng.uniform(-0.3, 0.3) for _ in range(r)],
                    advantage=rng.uniform(-1.0, 1.0),
                )
            )
        out.append(floe.Group(prompt, samples))
    return floe.Batch(out)


def time_interleaved(
    arms: dict[str, Callable[[], Any]], reps: int, warmup: int = 1, progress: Progress | None = None
) -> dict[str, list[float]]:
    """Seconds per call of each arm; arms rotate order every repetition."""
    names = list(arms)
    for _ in range(warmup):
        for name in names:
            arms[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    task = progress.add_task("  reps", total=reps * len(names)) if progress else None
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            start = time.perf_counter()
            arms[name]()
            times[name].append(time.perf_counter() - start)
            if progress and task is not None:
                progress.advance(task)
    if progress and task is not None:
        progress.remove_task(task)
    return times


def summary(times: list[float]) -> dict[str, float]:
    return {"min_s": min(times), "median_s": statistics.median(times), "max_s": max(times)}


def progress_bar() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=False
    )


def environment() -> dict[str, Any]:
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=2))
    return path


def image_path(name: str) -> Path:
    IMAGES.mkdir(parents=True, exist_ok=True)
    return IMAGES / f"{name}.png"


def model_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """The options every model benchmark shares: tiny-model size, repetitions, threads, name."""
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="1 is the most stable on a shared 2-core VM")
    parser.add_argument("--name", default=name, help="results file and plot name")


def two_bar_chart(name: str, labels: list[str], baseline: tuple[str, list[float]], floe_values: list[float],
                  notes: list[str], ylabel: str, title: str) -> None:
    """Baseline vs floe, one pair of bars per configuration, a note over each floe bar."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], baseline[1], 0.4, label=baseline[0])
    ax.bar([i + 0.2 for i in x], floe_values, 0.4, label="floe")
    for i, note in enumerate(notes):
        ax.text(i + 0.2, floe_values[i], note, ha="center", va="bottom")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(image_path(name), dpi=110)
