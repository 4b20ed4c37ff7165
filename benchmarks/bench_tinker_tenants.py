"""Many Tinker tenants on one `floe serve`: step time and server memory of 8 concurrent LoRA
runs (each its own API key and ServiceClient) against one run alone, on the same server
build, through the unmodified tinker SDK.

One step of a run = forward_backward (cross_entropy, 8 datums of 48 tokens) + optim_step +
save_weights_and_get_sampling_client + sample (4 samples, 16 new tokens): the calls of an RL
step. Arms (each on a fresh server process, so memory is the arm's own):
  alone        1 run
  8 at once    8 runs in parallel threads
  8, bounded   8 runs in parallel with `[server] tinker_max_live_runs = 4` and
               `tinker_max_live_samplers = 4` (runs and samplers offloaded to disk and back)
Reported per arm: median seconds per step of one run, steps/s over all runs, and the server's
peak resident memory (VmHWM of /proc/<pid>/status) and its growth over the server idle with
the model loaded. The model is a random-init Qwen3 (d256, 4 layers).

    TINKER_PY=~/.cache/floe-ci/tinker-<hash>/bin/python   # scripts/ci/tinker.sh builds it
    $TINKER_PY benchmarks/bench_tinker_tenants.py               # 6 steps per run
    $TINKER_PY benchmarks/bench_tinker_tenants.py --steps 3 --runs 4
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import matplotlib
from common import image_path, progress_bar, tiny_model_dir, write_json

KEYS = [f"tml-bench-tenant-{i:02d}" for i in range(16)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class Server:
    def __init__(self, model: Path, work: Path, extra: str = ""):
        self.port = _free_port()
        config = work / f"serve-{self.port}.toml"
        keys = ", ".join(f'"{k}"' for k in KEYS)
        config.write_text(f'[backend]\nmodel = "{model}"\nstate_dir = "{work / f"states-{self.port}"}"\nseed = 0\n\n'
                          f"[server]\ntinker_api_keys = [{keys}]\n{extra}\n")
        self.log = open(work / f"server-{self.port}.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "floe.server", str(config), "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            raise RuntimeError("server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def run_steps(url: str, key: str, model: Path, steps: int, seed: int, times: list[float]) -> None:
    import tinker  # noqa: PLC0415 - only in the tinker environment
    from tinker import types  # noqa: PLC0415

    service = tinker.ServiceClient(base_url=url, api_key=key)
    training = service.create_lora_training_client(base_model=str(model), rank=16, seed=seed).result()
    seqs = [[8 + (seed * 31 + 7 * i + j) % 90 for j in range(49)] for i in range(8)]
    datums = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                          loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)}) for s in seqs]
    for _ in range(steps):
        t0 = time.perf_counter()
        fb = training.forward_backward(datums, "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=1e-3))
        fb.result()
        step.result()
        sampler = training.save_weights_and_get_sampling_client().result()
        sampler.sample(types.ModelInput.from_ints(seqs[0][:8]), num_samples=4,
                       sampling_params=types.SamplingParams(max_tokens=16, temperature=1.0)).result()
        times.append(time.perf_counter() - t0)
    service.close("success").result()  # ends the session: its samplers go, no heartbeat outlives the arm


def arm(model: Path, work: Path, runs: int, steps: int, extra: str, progress: Any, task: Any) -> dict[str, Any]:
    server = Server(model, work, extra)
    idle = _kib(server.proc.pid, "VmRSS")
    per_run: list[list[float]] = [[] for _ in range(runs)]
    errors: list[str] = []

    def worker(i: int) -> None:
        try:
            run_steps(server.url, KEYS[i], model, steps, i, per_run[i])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"run {i}: {exc!r}")
        progress.advance(task, steps)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(runs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    peak = _kib(server.proc.pid, "VmHWM")
    server.stop()
    if errors:
        raise RuntimeError("; ".join(errors))
    steady = [t for times in per_run for t in times[1:]]  # the first step of a run includes its creation
    return {"runs": runs, "steps_per_run": steps, "median_step_s": statistics.median(steady),
            "min_step_s": min(steady), "steps_per_s": runs * steps / wall, "wall_s": wall,
            "idle_rss_mib": idle / 1024, "peak_rss_mib": peak / 1024, "growth_mib": (peak - idle) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    model = tiny_model_dir(256, 4)
    arms = {"alone": (1, ""), f"{args.runs} at once": (args.runs, ""),
            f"{args.runs}, bounded": (args.runs, "tinker_max_live_runs = 4\ntinker_max_live_samplers = 4")}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, progress_bar() as progress:
        for name, (runs, extra) in arms.items():
            task = progress.add_task(name, total=runs * args.steps)
            results[name] = arm(model, Path(tmp), runs, args.steps, extra, progress, task)
    out = {"model": "qwen3 d256 x 4 layers (random init), LoRA rank 16", "arms": results}
    write_json("tinker_tenants", out)
    for name, r in results.items():
        print(f"{name:>12}: {r['median_step_s']:.3f} s/step (median), {r['steps_per_s']:.2f} steps/s in all, "
              f"peak RSS {r['peak_rss_mib']:.0f} MiB (+{r['growth_mib']:.0f} over idle)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    names = list(results)
    a.bar(names, [results[n]["median_step_s"] for n in names], color="#4a7ab5")
    a.set_ylabel("seconds per step of one run (median)")
    b.bar(names, [results[n]["peak_rss_mib"] for n in names], color="#b5744a")
    b.set_ylabel("server peak RSS (MiB)")
    for ax in (a, b):
        ax.tick_params(axis="x", labelrotation=15)
    fig.suptitle("Tinker tenants on one floe serve (2-core CPU)")
    fig.tight_layout()
    fig.savefig(image_path("tinker_tenants"), dpi=120)


if __name__ == "__main__":
    main()
