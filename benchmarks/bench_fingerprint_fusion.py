"""Would fusing the receiver's fingerprint into the copy pay on this CPU? (issue 22, item 1)

The local in-place sync copies each published tensor into the sampler's and then fingerprints
the destination (`floe.sampler.engine.fingerprint`): two passes over the bytes. Fused, each
chunk of `--chunk-mb` is fingerprinted right after it is copied, while it is still in cache; the
chunk fingerprints combine exactly into the whole tensor's (chunks are whole fingerprint blocks,
so the word sums add and each chunk's block-weighted sum shifts by its first block index), which
this script checks against `fingerprint` for every tensor before timing.

Arms, on the 0.6B-shaped Qwen3 state dict (bench_sync.make_tensors, bf16, random values),
interleaved (benchmarks/common.time_interleaved), `--threads` torch threads:
* **copy**: `dst.copy_(src)` of every tensor (the bandwidth floor of the receiver's work);
* **copy, then fingerprint**: the copy, then `fingerprint(dst)` of every tensor (today's path);
* **fused, chunk C**: per tensor, copy and fingerprint chunk by chunk.

    .venv/bin/python benchmarks/bench_fingerprint_fusion.py --reps 5

Results: benchmarks/results/fingerprint_fusion.json (docs/benchmarks.md, "Weight sync across processes").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sync import make_tensors, nbytes
from common import environment, summary, time_interleaved, write_json

from floe.sampler.engine import BLOCK_WORDS, Fingerprint, _words, fingerprint

WRAP = 2**64


def _signed(x: int) -> int:
    x %= WRAP
    return x - WRAP if x >= 2**63 else x


@torch.no_grad()
def copy_fingerprinted(dst: torch.Tensor, src: torch.Tensor, chunk_words: int) -> Fingerprint:
    """dst.copy_(src) chunk by chunk, each chunk fingerprinted after its copy; equal to
    fingerprint(dst) (`chunk_words` a multiple of BLOCK_WORDS)."""
    d, s = _words(dst), _words(src)
    words = weighted = 0
    for a in range(0, d.numel(), chunk_words):
        b = min(d.numel(), a + chunk_words)
        d[a:b].copy_(s[a:b])
        c = d[a:b]
        full = (b - a) // BLOCK_WORDS
        sums = c[: full * BLOCK_WORDS].view(full, BLOCK_WORDS).sum(1)
        if b - a > full * BLOCK_WORDS:
            sums = torch.cat([sums, c[full * BLOCK_WORDS:].sum().reshape(1)])
        index = torch.arange(a // BLOCK_WORDS + 1, a // BLOCK_WORDS + 1 + sums.numel(), dtype=torch.int64)
        w, x = torch.stack([sums.sum(), (sums * index).sum()]).tolist()
        words, weighted = words + w, weighted + x
    return Fingerprint(_signed(words), _signed(weighted), str(dst.dtype).removeprefix("torch."), tuple(dst.shape))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk-mb", type=float, action="append", help="default: 1 and 8")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    chunks = args.chunk_mb or [1.0, 8.0]
    src = make_tensors("0.6b", random=True)
    dst = {k: torch.empty_like(t) for k, t in src.items()}
    sizes = {c: max(1, int(c * 2**20 / 8 / BLOCK_WORDS)) * BLOCK_WORDS for c in chunks}
    for name, t in src.items():  # the fused fingerprint is the fingerprint, before anything is timed
        for words in sizes.values():
            assert copy_fingerprinted(dst[name], t, words) == fingerprint(dst[name]) == fingerprint(t), name

    def copy() -> None:
        for k, t in src.items():
            dst[k].copy_(t)

    def copy_then_fingerprint() -> None:
        for k, t in src.items():
            dst[k].copy_(t)
            fingerprint(dst[k])

    arms = {"copy": copy, "copy, then fingerprint": copy_then_fingerprint}
    for c, words in sizes.items():
        arms[f"fused, chunk {c:g} MB"] = lambda words=words: [copy_fingerprinted(dst[k], t, words)
                                                              for k, t in src.items()]
    times = time_interleaved(arms, args.reps)
    floor = min(times["copy"])
    results = {name: {**summary(ts), "fingerprint_share": 1 - floor / min(ts)} for name, ts in times.items()}
    for name, r in results.items():
        print(f"{name:28s} {r['min_s'] * 1e3:7.1f} ms min, {r['median_s'] * 1e3:7.1f} ms median; "
              f"fingerprint {100 * r['fingerprint_share']:4.1f} % of it")
    write_json("fingerprint_fusion", {"bytes": nbytes(src), "threads": args.threads, "reps": args.reps,
                                      "arms": results, "environment": environment()})


if __name__ == "__main__":
    main()
