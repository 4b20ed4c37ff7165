"""Sampler engines: floe's torch engine, the vLLM engine and transformers `generate`, same model.

Every arm samples `prompts` prompts of P random tokens, n completions each, exactly R new
tokens per completion (no stopping), temperature 1, no top-k/top-p, fp32; floe's engines also
return per-token log-probs (the vLLM engine computes them over the full vocabulary at every
step, as floe's contract asks). Shapes: P=512, n=8, R=64 with 2 prompts and with a larger
batch (16 prompts by default). vLLM's prefix cache is reset before each of its calls, so no
repetition reuses an earlier one's prompt KV blocks (within a call, a prompt's n samples
share them). Arms are interleaved; tokens/s is from the minimum time of the repetitions.

Also measured: engine start (seconds in `floe.sampler.build_engine`: the torch engine copies
the policy model; vLLM starts its engine core, allocates its KV cache, compiles unless
`enforce_eager`, then receives the policy's weights) and a weight update (`load_weights` of
the policy's state dict, then the fingerprints `sync_weights` verifies).

Runs in the vLLM environment (scripts/ci/vllm.sh builds it):

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind \\
        ~/.cache/floe-ci/vllm-<hash>/bin/python benchmarks/bench_engines.py [--quick]

Writes benchmarks/results/engines.json and benchmarks/results/engines.png.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import matplotlib
import torch
from common import RESULTS, model_arguments, progress_bar, summary, time_interleaved, tiny_model_dir, write_json

from floe.backend.sampler import prompt_seeds
from floe.config import TorchEngineConfig, VllmEngineConfig
from floe.models.loading import load_model, load_tokenizer
from floe.sampler import EngineSource, build_engine
from floe.sampler.registry import engine_start_seconds
from floe.types import SamplingParams


def engine_configs(max_len: int, kv_gib: float) -> dict[str, Any]:
    """The engines under test: torch, and vLLM compiled (its default) and eager."""
    vllm_common = {"max_model_len": max_len, "kv_cache_memory_gib": kv_gib, "max_num_seqs": 256}
    return {
        "torch": TorchEngineConfig(max_batch_sequences=256),
        "vllm": VllmEngineConfig(**vllm_common),
        "vllm_eager": VllmEngineConfig(**vllm_common, enforce_eager=True),
    }


def start(config: Any, source: EngineSource, threads: int) -> tuple[Any, dict[str, float]]:
    """One engine and its start, weight-update and update-plus-fingerprint seconds."""
    engine = build_engine(config, source)
    torch.set_num_threads(threads)  # the same thread count for every arm
    state = source.model.state_dict()
    began = time.perf_counter()
    engine.load_weights(state)
    loaded = time.perf_counter() - began
    engine.fingerprints()
    return engine, {"start_s": float(engine_start_seconds(engine) or 0.0), "load_weights_s": loaded,
                    "load_and_fingerprint_s": time.perf_counter() - began}


def run_config(policy: Any, built: dict[str, Any], P: int, R: int, n: int, prompts: int, reps: int,
               progress: Any) -> dict[str, Any]:
    """Tokens/s of every engine in `built` and of HF generate on one shape, interleaved."""
    tok_pad = policy.config.pad_token_id if policy.config.pad_token_id is not None else 0
    rng = random.Random(P + n + prompts)
    batch = [[rng.randrange(8, policy.config.vocab_size) for _ in range(P)] for _ in range(prompts)]
    params = SamplingParams(max_tokens=R, temperature=1.0, stop_at_eos=False, seed=0)
    ids = torch.tensor(batch)
    tokens = prompts * n * R

    def engine_arm(engine: Any) -> Any:
        def run() -> None:
            llm = getattr(engine, "llm", None)
            if llm is not None:
                llm.reset_prefix_cache()
            groups = engine.generate(batch, n, params, seeds=prompt_seeds(0, len(batch)), version=0)
            assert sum(len(s.tokens) for g in groups for s in g.samples) == tokens
        return run

    @torch.inference_mode()
    def hf_run() -> None:
        out = policy.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            num_return_sequences=n, max_new_tokens=R, min_new_tokens=R, pad_token_id=tok_pad, use_cache=True,
        )
        assert out.shape == (prompts * n, P + R)

    arms = {name: engine_arm(engine) for name, engine in built.items()}
    arms["hf_generate"] = hf_run
    times = time_interleaved(arms, reps, progress=progress)
    out: dict[str, Any] = {"P": P, "R": R, "n": n, "prompts": prompts, "tokens": tokens}
    for arm, t in times.items():
        out[arm] = {**summary(t), "tokens_per_s": tokens / min(t)}
    return out


def plot(results: list[dict[str, Any]], arms: list[str]) -> None:
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(arms)
    for j, arm in enumerate(arms):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(results))]
        values = [r[arm]["tokens_per_s"] for r in results]
        ax.bar(xs, values, width, label=arm)
        for x, v in zip(xs, values):
            ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(results)), [f"{r['prompts']} prompts × n={r['n']}" for r in results], fontsize=8)
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"Sampler engines, P={results[0]['P']}, R={results[0]['R']} (CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "engines.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the 2-prompt shape only")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--large-prompts", type=int, default=16, help="prompts in the larger batch")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    model_arguments(ap, "engines")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = str(tiny_model_dir(args.hidden, args.layers))
    policy = load_model(model_dir)
    source = EngineSource(policy, model_dir, load_tokenizer(model_dir))
    configs = engine_configs(args.prompt_len + args.new_tokens + 64, args.kv_cache_gib)
    shapes = [2] if args.quick else [2, args.large_prompts]
    costs: dict[str, dict[str, float]] = {}
    phases: list[dict[str, Any]] = []
    payload: dict[str, Any] = {"model": {"hidden": args.hidden, "layers": args.layers}, "threads": args.threads,
                               "engine_costs": costs, "phases": phases}
    torch_engine, costs["torch"] = start(configs["torch"], source, args.threads)
    # One vLLM engine alive at a time (each owns its engine core); every phase interleaves it
    # with the torch engine and HF generate on every shape.
    with progress_bar() as progress:
        for name in ("vllm", "vllm_eager"):
            engine, costs[name] = start(configs[name], source, args.threads)
            progress.console.print(name, {k: round(v, 3) for k, v in costs[name].items()})
            built = {"torch": torch_engine, name: engine}
            for prompts in shapes:
                r = run_config(policy, built, args.prompt_len, args.new_tokens, args.n, prompts, args.reps, progress)
                phases.append(r)
                progress.console.print(f"{prompts} prompts x n={args.n}: " + ", ".join(
                    f"{arm} {r[arm]['tokens_per_s']:.0f} tok/s" for arm in [*built, "hf_generate"]))
                write_json(args.name, payload)
            engine.close()
    payload["results"] = results = combine(phases, shapes)
    write_json(args.name, payload)
    plot(results, ["torch", "vllm", "vllm_eager", "hf_generate"])


def combine(phases: list[dict[str, Any]], shapes: list[int]) -> list[dict[str, Any]]:
    """Per shape, every arm's best tokens/s over the phases that ran it."""
    results = []
    for prompts in shapes:
        runs = [p for p in phases if p["prompts"] == prompts]
        row: dict[str, Any] = {k: runs[0][k] for k in ("P", "R", "n", "prompts", "tokens")}
        for arm in ("torch", "vllm", "vllm_eager", "hf_generate"):
            row[arm] = {"tokens_per_s": max(p[arm]["tokens_per_s"] for p in runs if arm in p)}
        results.append(row)
    return results


if __name__ == "__main__":
    main()
