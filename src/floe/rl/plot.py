"""`floe plot RUN_DIR`: reward, KL and entropy curves from metrics.jsonl as PNG files."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from floe.rl.metrics import read_jsonl

PANELS = [
    ("reward.png", "reward", [("reward_mean", "train reward (mean of samples)"), ("eval/reward_mean", "held-out reward")]),
    ("kl.png", "KL", [("kl_sampler_k3", "KL(sampler ‖ policy), k3"), ("kl_ref_k3", "KL(policy ‖ reference), k3")]),
    ("entropy.png", "entropy (nats/token)", [("entropy", "policy entropy")]),
]


def plot_run(run_dir: str | Path) -> list[Path]:
    run_dir = Path(run_dir)
    records = read_jsonl(run_dir / "metrics.jsonl")
    if not records:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl is missing or empty")
    written = []
    for filename, ylabel, series in PANELS:
        fig, ax = plt.subplots(figsize=(7, 4))
        drawn = False
        for key, label in series:
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(points) < 20 else None, label=label)
                drawn = True
        if not drawn:
            plt.close(fig)
            continue
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{run_dir.name}: {ylabel}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = run_dir / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
