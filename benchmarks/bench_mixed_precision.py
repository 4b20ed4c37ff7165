"""Mixed precision: the default recipe's first GRPO steps in float32 and in bfloat16.

Both runs start from the same warm-started tiny model (the recipe's cached SFT warm start,
trained in fp32) with the same seed, and run `recipes/reverse_text.toml` through floe's own
GRPO loop (`floe.rl.loop.Trainer`, public client API) with the overrides

    --backend.dtype {float32,bfloat16} --train.steps 20 --eval.every 0 --eval.size 16
    --output.checkpoint_every 0 --output.progress false

Per step it records the PPO loss, grad norm and train reward (metrics.jsonl) and the fraction
of the trained weights that the step changed (the fp32 masters in bf16; measured around each
`optim_step` on the in-process backend). bf16 samples from bf16 weights, so after a few
steps the two runs see different rollouts: the comparison is of two runs, not of one batch.

    .venv/bin/python benchmarks/bench_mixed_precision.py               # 20 steps each (~3 min on 2 cores)
    .venv/bin/python benchmarks/bench_mixed_precision.py --steps 5     # a quick look

Writes benchmarks/results/<name>.json and docs/img/<name>.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import matplotlib
from common import ROOT, image_path, write_json

import floe
from floe.cli import load_recipe
from floe.rl.loop import Trainer
from floe.rl.warmstart import prepare_model
from floe.types import OptimStepResult

DTYPES = ("float32", "bfloat16")


class ChangeTracker:
    """A client that, around each optim_step, measures the fraction of trained weights changed.

    Everything else passes through to the wrapped in-process client unchanged."""

    def __init__(self, client: floe.Client):
        self._client = client
        self._policy = client.transport.backend.policy  # in-process: the live policy zone
        self.fractions: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def optim_step(self) -> OptimStepResult:
        before = [t.detach().clone() for t in self._policy.trained]
        result = self._client.optim_step()
        changed = sum(int((t.detach() != b).sum()) for t, b in zip(self._policy.trained, before))
        self.fractions.append(changed / sum(b.numel() for b in before))
        return result


def run(dtype: str, steps: int, workdir: Path) -> dict[str, Any]:
    """One run of the default recipe; per-step loss, grad norm, reward, fraction changed."""
    recipe, _ = load_recipe([
        str(ROOT / "recipes" / "reverse_text.toml"),
        "--backend.dtype", dtype, "--train.steps", str(steps), "--eval.every", "0", "--eval.size", "16",
        "--output.checkpoint_every", "0", "--output.progress", "false", "--output.run_dir", str(workdir / dtype),
    ])
    client = floe.connect(recipe.backend_config(prepare_model(recipe)))
    tracker = ChangeTracker(client)
    try:
        summary = Trainer(recipe).run(tracker)  # type: ignore[arg-type] - a client with one method measured
    finally:
        client.close()
    rows = [json.loads(line) for line in (workdir / dtype / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] >= 1 and "loss" in r]
    per_step = len(tracker.fractions) // len(rows)  # optim steps per train step (train.minibatches)
    return {
        "loss": [r["loss"] for r in rows],
        "grad_norm": [r["grad_norm"] for r in rows],
        "reward_mean": [r["reward_mean"] for r in rows],
        "fraction_changed": [
            statistics.fmean(tracker.fractions[i * per_step : (i + 1) * per_step]) for i in range(len(rows))
        ],
        "eval_reward": summary.eval_rewards,
        "seconds": summary.seconds,
    }


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    a, b = runs["float32"], runs["bfloat16"]
    dl = [abs(x - y) for x, y in zip(a["loss"], b["loss"])]
    dc = [abs(x - y) for x, y in zip(a["fraction_changed"], b["fraction_changed"])]
    dg = [abs(x - y) / x for x, y in zip(a["grad_norm"], b["grad_norm"])]
    dr = [abs(x - y) for x, y in zip(a["reward_mean"], b["reward_mean"])]
    return {
        "max_abs_loss_diff": max(dl),
        "mean_abs_loss_diff": statistics.fmean(dl),
        "mean_abs_loss_fp32": statistics.fmean(abs(x) for x in a["loss"]),
        "max_fraction_changed_diff": max(dc),
        "min_fraction_changed_fp32": min(a["fraction_changed"]),
        "min_fraction_changed_bf16": min(b["fraction_changed"]),
        "max_rel_grad_norm_diff": max(dg),
        "mean_rel_grad_norm_diff": statistics.fmean(dg),
        "max_abs_reward_diff": max(dr),
        "mean_abs_reward_diff": statistics.fmean(dr),
        "mean_reward_fp32": statistics.fmean(a["reward_mean"]),
        "mean_reward_bf16": statistics.fmean(b["reward_mean"]),
    }


def plot(name: str, runs: dict[str, dict[str, Any]]) -> Path:
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for dtype, style in zip(DTYPES, ("-o", "--x")):
        r = runs[dtype]
        steps = range(1, len(r["loss"]) + 1)
        axes[0].plot(steps, r["loss"], style, label=dtype, markersize=3)
        axes[1].plot(steps, r["fraction_changed"], style, label=dtype, markersize=3)
        axes[2].plot(steps, r["reward_mean"], style, label=dtype, markersize=3)
    for ax, title in zip(axes, ("PPO loss", "fraction of weights changed per step", "train reward")):
        ax.set_title(title)
        ax.set_xlabel("GRPO step")
        ax.legend()
    fig.suptitle("reverse_text recipe: float32 vs bfloat16 (fp32 masters)")
    fig.tight_layout()
    path = image_path(name)
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--name", default="mixed_precision")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="floe-bench-mp-") as tmp:
        runs = {dtype: run(dtype, args.steps, Path(tmp)) for dtype in DTYPES}
    stats = compare(runs)
    out = write_json(args.name, {"steps": args.steps, "comparison": stats, "runs": runs})
    image = plot(args.name, runs)
    print(json.dumps(stats, indent=2))
    for dtype in DTYPES:
        print(f"{dtype}: {runs[dtype]['seconds']:.1f} s, eval reward {runs[dtype]['eval_reward']}")
    print(f"wrote {out} and {image}")


if __name__ == "__main__":
    main()
