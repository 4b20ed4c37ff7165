"""One-GPU benchmark of the RL loop on real Qwen3 shapes (random init): start, sample, train, sync.

For every `--shape` (the real Qwen3-0.6B / Qwen3-1.7B dimensions, or `tiny` for a CPU smoke
run) and every `--engine` (torch; vllm where it is importable), one embedded backend is
started through the public API (`floe.connect(BackendConfig(...))`) and runs `--warmup`
untimed and `--reps` timed iterations of a GRPO-like step:

    sample(prompts, n)  ->  forward_backward(batch, "ppo") + optim_step()  ->  sync_weights()

Reported per (shape, engine), in benchmarks/results/gpu_<shape>.json and .png:

* **engine start** (s): `info().capabilities["sampler_engine_start_seconds"]` (vLLM: engine
  core, KV cache, CUDA graphs / compile, first weight push), and the whole `connect` (s).
* **sampling**: generated tokens / s (exactly `new_tokens` per sample, no stopping).
* **training step**: seconds of forward_backward(ppo) + optim_step; trained (sample) tokens / s;
  MFU = model FLOPs / (seconds x `--peak-tflops`), model FLOPs = 6 N_mm T_proc + 6 V H T_scored
  + 12 L (heads x head_dim) S_attn, where N_mm are the transformer blocks' matmul weights,
  T_proc the tokens that must go through them (each group's prompt once, plus every sample),
  T_scored the sample tokens (the LM head runs only where a log-prob is needed), and S_attn the
  causal query-key pairs (a sample attends to its prompt and its own earlier tokens).
* **peak memory** (GiB): `torch.cuda.max_memory_allocated`, reset before each phase.
* **sync_weights**: seconds, bytes and GB/s (`SyncResult`).

Each (shape, engine) runs in its own child process (JSON in and out, no pickle), so GPU memory
and vLLM's process-wide state start clean and one failure (e.g. out of memory) does not lose
the other results. Models are built once into the temp dir with a tokenizer that covers the
whole 151936-token vocabulary (nothing is downloaded).

On the lent H200 (needs a CUDA build of torch; vLLM is optional):

    python benchmarks/bench_gpu.py --shape 0.6b --shape 1.7b --engine torch --engine vllm

CPU smoke run (< 2 minutes):

    python benchmarks/bench_gpu.py --shape tiny --device cpu --engine torch --threads 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import MODELS, RESULTS, write_json

# The real Qwen3 dimensions (Hugging Face config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-1.7B);
# `tiny` keeps the real vocabulary on a 2-layer d=128 body (head_dim 64: vLLM's CPU attention
# has no kernel for head_dim 16), for the CPU smoke run.
QWEN3_COMMON = {"vocab_size": 151936, "head_dim": 128, "num_attention_heads": 16, "num_key_value_heads": 8,
                "num_hidden_layers": 28, "max_position_embeddings": 40960, "rope_theta": 1_000_000.0,
                "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
SHAPES: dict[str, dict[str, Any]] = {
    "0.6b": {**QWEN3_COMMON, "hidden_size": 1024, "intermediate_size": 3072},
    "1.7b": {**QWEN3_COMMON, "hidden_size": 2048, "intermediate_size": 6144},
    "tiny": {**QWEN3_COMMON, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 4096},
}
# GRPO-like batch per shape: prompts x n samples, prompt tokens, new tokens per sample.
BATCHES: dict[str, dict[str, int]] = {
    "0.6b": {"prompts": 16, "n": 8, "prompt_len": 512, "new_tokens": 256},
    "1.7b": {"prompts": 16, "n": 8, "prompt_len": 512, "new_tokens": 256},
    "tiny": {"prompts": 4, "n": 4, "prompt_len": 64, "new_tokens": 32},
}
ENGINES = ("torch", "vllm")


# -- model FLOPs ------------------------------------------------------------------------------


def param_counts(shape: dict[str, Any]) -> dict[str, int]:
    """Parameters of a Qwen3 of this shape: `matmul` (the blocks' linear weights), `embedding`
    (V x H; also the LM head when tied) and `total` (what the HF model holds)."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    matmul = layers * (h * q + 2 * h * kv + q * h + 3 * h * inter)
    norms = layers * (2 * h + 2 * shape["head_dim"]) + h  # input/post-attention, q/k norms; final
    embedding = shape["vocab_size"] * h
    lm_head = 0 if shape["tie_word_embeddings"] else embedding
    return {"matmul": matmul, "embedding": embedding, "total": matmul + norms + embedding + lm_head}


def train_flops(shape: dict[str, Any], prompt_len: int, sample_lens: list[list[int]]) -> dict[str, float]:
    """Model FLOPs of one forward + backward over groups of samples (`sample_lens[g][s]` tokens)
    sharing a `prompt_len`-token prompt per group; see the module docstring for the formula."""
    counts = param_counts(shape)
    q = shape["num_attention_heads"] * shape["head_dim"]
    p = prompt_len
    processed = sum(p + sum(g) for g in sample_lens)
    scored = sum(sum(g) for g in sample_lens)
    pairs = sum(p * (p + 1) // 2 + sum(r * p + r * (r + 1) // 2 for r in g) for g in sample_lens)
    dense = 6.0 * counts["matmul"] * processed
    head = 6.0 * shape["vocab_size"] * shape["hidden_size"] * scored
    attention = 12.0 * shape["num_hidden_layers"] * q * pairs
    return {"processed_tokens": processed, "scored_tokens": scored, "attention_pairs": pairs,
            "dense_flops": dense, "lm_head_flops": head, "attention_flops": attention,
            "total_flops": dense + head + attention}


# -- model directory --------------------------------------------------------------------------


def write_tokenizer(path: Path, vocab_size: int) -> Any:
    """floe's tiny character tokenizer (floe.models.tiny) padded with `<|tNNNNNN|>` tokens to the
    model's whole vocabulary, so every id a random model samples decodes (vLLM checks ids
    against the tokenizer). Returns the tokenizer (for its special ids)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from floe.models.tiny import CHARACTERS, CHAT_TEMPLATE, SPECIAL_TOKENS

    base = SPECIAL_TOKENS + CHARACTERS
    vocab = {tok: i for i, tok in enumerate(base + [f"<|t{i:06d}|>" for i in range(len(base), vocab_size)])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<|end|>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return tok


def model_dir(name: str, device: str, log: Any) -> Path:
    """A random-init Qwen3 of shape `name` as an HF directory (bf16 weights, the tokenizer above),
    built on `device` once and reused from the temp dir while its spec is unchanged."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from floe.atomic import atomic_directory

    shape = SHAPES[name]
    path = MODELS / f"qwen3_{name}_random"
    marker = path / "floe_bench_gpu.json"
    spec = json.dumps({"shape": shape, "seed": 0}, sort_keys=True)
    if marker.is_file() and marker.read_text() == spec:
        return path
    began = time.perf_counter()
    with atomic_directory(path, replace=True) as tmp:
        tok = write_tokenizer(tmp, shape["vocab_size"])
        config = Qwen3Config(**shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, attention_dropout=0.0, use_cache=False)
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(0)
            model = Qwen3ForCausalLM(config)
        held = sum(p.numel() for p in model.parameters())
        if held != param_counts(shape)["total"]:
            raise RuntimeError(f"param_counts() says {param_counts(shape)['total']}, the model holds {held}")
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        (tmp / marker.name).write_text(spec)
        del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    log(f"built {path} ({held / 1e9:.3f} B params) in {time.perf_counter() - began:.1f} s")
    return path


# -- one (shape, engine) arm, in a child process ----------------------------------------------


def grpo_batch(result: Any, rng: random.Random) -> Any:
    """The sampled groups as a PPO batch: sampler log-probs, group-normalised random rewards."""
    import floe

    groups = []
    for g in result.groups:
        rewards = [rng.random() for _ in g.samples]
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        samples = [floe.Sample(tokens=s.tokens, logprobs=s.logprobs, advantage=(r - mean) / (std + 1e-6))
                   for s, r in zip(g.samples, rewards, strict=True)]
        groups.append(floe.Group(g.prompt, samples))
    return floe.Batch(groups)


def run_arm(name: str, engine: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Start a backend for (shape `name`, `engine`) and time `warmup` + `reps` RL iterations."""
    import torch

    import floe

    def log(msg: str) -> None:
        print(f"[{name}/{engine}] {msg}", flush=True)

    cuda = opts["device"].startswith("cuda")
    if opts["threads"]:
        torch.set_num_threads(opts["threads"])

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def reset_peak() -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak_gib() -> float | None:
        return torch.cuda.max_memory_allocated() / 2**30 if cuda else None

    shape, batch = SHAPES[name], opts["batch"]
    path = model_dir(name, opts["device"], log)
    max_len = batch["prompt_len"] + batch["new_tokens"] + 16
    engine_config: dict[str, Any] = {"name": engine}
    if engine == "vllm":
        engine_config.update(max_model_len=max_len, enforce_eager=opts["vllm_eager"],
                             gpu_memory_utilization=opts["vllm_gpu_memory_utilization"],
                             kv_cache_memory_gib=opts["vllm_kv_cache_gib"],
                             max_num_seqs=max(256, batch["prompts"] * batch["n"]))
    else:
        engine_config["max_batch_sequences"] = max(256, batch["prompts"] * batch["n"])
    compute: dict[str, Any] = {"gradient_checkpointing": opts["gradient_checkpointing"]}
    if opts["microbatch_tokens"]:
        compute["max_tokens_per_microbatch"] = opts["microbatch_tokens"]
    config = floe.BackendConfig(
        model=str(path), dtype=opts["dtype"], device=opts["device"], seed=0, num_threads=opts["threads"],
        state_dir=tempfile.mkdtemp(prefix="floe-bench-gpu-state-"), optimizer=floe.OptimizerConfig(lr=1e-6),
        compute=floe.ComputeConfig(**compute), sampler=floe.SamplerConfig(engine=engine_config),
        reference=floe.ReferenceConfig(enabled=opts["reference"]),
    )
    reset_peak()
    began = time.perf_counter()
    client = floe.connect(config)
    sync()
    connect_s = time.perf_counter() - began
    info = client.info()
    start_s = info.capabilities.get("sampler_engine_start_seconds")
    out: dict[str, Any] = {
        "status": "ok", "engine": engine, "engine_config": engine_config, "connect_s": connect_s,
        "engine_start_s": start_s, "dtype": info.dtype, "device": info.device, "connect_peak_gib": peak_gib(),
        "resident_gib": torch.cuda.memory_allocated() / 2**30 if cuda else None,
        "gpu": torch.cuda.get_device_name() if cuda else None, "cuda": torch.version.cuda,
    }
    log(f"connected in {connect_s:.1f} s (engine start {start_s or 0:.1f} s), dtype {info.dtype} on {info.device}")

    rng = random.Random(0)
    prompts = [[rng.randrange(8, shape["vocab_size"]) for _ in range(batch["prompt_len"])]
               for _ in range(batch["prompts"])]
    iterations: list[dict[str, Any]] = []
    for it in range(opts["warmup"] + opts["reps"]):
        row: dict[str, Any] = {"warmup": it < opts["warmup"]}
        params = floe.SamplingParams(max_tokens=batch["new_tokens"], temperature=1.0, stop_at_eos=False, seed=it)
        reset_peak()
        t0 = time.perf_counter()
        res = client.sample(prompts, batch["n"], params)
        sync()
        row["sample_s"] = time.perf_counter() - t0
        row["sample_peak_gib"] = peak_gib()
        lens = [[len(s.tokens) for s in g.samples] for g in res.groups]
        row["generated_tokens"] = sum(map(sum, lens))
        ppo = grpo_batch(res, rng)

        reset_peak()
        t0 = time.perf_counter()
        fb = client.forward_backward(ppo, loss="ppo")
        sync()
        row["forward_backward_s"] = time.perf_counter() - t0
        step = client.optim_step()
        sync()
        row["train_s"] = time.perf_counter() - t0
        row["optim_step_s"] = row["train_s"] - row["forward_backward_s"]
        row["train_peak_gib"] = peak_gib()
        row["loss"], row["grad_norm"] = fb.metrics.get("loss"), step.grad_norm
        row.update(train_flops(shape, batch["prompt_len"], lens))

        reset_peak()
        t0 = time.perf_counter()
        synced = client.sync_weights()
        sync()
        row["sync_wall_s"] = time.perf_counter() - t0
        row["sync_s"], row["sync_bytes"] = synced.seconds, synced.bytes
        row["model_bytes"] = param_counts(shape)["total"] * (2 if opts["dtype"] == "bfloat16" else 4)
        row["sync_peak_gib"] = peak_gib()
        iterations.append(row)
        tag = "warm-up" if row["warmup"] else f"rep {it - opts['warmup'] + 1}/{opts['reps']}"
        log(f"{tag}: sample {row['sample_s']:.2f} s ({row['generated_tokens'] / row['sample_s']:.0f} tok/s), "
            f"train {row['train_s']:.2f} s (MFU {row['total_flops'] / row['train_s'] / opts['peak_flops']:.2%}), "
            f"sync {row['sync_s']:.3f} s ({synced.bytes / 2**20:.0f} MiB)")
    client.close()
    out["iterations"] = iterations
    out.update(summarise([r for r in iterations if not r["warmup"]], opts["peak_flops"]))
    return out


def summarise(rows: list[dict[str, Any]], peak_flops: float) -> dict[str, Any]:
    """Headline numbers from the timed iterations: the fastest repetition (as the other
    benchmarks report), medians alongside, peaks as the maximum over repetitions."""
    def best(key: str) -> float:
        return min(r[key] for r in rows)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    def peak(key: str) -> float | None:
        values = [r[key] for r in rows if r[key] is not None]
        return max(values) if values else None

    first = rows[0]
    return {
        "sample_s": best("sample_s"), "sample_median_s": med("sample_s"),
        "sample_tokens_per_s": first["generated_tokens"] / best("sample_s"),
        "train_s": best("train_s"), "train_median_s": med("train_s"),
        "forward_backward_s": best("forward_backward_s"), "optim_step_s": best("optim_step_s"),
        "train_tokens_per_s": first["scored_tokens"] / best("train_s"),
        "train_processed_tokens_per_s": first["processed_tokens"] / best("train_s"),
        "train_flops": first["total_flops"],
        "mfu": first["total_flops"] / (best("train_s") * peak_flops),
        "sync_s": best("sync_s"), "sync_median_s": med("sync_s"), "sync_bytes": first["sync_bytes"],
        "model_bytes": first["model_bytes"],
        "sync_gb_per_s": first["sync_bytes"] / best("sync_s") / 1e9,
        "sample_peak_gib": peak("sample_peak_gib"), "train_peak_gib": peak("train_peak_gib"),
        "sync_peak_gib": peak("sync_peak_gib"),
    }


def child_main(request: Path, record: Path) -> None:
    """The child process: run one arm as `request` (JSON) says; write its result to `record`."""
    from floe.atomic import atomic_write_text

    req = json.loads(request.read_text())
    try:
        out = run_arm(req["shape"], req["engine"], req["opts"])
    except Exception as e:  # the parent records which arm failed and why, and goes on
        out = {"status": "error", "engine": req["engine"], "error": f"{type(e).__name__}: {e}"}
        print(f"[{req['shape']}/{req['engine']}] FAILED: {out['error']}", flush=True)
        atomic_write_text(record, json.dumps(out, indent=2))
        raise
    atomic_write_text(record, json.dumps(out, indent=2))


# -- the parent: arms in child processes, results and plots -----------------------------------


def plot(name: str, payload: dict[str, Any]) -> Path:
    """Four panels, one bar per engine: sampling tok/s, training tok/s (MFU over the bar),
    peak GiB per phase, sync GB/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = {e: r for e, r in payload["arms"].items() if r.get("status") == "ok"}
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.4))
    labels = list(arms)
    panels = [("sampling (generated tok/s)", "sample_tokens_per_s"), ("training step (trained tok/s)", "train_tokens_per_s"),
              (None, None), ("sync_weights (GB/s)", "sync_gb_per_s")]
    for ax, (title, key) in zip(axes, panels, strict=True):
        if key is None:
            phases = ["sample_peak_gib", "train_peak_gib", "sync_peak_gib"]
            width = 0.8 / max(1, len(labels))
            for j, eng in enumerate(labels):
                values = [arms[eng][p] or 0.0 for p in phases]
                ax.bar([i - 0.4 + width * (j + 0.5) for i in range(3)], values, width, label=eng)
            ax.set_xticks(range(3), ["sample", "train", "sync"])
            ax.set_title("peak memory (GiB)", fontsize=9)
            if all(arms[e][p] is None for e in labels for p in phases):
                ax.text(1, 0.5, "not measured off CUDA", ha="center", va="center", transform=ax.transData)
                ax.set_ylim(0, 1)
            elif labels:
                ax.legend(fontsize=7)
            continue
        values = [arms[e][key] for e in labels]
        ax.bar(labels, values, color=["C0", "C1"][: len(labels)])
        for i, v in enumerate(values):
            note = f"{v:.0f}" if key != "sync_gb_per_s" else f"{v:.2f}"
            if key == "train_tokens_per_s":
                note += f"\nMFU {arms[labels[i]]['mfu']:.1%}"
            ax.text(i, v, note, ha="center", va="bottom", fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.margins(y=0.25)
    batch = payload["batch"]
    fig.suptitle(f"Qwen3-{name} shape, random init, {payload['opts']['dtype']} on {payload['device_name']}: "
                 f"{batch['prompts']} prompts x n={batch['n']}, P={batch['prompt_len']}, R={batch['new_tokens']}",
                 fontsize=10)
    fig.tight_layout()
    out = RESULTS / f"gpu_{name}.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable; default 0.6b and 1.7b")
    ap.add_argument("--engine", action="append", choices=ENGINES, help="repeatable; default torch and vllm")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke run)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="compute dtype; bfloat16 trains fp32 master weights (default)")
    ap.add_argument("--reps", type=int, default=3, help="timed iterations (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations first (default 1)")
    ap.add_argument("--prompts", type=int, help="prompts per batch (default: the shape's, 16; tiny 4)")
    ap.add_argument("--n", type=int, help="samples per prompt (default 8; tiny 4)")
    ap.add_argument("--prompt-len", type=int, help="prompt tokens (default 512; tiny 64)")
    ap.add_argument("--new-tokens", type=int, help="tokens generated per sample (default 256; tiny 32)")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="peak dense bf16 TFLOP/s of one GPU, the MFU denominator (default 989: H200/H100 SXM)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--reference", action="store_true", help="keep a reference zone (default off: ppo needs none)")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--microbatch-tokens", type=int, default=None,
                    help="compute.max_tokens_per_microbatch (default: floe's, 8192)")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM enforce_eager (no CUDA graphs / compile)")
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.5,
                    help="vLLM's share of the GPU it may claim at start (default 0.5: the policy trains alongside)")
    ap.add_argument("--vllm-kv-cache-gib", type=float, default=16.0, help="vLLM KV cache size (default 16 GiB)")
    ap.add_argument("--arm-timeout", type=float, default=1200.0, help="seconds one (shape, engine) may take")
    ap.add_argument("--child", nargs=2, metavar=("REQUEST", "RECORD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    for field in ("reps", "prompts", "n", "prompt_len", "new_tokens", "threads", "microbatch_tokens"):
        value = getattr(args, field)
        if value is not None and value < 1:
            ap.error(f"--{field.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup < 0 or args.peak_tflops <= 0 or args.arm_timeout <= 0:
        ap.error("--warmup must be >= 0, --peak-tflops and --arm-timeout > 0")
    return args


def main() -> None:
    args = arguments()
    if args.child:
        child_main(Path(args.child[0]), Path(args.child[1]))
        return
    shapes = list(dict.fromkeys(args.shape or ["0.6b", "1.7b"]))
    engines = list(dict.fromkeys(args.engine or list(ENGINES)))
    work = Path(tempfile.mkdtemp(prefix="floe-bench-gpu-"))
    for name in shapes:
        batch = {k: getattr(args, k) or v for k, v in BATCHES[name].items()}
        opts = {"device": args.device, "dtype": args.dtype, "reps": args.reps, "warmup": args.warmup,
                "threads": args.threads, "reference": args.reference, "batch": batch,
                "gradient_checkpointing": args.gradient_checkpointing, "microbatch_tokens": args.microbatch_tokens,
                "vllm_eager": args.vllm_eager, "vllm_gpu_memory_utilization": args.vllm_gpu_memory_utilization,
                "vllm_kv_cache_gib": args.vllm_kv_cache_gib, "peak_flops": args.peak_tflops * 1e12}
        payload: dict[str, Any] = {"shape": name, "qwen3_config": SHAPES[name], "params": param_counts(SHAPES[name]),
                                   "batch": batch, "opts": opts, "device_name": args.device, "arms": {}}
        for engine in engines:
            print(f"[{name}/{engine}] starting ({batch['prompts']} prompts x n={batch['n']}, "
                  f"P={batch['prompt_len']}, R={batch['new_tokens']}, {args.dtype} on {args.device})", flush=True)
            if engine == "vllm" and importlib.util.find_spec("vllm") is None:
                payload["arms"][engine] = {"status": "not run", "engine": engine,
                                           "error": "vllm is not importable in this environment"}
                print(f"[{name}/{engine}] not run: vllm is not importable here", flush=True)
                continue
            request, record = work / f"{name}_{engine}.request.json", work / f"{name}_{engine}.json"
            request.write_text(json.dumps({"shape": name, "engine": engine, "opts": opts}))
            try:
                rc = subprocess.run([sys.executable, __file__, "--child", str(request), str(record)],
                                    timeout=args.arm_timeout, check=False).returncode
            except subprocess.TimeoutExpired:
                rc = None
            if record.is_file():
                result = json.loads(record.read_text())
            else:
                result = {"status": "error", "engine": engine,
                          "error": "timed out" if rc is None else f"child exited with {rc} and wrote no result"}
            payload["arms"][engine] = result
            if result.get("gpu"):
                payload["device_name"] = result["gpu"]
            if result["status"] == "ok":
                print(f"[{name}/{engine}] sample {result['sample_tokens_per_s']:.0f} tok/s | train "
                      f"{result['train_s']:.2f} s, {result['train_tokens_per_s']:.0f} tok/s, MFU {result['mfu']:.2%} | "
                      f"peak GiB sample/train/sync {fmt_gib(result['sample_peak_gib'])}/"
                      f"{fmt_gib(result['train_peak_gib'])}/{fmt_gib(result['sync_peak_gib'])} | sync "
                      f"{result['sync_s']:.3f} s, {result['sync_bytes'] / 1e9:.3f} GB (parameters {result['model_bytes'] / 1e9:.3f} GB), "
                      f"{result['sync_gb_per_s']:.2f} GB/s",
                      flush=True)
            write_json(f"gpu_{name}", payload)  # after every arm: a later failure keeps these
        path = write_json(f"gpu_{name}", payload)
        print(f"wrote {path} and {plot(name, payload)}", flush=True)


def fmt_gib(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.1f}"


if __name__ == "__main__":
    main()
