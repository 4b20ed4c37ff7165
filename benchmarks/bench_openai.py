"""Concurrent OpenAI requests against `floe serve`: throughput and latency, with and without
request batching (floe.server.batching).

    .venv/bin/python benchmarks/bench_openai.py                     # CPU, tiny model, defaults below
    .venv/bin/python benchmarks/bench_openai.py --device cuda --hidden 1024 --layers 8

A real `python -m floe.server` process serves a random-init tiny Qwen3 (char tokenizer). For
each arm (batching window `--window-ms`, and window 0 = every request its own sample call)
and each number of clients C (`--clients`, default 1 8 32), C concurrent clients of the
real `openai` SDK (AsyncOpenAI) each send `--requests` completions one after another: a
random prompt of `--prompt-tokens` tokens, `max_tokens` = `--tokens`, `ignore_eos` so every
request generates exactly that many tokens. Reported: requests/s and generated tokens/s over
the wall time of all C clients, and per-request latency p50/p99. For scale, the same C
samples as ONE request with n = C (the batched ceiling). Both servers run at once and the
arms are interleaved (`--reps` repetitions, rotating order, a warm-up request first); the
repetition with the shortest wall time is reported (the machine's least disturbed run), all
of them are in the JSON.
Results: benchmarks/results/openai.json and openai.png; docs/benchmarks.md, "OpenAI endpoints".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import matplotlib
import openai

from floe.models import make_tiny

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp: Path, model: Path, window_ms: float, device: str) -> tuple[subprocess.Popen, str]:
    config = tmp / f"serve-{window_ms:g}.toml"
    config.write_text(
        f'[backend]\nmodel = "{model}"\nstate_dir = "{tmp / "states"}"\ndevice = "{device}"\n\n'
        f"[server]\nopenai_batch_window_ms = {window_ms}\n"
    )
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "floe.server", str(config), "--port", str(port), "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("server did not start")
        time.sleep(0.2)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def run_clients(url: str, clients: int, requests: int, prompts: list[list[int]], tokens: int) -> dict[str, float]:
    sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)  # up to 1000 connections
    latencies: list[float] = []
    generated = 0

    async def client(c: int) -> None:
        nonlocal generated
        for r in range(requests):
            prompt = prompts[(c * requests + r) % len(prompts)]
            t0 = time.perf_counter()
            out = await sdk.completions.create(model="bench", prompt=prompt, max_tokens=tokens, extra_body={"ignore_eos": True})
            latencies.append(time.perf_counter() - t0)
            generated += out.usage.completion_tokens if out.usage else 0

    try:
        await sdk.completions.create(model="bench", prompt=prompts[0], max_tokens=tokens)  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        wall = time.perf_counter() - start
        t0 = time.perf_counter()
        await sdk.completions.create(model="bench", prompt=prompts[0], max_tokens=tokens, n=clients, extra_body={"ignore_eos": True})
        one_call = time.perf_counter() - t0
    finally:
        await sdk.close()
    return {
        "clients": clients, "requests": len(latencies), "wall_s": wall,
        "requests_per_s": len(latencies) / wall, "tokens_per_s": generated / wall,
        "p50_s": statistics.median(latencies), "p99_s": percentile(latencies, 0.99),
        "one_request_n_clients_s": one_call,
    }


def plot(results: dict[str, list[dict[str, float]]], path: Path) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for arm, rows in results.items():
        xs = [r["clients"] for r in rows]
        ax1.plot(xs, [r["tokens_per_s"] for r in rows], marker="o", label=arm)
        ax2.plot(xs, [r["p50_s"] for r in rows], marker="o", label=f"{arm} p50")
        ax2.plot(xs, [r["p99_s"] for r in rows], marker="x", linestyle="--", label=f"{arm} p99")
    for ax, title, ylabel in ((ax1, "throughput", "generated tokens / s"), (ax2, "latency per request", "seconds")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens of each request (ignore_eos: all generated)")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--window-ms", type=float, default=5)
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions per arm and client count")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--name", default="openai", help="results/<name>.json and .png")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="floe-bench-openai-"))
    model = make_tiny(tmp / "bench", hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                      max_position_embeddings=4096)
    rng = random.Random(0)
    prompts = [[rng.randrange(8, 100) for _ in range(args.prompt_tokens)] for _ in range(64)]
    arms = {f"batched ({args.window_ms:g} ms window)": args.window_ms, "unbatched": 0.0}
    servers = {arm: start_server(tmp, model, window, args.device) for arm, window in arms.items()}
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    try:
        for clients in args.clients:
            order = list(arms)
            tried: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
            for r in range(args.reps):
                for arm in order[r % 2 :] + order[: r % 2]:
                    tried[arm].append(asyncio.run(run_clients(servers[arm][1], clients, args.requests, prompts, args.tokens)))
            for arm in arms:
                runs[arm].extend(tried[arm])
                row = min(tried[arm], key=lambda x: x["wall_s"])
                results[arm].append(row)
                print(f"{arm:>28} clients={clients:>3}  {row['requests_per_s']:7.2f} req/s  {row['tokens_per_s']:8.1f} tok/s"
                      f"  p50 {row['p50_s']:.3f}s  p99 {row['p99_s']:.3f}s  (one request n={clients}: {row['one_request_n_clients_s']:.3f}s)")
    finally:
        for proc, _url in servers.values():
            proc.terminate()
            proc.wait(60)
    RESULTS.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers

    payload = {
        "command": " ".join(["benchmarks/bench_openai.py", *sys.argv[1:]]),
        "settings": vars(args),
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__, "openai": openai.__version__,
                        "cpus": __import__("os").cpu_count(), "device": args.device},
        "results": results,
        "all_runs": runs,
    }
    (RESULTS / f"{args.name}.json").write_text(json.dumps(payload, indent=2))
    plot(results, RESULTS / f"{args.name}.png")
    print(f"wrote {RESULTS / args.name}.json and .png")


if __name__ == "__main__":
    main()
