"""Weight sync across processes on CPU: seconds and bytes per sync, against memcpy bandwidth.

For the tests' tiny Qwen3 (fp32, hidden 64, 2 layers) and Qwen3-0.6B/1.7B-shaped models (bf16,
the real dimensions from bench_gpu.SHAPES, random values), with the tensors a sync moves (the
model's state dict, built on the meta device and filled at random):

* **local in-place copy** (one process, `local.InPlaceCopy`'s work): fingerprint the published
  tensors, copy them into the sampler's tensors in place (`copy_in_place`), fingerprint those;
* **gloo broadcast 1 → 2** (three processes, `floe.backend.sync.broadcast`): rank 0
  `send_weights` in `--bucket-mb` buckets (fingerprints included), ranks 1–2 `receive_weights`,
  copy each bucket in place and fingerprint what they hold; timed from a barrier before to a
  barrier after (every receiver done); the receivers' fingerprints are checked against rank 0's;
* **shared memory 1 → 2** (three processes, `floe.backend.sync.shared`): the sender
  `SharedSegment.write`s the weights in `--bucket-mb` buckets into its reused /dev/shm segment
  (finiteness and fingerprints included) and hands the JSON handle over; both receivers at once
  `apply_shared` it (map, validate, copy each bucket in place) and fingerprint what they hold;
  timed by the sender like the gloo arm, from a barrier before the write to a barrier after
  every receiver is done; the receivers' fingerprints are checked against the sender's. (On a
  GPU the same module shares a GPU buffer by CUDA IPC instead; this CPU benchmark does not run
  that path.)
* **memcpy**: one `torch` copy of a buffer of the same number of bytes (the bandwidth bound);
* **fingerprints**: the exact int64 block fingerprint of every tensor, once (part of both syncs);
* **finiteness**: the cheap non-finite check (`nonfinite`), once (part of both syncs);
* **raw gloo broadcast**: `torch.distributed.broadcast` of the same number of bytes, in
  `--bucket-mb` pieces, 1 → 2, same processes (the cross-process bound).

Every process runs with `--threads` torch threads (1: the machine has 2 shared cores). Results:
benchmarks/results/sync.json and docs/img/sync.png.

    .venv/bin/python benchmarks/bench_sync.py
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import SHAPES
from common import image_path, progress_bar, write_json

# The tests' tiny model (tests/conftest.py: make_tiny(hidden_size=64, num_hidden_layers=2)).
TINY = {"vocab_size": 105, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": False}
MODELS: dict[str, tuple[dict[str, Any], torch.dtype]] = {
    "tiny": (TINY, torch.float32),
    "0.6b": (SHAPES["0.6b"], torch.bfloat16),
    "1.7b": (SHAPES["1.7b"], torch.bfloat16),
}


def named_shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    """(state-dict name, shape) of every tensor a sync of `model` moves."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        net = Qwen3ForCausalLM(Qwen3Config(**MODELS[model][0]))
    return [(name, tuple(t.shape)) for name, t in net.state_dict().items()]


def make_tensors(model: str, random: bool) -> dict[str, torch.Tensor]:
    dtype = MODELS[model][1]
    g = torch.Generator().manual_seed(0)
    if not random:
        return {name: torch.empty(shape, dtype=dtype) for name, shape in named_shapes(model)}
    return {name: (torch.rand(shape, generator=g) - 0.5).to(dtype) for name, shape in named_shapes(model)}


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _broadcast_worker(rank: int, port: int, model: str, reps: int, bucket_bytes: int, threads: int, out: str) -> None:
    """One process of the 1 → 2 broadcast world; each rank writes its timings and the
    fingerprints it ended with to `out`/rank<r>.json."""
    torch.set_num_threads(threads)
    import torch.distributed as dist

    from floe.backend.sync.broadcast import bucketed, receive_weights, send_weights
    from floe.sampler.engine import copy_in_place, fingerprints

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                            timeout=timedelta(seconds=600))
    tensors = make_tensors(model, random=rank == 0)
    seconds, sent, prints = [], 0, {}
    for _ in range(reps):
        dist.barrier()
        began = time.perf_counter()
        if rank == 0:
            prints, sent = send_weights(dist.group.WORLD, 0, bucketed(tensors.items(), bucket_bytes))
        else:
            for bucket in receive_weights(dist.group.WORLD, 0, "cpu"):
                copy_in_place(tensors, bucket, "bench", partial=True)
            prints = fingerprints(tensors)
        dist.barrier()
        seconds.append(time.perf_counter() - began)
    # raw torch.distributed broadcast of the same bytes, in bucket-sized pieces of one buffer
    size = nbytes(tensors)
    raw = torch.ones(min(bucket_bytes, size), dtype=torch.uint8)
    raw_seconds = []
    for _ in range(reps):
        dist.barrier()
        began = time.perf_counter()
        left = size
        while left > 0:
            piece = raw[: min(left, raw.numel())]
            dist.broadcast(piece, 0)
            left -= piece.numel()
        dist.barrier()
        raw_seconds.append(time.perf_counter() - began)
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"seconds": seconds, "raw_seconds": raw_seconds, "bytes": sent, "fingerprints": prints}))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _three(target: Any, extra: tuple, what: str, out: str, prefix: str) -> list[dict[str, Any]]:
    """Run `target(rank, *extra, out)` in three spawned processes (ranks 0-2) and read each
    rank's `out`/<prefix><rank>.json."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, *extra, out)) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=900)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"{what} workers failed: exit codes {[p.exitcode for p in procs]}")
    return [json.loads(Path(out, f"{prefix}{r}.json").read_text()) for r in range(3)]


def _equal_fingerprints(ranks: list[dict[str, Any]]) -> bool:
    return ranks[0]["fingerprints"] == ranks[1]["fingerprints"] == ranks[2]["fingerprints"]


def broadcast_arm(model: str, reps: int, bucket_bytes: int, threads: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        ranks = _three(_broadcast_worker, (_free_port(), model, reps, bucket_bytes, threads), "broadcast", out, "rank")
        return {"seconds": ranks[0]["seconds"], "raw_seconds": ranks[0]["raw_seconds"], "bytes": ranks[0]["bytes"],
                "fingerprints_equal": _equal_fingerprints(ranks)}


def _shared_worker(rank: int, barrier: Any, model: str, reps: int, bucket_bytes: int, threads: int, out: str) -> None:
    """One process of the shared-memory 1 → 2 arm (rank 0 writes, ranks 1-2 copy); each writes
    its timings and final fingerprints to `out`/shm<r>.json."""
    torch.set_num_threads(threads)
    from floe.backend.sync.broadcast import bucketed
    from floe.backend.sync.shared import SharedSegment, apply_shared
    from floe.sampler.engine import copy_in_place, fingerprints

    tensors = make_tensors(model, random=rank == 0)
    held = {name: str(t.dtype).removeprefix("torch.") for name, t in tensors.items()}
    handle_file = Path(out, "handle.json")
    segment = SharedSegment() if rank == 0 else None
    seconds, sent, prints = [], 0, {}
    try:
        for _ in range(reps + 1):  # the first: warm-up (the segment's creation and page faults)
            barrier.wait()
            began = time.perf_counter()
            if segment is not None:
                handle, prints, sent = segment.write(bucketed(tensors.items(), bucket_bytes))
                handle_file.write_text(json.dumps(handle))
            barrier.wait()  # the handle is out
            if segment is None:
                apply_shared(json.loads(handle_file.read_text()), held,
                             lambda bucket: copy_in_place(tensors, bucket, "bench", partial=True))
                prints = fingerprints(tensors)
            barrier.wait()  # every receiver done
            seconds.append(time.perf_counter() - began)
    finally:
        if segment is not None:
            segment.close()
    Path(out, f"shm{rank}.json").write_text(json.dumps({"seconds": seconds[1:], "bytes": sent, "fingerprints": prints}))


def shared_arm(model: str, reps: int, bucket_bytes: int, threads: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        barrier = multiprocessing.get_context("spawn").Barrier(3, timeout=900)
        ranks = _three(_shared_worker, (barrier, model, reps, bucket_bytes, threads), "shared-memory", out, "shm")
        return {"seconds": ranks[0]["seconds"], "bytes": ranks[0]["bytes"], "fingerprints_equal": _equal_fingerprints(ranks)}


def timed(fn: Any, reps: int) -> list[float]:
    fn()  # warm-up (page faults of fresh buffers)
    out = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        out.append(time.perf_counter() - began)
    return out


def local_arms(model: str, reps: int, progress: Any) -> dict[str, Any]:
    """fingerprints, local in-place copy and memcpy, in this process (buffers freed on return)."""
    from floe.sampler.engine import copy_in_place, fingerprints, nonfinite

    task = progress.add_task(f"{model}: local arms", total=4)
    src, dst = make_tensors(model, random=True), make_tensors(model, random=False)
    size = nbytes(src)
    result: dict[str, Any] = {"bytes": size, "tensors": len(src), "dtype": str(MODELS[model][1])}
    result["fingerprints_s"] = timed(lambda: fingerprints(src), reps)
    progress.advance(task)
    print(f"{model}: fingerprints min {min(result['fingerprints_s']):.3f} s", flush=True)
    result["finiteness_s"] = timed(lambda: nonfinite(src), reps)
    progress.advance(task)
    print(f"{model}: finiteness min {min(result['finiteness_s']):.3f} s", flush=True)

    def local() -> None:
        if nonfinite(src):
            raise RuntimeError("local copy: non-finite weights")
        published = fingerprints(src)
        copy_in_place(dst, src, "bench")
        if fingerprints(dst) != published:
            raise RuntimeError("local copy: fingerprints differ")

    result["local_inplace_s"] = timed(local, reps)
    progress.advance(task)
    print(f"{model}: local in-place min {min(result['local_inplace_s']):.3f} s", flush=True)
    src.clear()  # bound peak memory: two copies of the weights at a time
    dst.clear()
    flat_src = torch.empty(size, dtype=torch.uint8).fill_(1)
    flat_dst = torch.empty_like(flat_src)
    result["memcpy_s"] = timed(lambda: flat_dst.copy_(flat_src), reps)
    progress.advance(task)
    return result


def run_model(model: str, reps: int, bucket_bytes: int, threads: int, progress: Any) -> dict[str, Any]:
    result = local_arms(model, reps, progress)
    size = result["bytes"]
    task = progress.add_task(f"{model}: gloo broadcast 1 → 2 ({reps} reps)", total=1)
    result["broadcast"] = broadcast_arm(model, reps, bucket_bytes, threads)
    result["gloo_broadcast_s"] = result["broadcast"]["seconds"]
    result["raw_gloo_broadcast_s"] = result["broadcast"]["raw_seconds"]
    progress.advance(task)
    print(f"{model}: floe broadcast min {min(result['gloo_broadcast_s']):.3f} s, raw gloo broadcast min "
          f"{min(result['raw_gloo_broadcast_s']):.3f} s", flush=True)
    task = progress.add_task(f"{model}: shared memory 1 → 2 ({reps} reps)", total=1)
    result["shared"] = shared_arm(model, reps, bucket_bytes, threads)
    result["shared_memory_s"] = result["shared"]["seconds"]
    progress.advance(task)
    print(f"{model}: floe shared memory min {min(result['shared_memory_s']):.3f} s", flush=True)
    for arm in ("fingerprints_s", "finiteness_s", "local_inplace_s", "memcpy_s", "gloo_broadcast_s",
                "raw_gloo_broadcast_s", "shared_memory_s"):
        best = min(result[arm])
        result[arm.removesuffix("_s") + "_summary"] = {"min_s": best, "median_s": statistics.median(result[arm]),
                                                       "gb_per_s": size / best / 1e9}
    return result


def plot(results: dict[str, Any], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [("memcpy", "memcpy"), ("fingerprints", "fingerprints"), ("finiteness", "finiteness check"),
            ("local_inplace", "local in-place sync"), ("raw_gloo_broadcast", "raw gloo broadcast 1→2"),
            ("gloo_broadcast", "floe gloo broadcast 1→2"), ("shared_memory", "floe shared memory 1→2")]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    models = sorted(results, key=lambda m: results[m]["bytes"])
    sizes = [results[m]["bytes"] / 1e9 for m in models]
    for arm, label in arms:
        ax.plot(sizes, [results[m][f"{arm}_summary"]["min_s"] for m in models], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("weights (GB; " + ", ".join(models) + ")")
    ax.set_ylabel("seconds (best of reps)")
    ax.set_title("Weight sync on CPU: time vs model size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(image_path(name), dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", choices=sorted(MODELS), help="default: tiny, 0.6b and 1.7b")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="sync", help="results file and plot name")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bucket_bytes = int(args.bucket_mb * 2**20)
    results: dict[str, Any] = {}
    with progress_bar() as progress:
        for model in args.model or ["tiny", "0.6b", "1.7b"]:
            results[model] = run_model(model, args.reps, bucket_bytes, args.threads, progress)
    path = write_json(args.name, {"bucket_bytes": bucket_bytes, "reps": args.reps, "results": results})
    plot(results, args.name)
    print(f"results: {path}")
    for model, res in results.items():
        print(f"{model}: {res['bytes'] / 1e6:.1f} MB in {res['tensors']} tensors ({res['dtype']}); "
              f"fingerprints equal after broadcast: {res['broadcast']['fingerprints_equal']}, after shared memory: "
              f"{res['shared']['fingerprints_equal']}")
        for arm in ("memcpy", "fingerprints", "finiteness", "local_inplace", "raw_gloo_broadcast", "gloo_broadcast",
                    "shared_memory"):
            s = res[f"{arm}_summary"]
            print(f"  {arm:15s} min {s['min_s'] * 1e3:9.2f} ms  median {s['median_s'] * 1e3:9.2f} ms  "
                  f"{s['gb_per_s']:6.2f} GB/s")


if __name__ == "__main__":
    main()
