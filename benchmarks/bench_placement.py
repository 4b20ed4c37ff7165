"""GRPO step time: the local placement vs the Ray placement on this machine.

One step = seeded `sample` (16 prompts × 4 samples, 16 new tokens) → rewards → reference
`forward` → `forward_backward` (ppo + k3 KL) → `optim_step` → `sync_weights`, the same calls on
both backends (`floe.backend.Backend` in this process). The Ray arm uses 2 policy ranks
(FSDP2, gloo), 2 sampler replicas and the reference on its own worker, on a local Ray cluster
started here (8 logical CPUs over the machine's cores), with the broadcast sync. Arms are
interleaved after a warm-up (benchmarks/common.py); the per-phase seconds are medians.

    RAY_PY=~/.cache/floe-ci/ray-<hash>/bin/python   # scripts/ci/ray.sh builds it
    $RAY_PY benchmarks/bench_placement.py            # tiny (d64, 2 layers) and small (d256, 4 layers)
    $RAY_PY benchmarks/bench_placement.py --reps 2 --models tiny
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import matplotlib
from common import image_path, progress_bar, summary, tiny_model_dir, write_json

import floe
from floe.backend import Backend
from floe.grpo import batch_from_samples
from floe.types import Batch, Group, Sample

PROMPTS = [[8 + (5 * i + j) % 60 for j in range(4 + i % 5)] for i in range(16)]
LOSS = {"kl": {"coef": 0.05, "estimator": "k3"}}
RAY = {"kind": "ray", "policy": {"workers": 2}, "sampler": {"workers": 2}, "reference": {"cpus": 1},
       "sync": "broadcast", "call_timeout_s": 600}
MODELS = {"tiny": (64, 2), "small": (256, 4)}


def step(backend: Backend, index: int, phases: dict[str, list[float]]) -> None:
    t0 = time.perf_counter()
    out = backend.sample(PROMPTS, 4, floe.SamplingParams(max_tokens=16, temperature=1.0, seed=index))
    t1 = time.perf_counter()
    rewards = [[sum(t % 2 == 0 for t in s.tokens) / max(len(s.tokens), 1) for s in g.samples] for g in out.groups]
    batch = batch_from_samples(out, rewards)
    ref = backend.forward(batch, zone="reference")
    batch = Batch([Group(g.prompt, [Sample(s.tokens, s.logprobs, s.advantage, s.weights, lp, s.temperature)
                                    for s, lp in zip(g.samples, lps)]) for g, lps in zip(batch.groups, ref.logprobs)])
    backend.forward_backward(batch, "ppo", LOSS)
    backend.optim_step()
    t2 = time.perf_counter()
    backend.sync_weights()
    t3 = time.perf_counter()
    for name, seconds in (("sample", t1 - t0), ("train", t2 - t1), ("sync", t3 - t2)):
        phases.setdefault(name, []).append(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--name", default="placement")
    args = parser.parse_args()
    import ray  # noqa: PLC0415 - needs the ray extra

    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    results: dict[str, Any] = {}
    with progress_bar() as progress, tempfile.TemporaryDirectory() as tmp:
        for model_name in args.models:
            hidden, layers = MODELS[model_name]
            model = tiny_model_dir(hidden_size=hidden, layers=layers)
            common = {"model": str(model), "num_threads": 1, "state_dir": str(Path(tmp) / model_name)}
            started = time.perf_counter()
            local = Backend(floe.BackendConfig(**common))
            local_start = time.perf_counter() - started
            started = time.perf_counter()
            on_ray = Backend(floe.BackendConfig(**common, placement=RAY))
            ray_start = time.perf_counter() - started
            arms = {"local": local, "ray": on_ray}
            phases: dict[str, dict[str, list[float]]] = {name: {} for name in arms}
            times: dict[str, list[float]] = {name: [] for name in arms}
            task = progress.add_task(f"{model_name}", total=(args.reps + 1) * len(arms))
            for rep in range(args.reps + 1):  # rep 0 warms up
                order = list(arms) if rep % 2 == 0 else list(reversed(arms))
                for name in order:
                    start = time.perf_counter()
                    step(arms[name], rep, phases[name] if rep else {})
                    if rep:
                        times[name].append(time.perf_counter() - start)
                    progress.advance(task)
            results[model_name] = {
                "hidden": hidden, "layers": layers, "start_s": {"local": local_start, "ray": ray_start},
                **{name: {**summary(times[name]), **{f"{p}_median_s": statistics.median(v) for p, v in phases[name].items()}}
                   for name in arms},
            }
            local.close()
            on_ray.close()
    ray.shutdown()
    write_json(args.name, {"command": "benchmarks/bench_placement.py", "reps": args.reps, "ray": RAY, "results": results})
    plot(args.name, results)
    for model_name, r in results.items():
        print(f"{model_name}: local {r['local']['median_s']:.2f} s/step, ray {r['ray']['median_s']:.2f} s/step "
              f"(sample {r['local']['sample_median_s']:.2f} vs {r['ray']['sample_median_s']:.2f}, "
              f"train {r['local']['train_median_s']:.2f} vs {r['ray']['train_median_s']:.2f}, "
              f"sync {r['local']['sync_median_s']:.3f} vs {r['ray']['sync_median_s']:.3f})")


def plot(name: str, results: dict[str, Any]) -> None:
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6.5, 4))
    labels = list(results)
    for k, arm in enumerate(("local", "ray")):
        bottom = [0.0] * len(labels)
        for p, color in (("sample", "tab:blue"), ("train", "tab:orange"), ("sync", "tab:green")):
            values = [results[m][arm][f"{p}_median_s"] for m in labels]
            ax.bar([i + (k - 0.5) * 0.4 for i in range(len(labels))], values, 0.38, bottom=bottom, color=color,
                   label=p if k == 0 else None, edgecolor="black", hatch="" if arm == "local" else "//")
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(labels)), [f"{m}\nlocal | ray (hatched)" for m in labels])
    ax.set_ylabel("seconds per GRPO step (median)")
    ax.set_title("local vs Ray placement (2 policy ranks, 2 replicas), 2-core CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(image_path(name), dpi=110)


if __name__ == "__main__":
    main()
