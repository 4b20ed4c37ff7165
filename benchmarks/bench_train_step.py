"""Training step and log-prob pass: prompt dedup vs padded.

For each (P, R, n) a GRPO batch of `--groups` groups with variable-length responses
(uniform in [R/2, R]) runs through floe's policy zone:

* train: `forward_backward` (PPO, token_mean aggregation, entropy computed) + `optim_step`;
* logprob: the no-grad `forward` pass (what the reference zone and old-log-prob passes run).

Arms: `padded` (prefix_dedup="off": one right-padded row per sample) and `dedup`
(prefix_dedup="on": shared-prefix stream). (An earlier `packed` arm, an unpadded stream
without dedup, went with the layout it measured; older result files still carry it.) The `auto` column records what
prefix_dedup="auto" picks. Speedups are reported next to the FLOP-model ceiling: the token
ratio corrected for the LM head, which dedup does not shrink (attention left out).

    .venv/bin/python benchmarks/bench_train_step.py            # full sweep (~30-60 min on 2 cores)
    .venv/bin/python benchmarks/bench_train_step.py --quick    # 3 configurations
    .venv/bin/python benchmarks/bench_train_step.py --config 1024,128,8 --reps 5 --name train_step_target
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
from common import (
    grpo_batch,
    image_path,
    model_arguments,
    progress_bar,
    summary,
    time_interleaved,
    tiny_model_dir,
    write_json,
)

from floe.backend.policy import PolicyZone
from floe.backend.scoring import plan_batch, uses_prefix_dedup
from floe.compute.losses import resolve_loss
from floe.config import ComputeConfig, OptimizerConfig
from floe.models.loading import load_model
from floe.types import Batch

ARMS = ("padded", "dedup")
BUDGET = 1 << 16  # tokens per micro-batch: one micro-batch per step in every arm


def flop_ceiling(model: torch.nn.Module, batch: Batch, padded: bool, attention: bool = False) -> float:
    """Baseline FLOPs over dedup FLOPs: trunk tokens · 2N + scored tokens · 2dV (the task's
    ceiling: token ratio corrected for the LM head), plus, with `attention`, causal
    (query, key) pairs · 4·heads·head_dim·layers on both sides (dedup: P²/2 + Σ R_i·(P + R_i/2))."""
    cfg = model.config
    layers = model.get_decoder().layers
    trunk = sum(p.numel() for p in layers.parameters())
    head = cfg.hidden_size * cfg.vocab_size
    pair = 2 * cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads) * len(layers)
    base = dedup = 0.0
    for g in batch.groups:
        lens = [len(s.tokens) for s in g.samples]
        p = len(g.prompt)
        rows = [p + max(lens)] * len(lens) if padded else [p + r for r in lens]
        base += sum(rows) * trunk + sum(lens) * head
        dedup += (p + sum(lens)) * trunk + sum(lens) * head
        if attention:
            base += sum(w * w / 2 for w in rows) * pair
            dedup += (p * p / 2 + sum(r * (p + r / 2) for r in lens)) * pair
    return base / dedup


def run_config(model, P: int, R: int, n: int, groups: int, reps: int, progress) -> dict[str, Any]:
    batch = grpo_batch(model.config.vocab_size, P, R, n, groups, seed=P + R + n)
    spec = resolve_loss("ppo", {"aggregation": "token_mean", "clip_low": 0.2, "clip_high": 0.28})
    computes = {
        "padded": ComputeConfig(prefix_dedup="off", max_tokens_per_microbatch=BUDGET),
        "dedup": ComputeConfig(prefix_dedup="on", max_tokens_per_microbatch=BUDGET),
    }
    zone = PolicyZone(model, OptimizerConfig(lr=1e-6), computes["padded"])
    uses_prefix_dedup(model, computes["dedup"])  # installs the shared-prefix attention

    def with_arm(arm: str, fn):
        def run():
            zone.compute = computes[arm]
            return fn()

        return run

    def train():
        zone.forward_backward(batch, spec, temperature=1.0)
        zone.optim_step()

    def logprob():
        with torch.no_grad():
            zone.forward(batch, 1.0, False)

    out: dict[str, Any] = {"P": P, "R": R, "n": n, "groups": groups}
    for kind, fn in (("train", train), ("logprob", logprob)):
        times = time_interleaved({arm: with_arm(arm, fn) for arm in ARMS}, reps, progress=progress)
        out[kind] = {arm: summary(t) for arm, t in times.items()}
    auto = ComputeConfig(prefix_dedup="auto", max_tokens_per_microbatch=BUDGET)
    out["auto_layout"] = plan_batch(batch, auto, True, model)[0].layout
    out["tokens"] = {
        "padded": sum(len(g.samples) * (P + max(len(s.tokens) for s in g.samples)) for g in batch.groups),
        "dedup": sum(P + sum(len(s.tokens) for s in g.samples) for g in batch.groups),
    }
    out["ceiling_vs_padded"] = flop_ceiling(model, batch, padded=True)
    out["ceiling_with_attention_vs_padded"] = flop_ceiling(model, batch, padded=True, attention=True)
    for kind in ("train", "logprob"):
        t = out[kind]
        out[kind]["speedup_vs_padded"] = t["padded"]["min_s"] / t["dedup"]["min_s"]
        auto_arm = "dedup" if out["auto_layout"] == "shared_prefix" else "padded"
        out[kind]["auto_vs_padded"] = t["padded"]["min_s"] / t[auto_arm]["min_s"]
    return out


def plot(results: list[dict[str, Any]], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    labels = [f"P{r['P']}\nR{r['R']}\nn{r['n']}" for r in results]
    x = range(len(results))
    series = [
        ("ceiling: tokens + LM head", lambda r, k: r["ceiling_vs_padded"], "#bbb"),
        ("ceiling: + attention", lambda r, k: r.get("ceiling_with_attention_vs_padded", 0.0), "#ddd"),
        ("dedup vs padded", lambda r, k: r[k]["speedup_vs_padded"], "C0"),
        ("auto vs padded", lambda r, k: r[k]["auto_vs_padded"], "C2"),
    ]
    width = 0.16
    for ax, kind in zip(axes, ("train", "logprob")):
        for j, (label, value, color) in enumerate(series):
            offset = (j - 1.5) * width
            ax.bar([i + offset for i in x], [value(r, kind) for r in results], width, label=label, color=color)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_title(f"{'training step' if kind == 'train' else 'no-grad log-prob pass'}: speedup (min of reps)")
    axes[0].set_ylabel("× faster")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(image_path(name), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 configurations instead of the full sweep")
    ap.add_argument("--groups", type=int, default=1)
    model_arguments(ap, "train_step")
    ap.add_argument("--config", action="append", default=[], metavar="P,R,N", help="run only these (repeatable)")
    ap.add_argument("--ceilings-only", action="store_true", help="recompute the ceilings in an existing JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_model(str(tiny_model_dir(args.hidden, args.layers)))
    if args.ceilings_only:
        import json

        from common import RESULTS

        path = RESULTS / f"{args.name}.json"
        data = json.loads(path.read_text())
        for r in data["results"]:
            batch = grpo_batch(model.config.vocab_size, r["P"], r["R"], r["n"], r["groups"], seed=r["P"] + r["R"] + r["n"])
            r["ceiling_with_attention_vs_padded"] = flop_ceiling(model, batch, padded=True, attention=True)
        path.write_text(json.dumps(data, indent=2))
        plot(data["results"], args.name)
        return
    if args.config:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.config]
    elif args.quick:
        configs = [(1024, 128, 8), (256, 256, 4), (2048, 64, 16)]
    else:
        configs = list(itertools.product((256, 1024, 2048), (64, 256), (4, 8, 16)))
        configs.insert(0, (1024, 128, 8))  # the target configuration
    results = []
    with progress_bar() as progress:
        task = progress.add_task("configs", total=len(configs))
        for P, R, n in configs:
            progress.update(task, description=f"P={P} R={R} n={n}")
            results.append(run_config(model, P, R, n, args.groups, args.reps, progress))
            progress.advance(task)
            r = results[-1]
            progress.console.print(
                f"P={P:5d} R={R:4d} n={n:2d} | train padded {r['train']['padded']['min_s']:.2f}s "
                f"dedup {r['train']['dedup']['min_s']:.2f}s "
                f"-> {r['train']['speedup_vs_padded']:.2f}x (ceiling {r['ceiling_vs_padded']:.2f}x) | "
                f"logprob {r['logprob']['speedup_vs_padded']:.2f}x | auto={r['auto_layout']}"
            )
            write_json(args.name, {"model": {"hidden": args.hidden, "layers": args.layers}, "results": results})
    plot(results, args.name)


if __name__ == "__main__":
    main()
