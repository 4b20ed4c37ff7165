"""Remote backend benchmark: wire-format throughput, and HTTP vs in-process overhead.

    .venv/bin/python benchmarks/bench_http.py            # both parts, defaults below
    .venv/bin/python benchmarks/bench_http.py --no-http  # wire format only

1. Wire: encode/decode a forward_backward request of G groups x S samples x T tokens (prompt
   P tokens, sampling log-probs, reference log-probs, a scalar advantage) and its result
   (per-token log-probs); MB/s over the encoded size, with JSON alongside for scale.
2. HTTP overhead: the same forward_backward batch (smaller, CPU-sized) through an embedded
   backend and through a local `python -m floe.server`; median seconds of several calls.
Results go to docs/benchmarks.md, "Remote backend (HTTP)".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

import floe
from floe import Batch, Group, Sample
from floe.models import make_tiny
from floe.protocol import wire
from floe.types import ForwardBackwardResult


def make_batch(groups: int, samples: int, tokens: int, prompt: int, vocab: int, seed: int = 0) -> Batch:
    rng = random.Random(seed)
    f32 = np.float32

    def logprobs() -> list[float]:
        return (-np.abs(np.random.default_rng(rng.randrange(2**31)).standard_normal(tokens))).astype(f32).tolist()

    return Batch([
        Group([rng.randrange(vocab) for _ in range(prompt)], [
            Sample([rng.randrange(vocab) for _ in range(tokens)], logprobs=logprobs(), advantage=rng.gauss(0, 1), ref_logprobs=logprobs())
            for _ in range(samples)
        ])
        for _ in range(groups)
    ])


def best_of(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_wire(args: argparse.Namespace) -> None:
    batch = make_batch(args.groups, args.samples, args.tokens, args.prompt_tokens, vocab=150_000)
    kwargs = {"batch": batch, "loss": "ppo", "loss_config": {"kl": {"coef": 0.05}}}
    body = wire.encode_request("forward_backward", kwargs)
    mb = len(body) / 1e6
    enc = best_of(lambda: wire.encode_request("forward_backward", kwargs), args.repeat)
    dec = best_of(lambda: wire.decode_request("forward_backward", body), args.repeat)
    as_json = json.dumps(dataclasses.asdict(batch))
    jenc = best_of(lambda: json.dumps(dataclasses.asdict(batch)), 1)
    jdec = best_of(lambda: json.loads(as_json), 1)
    result = ForwardBackwardResult({"loss": 0.1}, [[s.logprobs for s in g.samples] for g in batch.groups], "ppo", {})  # type: ignore[misc]
    rbody = wire.encode_result("forward_backward", result)
    renc = best_of(lambda: wire.encode_result("forward_backward", result), args.repeat)
    rdec = best_of(lambda: wire.decode_result("forward_backward", rbody), args.repeat)
    n_tok = batch.num_sample_tokens
    print(f"## wire: {args.groups} groups x {args.samples} samples x {args.tokens} tokens (prompt {args.prompt_tokens}), {n_tok} sample tokens")
    print("| message | size MB | encode s | encode MB/s | decode s | decode MB/s |")
    print("|---|---|---|---|---|---|")
    print(f"| forward_backward request (floe wire) | {mb:.2f} | {enc:.3f} | {mb / enc:.0f} | {dec:.3f} | {mb / dec:.0f} |")
    print(f"| same batch as JSON (for scale) | {len(as_json) / 1e6:.2f} | {jenc:.3f} | {len(as_json) / 1e6 / jenc:.0f} | {jdec:.3f} | {len(as_json) / 1e6 / jdec:.0f} |")
    print(f"| forward_backward result (log-probs) | {len(rbody) / 1e6:.2f} | {renc:.3f} | {len(rbody) / 1e6 / renc:.0f} | {rdec:.3f} | {len(rbody) / 1e6 / rdec:.0f} |")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_http(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="floe-bench-http-"))
    model = make_tiny(tmp / "tiny", hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers)
    config = tmp / "serve.toml"
    # prefix_dedup off: on CPU the shared-prefix path is slower, and it is the same on both sides
    config.write_text(f'model = "{model}"\nstate_dir = "{tmp / "states"}"\n[compute]\nprefix_dedup = "off"\n')
    batch = make_batch(args.fb_groups, args.fb_samples, args.fb_tokens, args.fb_prompt_tokens, vocab=100)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "floe.server", str(config), "--port", str(port), "--log-level", "warning"])
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("server did not start")
            time.sleep(0.2)
        local = floe.connect(floe.BackendConfig(model=str(model), state_dir=str(tmp / "local"), compute={"prefix_dedup": "off"}))
        remote = floe.connect(url)
        transport = remote.transport
        body = wire.encode_request("forward_backward", {"batch": batch, "loss": "ppo"})
        rows: dict[str, list[float]] = {k: [] for k in ("local", "http", "op", "encode", "wire", "decode")}
        for client in (local, remote):
            client.forward_backward(batch, loss="ppo")  # warm-up
        for _ in range(args.repeat):  # interleaved, so load changes hit both placements alike
            rows["local"].append(best_of(lambda: local.forward_backward(batch, loss="ppo"), 1))
            rows["http"].append(best_of(lambda: remote.forward_backward(batch, loss="ppo"), 1))
            t0 = time.perf_counter()
            encoded = wire.encode_request("forward_backward", {"batch": batch, "loss": "ppo"})
            t1 = time.perf_counter()
            response = transport.request("POST", "/api/forward_backward", content=encoded)  # unordered: no seq headers
            t2 = time.perf_counter()
            wire.decode_result("forward_backward", response.content)
            t3 = time.perf_counter()
            op = float(response.headers["Server-Timing"].split("dur=")[1]) / 1000
            rows["op"].append(op)
            rows["encode"].append(t1 - t0)
            rows["wire"].append(t2 - t1 - op)
            rows["decode"].append(t3 - t2)
        info = {name: statistics.median(best_of(c.info, 1) for _ in range(50)) for name, c in (("local", local), ("http", remote))}
        med = {k: statistics.median(v) for k, v in rows.items()}
        local.close()
        remote.close()
        print(f"\n## forward_backward, {args.fb_groups} groups x {args.fb_samples} samples x {args.fb_tokens} tokens "
              f"(prompt {args.fb_prompt_tokens}), tiny Qwen3 hidden={args.hidden} layers={args.layers}, CPU, "
              f"{args.repeat} interleaved calls; request {len(body) / 1e6:.2f} MB")
        print("| measure | median ms |")
        print("|---|---|")
        print(f"| in-process forward_backward | {med['local'] * 1000:.1f} |")
        print(f"| HTTP forward_backward (client call) | {med['http'] * 1000:.1f} |")
        print(f"| of which backend time on the server (Server-Timing) | {med['op'] * 1000:.1f} |")
        print(f"| HTTP overhead: client encode | {med['encode'] * 1000:.2f} |")
        print(f"| HTTP overhead: transfer + server decode/encode + ordering | {med['wire'] * 1000:.2f} |")
        print(f"| HTTP overhead: client decode | {med['decode'] * 1000:.2f} |")
        print(f"| info() round trip, in-process / HTTP | {info['local'] * 1000:.3f} / {info['http'] * 1000:.2f} |")
        overhead = med["encode"] + med["wire"] + med["decode"]
        print(f"\nHTTP overhead per forward_backward: {overhead * 1000:.1f} ms ({overhead / med['op'] * 100:.1f}% of the backend time)")
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--fb-groups", type=int, default=8)
    p.add_argument("--fb-samples", type=int, default=8)
    p.add_argument("--fb-tokens", type=int, default=128)
    p.add_argument("--fb-prompt-tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions (best / median of these)")
    p.add_argument("--no-http", action="store_true", help="only the wire-format part")
    args = p.parse_args()
    bench_wire(args)
    if not args.no_http:
        bench_http(args)


if __name__ == "__main__":
    main()
