"""Load: several clients (threads, one connection each) sample concurrently for a few
seconds; no errors, and the latency percentiles are printed (run with -s to see them;
docs/benchmarks.md "HTTP load test" records a run)."""

from __future__ import annotations

import statistics
import threading
import time

from floe import SamplingParams

from .conftest import ServerProcess

CLIENTS, SECONDS = 4, 4.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def test_concurrent_sampling_clients(shared_server: ServerProcess) -> None:
    latencies: list[list[float]] = [[] for _ in range(CLIENTS)]
    errors: list[BaseException] = []
    tokens = [0] * CLIENTS
    barrier = threading.Barrier(CLIENTS)

    def worker(i: int) -> None:
        try:
            with shared_server.client(timeout=60) as client:
                client.info()
                barrier.wait()
                end = time.monotonic() + SECONDS
                while time.monotonic() < end:
                    t0 = time.perf_counter()
                    res = client.sample([[i + 10, 11, 12, 13]], n=4, params=SamplingParams(max_tokens=16))
                    latencies[i].append(time.perf_counter() - t0)
                    tokens[i] += res.num_tokens
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(CLIENTS)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    wall = time.monotonic() - start
    assert not errors, errors
    flat = [x * 1000 for per in latencies for x in per]
    assert all(per for per in latencies)  # every client got through
    print(
        f"\nHTTP load test: {CLIENTS} clients x {SECONDS:g}s, {len(flat)} sample calls (n=4, max_tokens=16), "
        f"{sum(tokens) / wall:.0f} tokens/s, latency ms p50={percentile(flat, 0.5):.1f} p90={percentile(flat, 0.9):.1f} "
        f"p99={percentile(flat, 0.99):.1f} max={max(flat):.1f} mean={statistics.mean(flat):.1f}"
    )
