"""Peak memory of the log-prob pass: floe's chunked LM head + log-softmax against the naive one.

Hidden states [N, d] and an LM head [V, d] (synthetic, fp32) go through
* naive: logits = h @ W.T ([N, V] fp32), log_softmax, gather, entropy; backward;
* floe: `compute.logprobs.token_logprobs` with `chunk_tokens` = 256 / 1024 / 4096
  (chunked, each chunk checkpointed and recomputed in backward).
Each arm runs in a fresh subprocess; the figure is the rise of the process's peak RSS
(`ru_maxrss`) above the level after the inputs were built, for forward+backward (train) and
forward only (no grad). Also reports seconds (min of reps) and the max abs difference from naive.

    .venv/bin/python benchmarks/bench_logprob_memory.py [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time
from typing import Any

import torch
from common import image_path, progress_bar, write_json


def _inputs(n: int, d: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=g) * 0.5
    weight = torch.randn(vocab, d, generator=g) * 0.05
    targets = torch.randint(0, vocab, (n,), generator=g)
    return hidden, weight, targets


def _naive(hidden, weight, targets):
    logits = hidden @ weight.T
    logsm = torch.log_softmax(logits.float(), dim=-1)
    logp = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logsm.exp() * logsm).sum(-1)
    return logp, ent


def _arm(arm: str, n: int, d: int, vocab: int, grad: bool, reps: int, queue) -> None:
    from floe.compute.logprobs import token_logprobs

    torch.set_num_threads(1)
    hidden, weight, targets = _inputs(n, d, vocab)
    hidden.requires_grad_(grad)
    weight.requires_grad_(grad)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, logp = [], None
    for _ in range(reps):
        start = time.perf_counter()
        with torch.set_grad_enabled(grad):
            if arm == "naive":
                logp, ent = _naive(hidden, weight, targets)
            else:
                logp, ent = token_logprobs(hidden, weight, None, targets, 1.0, True, int(arm))
            if grad:
                (logp.sum() + 0.01 * ent.sum()).backward()
                hidden.grad = weight.grad = None
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ref, _ = _naive(hidden.detach(), weight.detach(), targets)
    queue.put({"peak_mib": (peak - base) / 1024, "min_s": min(times), "max_abs_err": float((logp.detach() - ref).abs().max())})


def measure(arm: str, n: int, d: int, vocab: int, grad: bool, reps: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_arm, args=(arm, n, d, vocab, grad, reps, queue))
    proc.start()
    out = queue.get()
    proc.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--name", default="logprob_memory")
    args = ap.parse_args()
    n = 2048 if args.quick else args.tokens
    arms = ["naive", "256", "1024", "4096"]
    results = []
    with progress_bar() as progress:
        task = progress.add_task("arms", total=2 * len(arms))
        for grad in (True, False):
            for arm in arms:
                r = {"arm": arm, "grad": grad, **measure(arm, n, args.hidden, args.vocab, grad, args.reps)}
                results.append(r)
                progress.advance(task)
                progress.console.print(
                    f"{'train' if grad else 'no-grad'} {arm:>6}: +{r['peak_mib']:.0f} MiB, {r['min_s']:.2f}s, "
                    f"err {r['max_abs_err']:.1e}"
                )
    logits_mib = n * args.vocab * 4 / 2**20
    write_json(args.name, {"tokens": n, "hidden": args.hidden, "vocab": args.vocab, "logits_mib": logits_mib, "results": results})

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for k, grad in enumerate((True, False)):
        rows = [r for r in results if r["grad"] == grad]
        ax.bar([i + (k - 0.5) * 0.4 for i in range(len(rows))], [r["peak_mib"] for r in rows], 0.4,
               label="forward + backward" if grad else "forward, no grad")
    ax.set_xticks(range(len(arms)), ["naive"] + [f"chunk {a}" for a in arms[1:]])
    ax.set_ylabel("peak RSS rise (MiB)")
    ax.set_title(f"Log-prob pass memory, N={n}, d={args.hidden}, V={args.vocab} ([N,V] fp32 = {logits_mib:.0f} MiB)")
    ax.title.set_fontsize(9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(image_path(args.name), dpi=110)


if __name__ == "__main__":
    main()
