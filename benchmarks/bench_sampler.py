"""Sampler throughput: floe's torch sampler engine against transformers `generate`, same model.

Both sample `--prompts` prompts of P tokens, n completions each, exactly R new tokens per
completion (no stopping: floe `stop_at_eos=False`; HF `min_new_tokens = max_new_tokens = R`, `use_cache=True`),
temperature 1, no top-k/top-p, fp32, KV cache. floe prefills each prompt once and shares
its cache among the n samples; HF `generate(num_return_sequences=n)` expands the prompt n
times before prefill. Reported: generated tokens per second (min time of the reps).

    .venv/bin/python benchmarks/bench_sampler.py [--quick]
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import torch
from common import model_arguments, progress_bar, summary, time_interleaved, tiny_model_dir, two_bar_chart, write_json

from floe.backend.sampler import prompt_seeds
from floe.models.loading import load_model, load_tokenizer
from floe.sampler.torch_engine import TorchEngine
from floe.types import SamplingParams


def run_config(model_dir: str, P: int, R: int, n: int, prompts: int, reps: int, progress) -> dict[str, Any]:
    model = load_model(model_dir)
    tok = load_tokenizer(model_dir)
    engine = TorchEngine(load_model(model_dir), tok, max_batch_sequences=256)
    old_engine = TorchEngine(load_model(model_dir), tok, max_batch_sequences=256, shared_prefix=False)
    rng = random.Random(P + n)
    batch = [[rng.randrange(8, model.config.vocab_size) for _ in range(P)] for _ in range(prompts)]
    params = SamplingParams(max_tokens=R, temperature=1.0, stop_at_eos=False, seed=0)
    ids = torch.tensor(batch)

    def floe_run(e: TorchEngine = engine) -> None:
        groups = e.generate(batch, n, params, seeds=prompt_seeds(0, len(batch)), version=0)
        assert sum(len(s.tokens) for g in groups for s in g.samples) == prompts * n * R

    @torch.inference_mode()
    def hf_run() -> None:
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            num_return_sequences=n, max_new_tokens=R, min_new_tokens=R, pad_token_id=tok.pad_token_id,
            use_cache=True,  # the tiny model config says use_cache=False; generate must use its KV cache
        )
        assert out.shape == (prompts * n, P + R)

    times = time_interleaved({"floe": floe_run, "floe_old": lambda: floe_run(old_engine), "hf_generate": hf_run}, reps, progress=progress)
    tokens = prompts * n * R
    out: dict[str, Any] = {"P": P, "R": R, "n": n, "prompts": prompts, "tokens": tokens}
    for arm, t in times.items():
        out[arm] = {**summary(t), "tokens_per_s": tokens / min(t)}
    out["speedup"] = out["floe"]["tokens_per_s"] / out["hf_generate"]["tokens_per_s"]
    out["speedup_old_path"] = out["floe_old"]["tokens_per_s"] / out["hf_generate"]["tokens_per_s"]
    return out


def plot(results: list[dict[str, Any]], name: str) -> None:
    two_bar_chart(
        name, [f"n={r['n']}" for r in results],
        ("transformers generate", [r["hf_generate"]["tokens_per_s"] for r in results]),
        [r["floe"]["tokens_per_s"] for r in results], [f"{r['speedup']:.1f}×" for r in results],
        "generated tokens / s",
        f"Sampling, P={results[0]['P']}, R={results[0]['R']}, {results[0]['prompts']} prompt(s)",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--n", type=int, nargs="+", default=None, help="samples per prompt (default 4 8 16)")
    model_arguments(ap, "sampler")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = str(tiny_model_dir(args.hidden, args.layers))
    ns = args.n or ([8] if args.quick else [4, 8, 16])
    results = []
    with progress_bar() as progress:
        task = progress.add_task("n", total=len(ns))
        for n in ns:
            r = run_config(model_dir, args.prompt_len, args.new_tokens, n, args.prompts, args.reps, progress)
            results.append(r)
            progress.advance(task)
            progress.console.print(
                f"n={n}: floe {r['floe']['tokens_per_s']:.0f} tok/s, generate "
                f"{r['hf_generate']['tokens_per_s']:.0f} tok/s -> {r['speedup']:.2f}x "
                f"(old path {r['floe_old']['tokens_per_s']:.0f} tok/s, {r['speedup_old_path']:.2f}x)"
            )
            write_json(args.name, {"model": {"hidden": args.hidden, "layers": args.layers}, "results": results})
    plot(results, args.name)


if __name__ == "__main__":
    main()
