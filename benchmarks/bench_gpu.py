"""One-GPU benchmark of the RL loop on real Qwen3 shapes (random init): start, sample, train, sync.

For every `--shape` (the real Qwen3-0.6B / Qwen3-1.7B dimensions, or `tiny` for a CPU smoke
run), every `--placement` and every `--engine` (torch; vllm where it is importable), one
backend is started through the public API (`floe.connect(BackendConfig(...))`) and runs
`--warmup` untimed and `--reps` timed iterations of a GRPO-like step:

    sample(prompts, n)  ->  forward_backward(batch, "ppo") + optim_step()  ->  sync_weights()

Placements (both on the same one device):

* `local`: policy and sampler resident together in the benchmark's process (`placement.kind =
  "local"`): no switching, the sampler holds its weights while the policy trains.
* `colocated`: the Ray placement with `colocate = true`: 1 policy rank and 1 sampler replica as
  two Ray actors in one bundle, sharing the GPU with `gpus = 0.5` each (`cpus = 1` each), the
  reference (with `--reference`) in the policy rank's actor, the broadcast sync (over gloo: NCCL
  cannot hold two ranks on one GPU, floe.placement.ray.actors). The Backend switches modes before
  each operation (docs/scale.md): training puts the sampler to sleep (weights to host memory,
  cache freed) and onloads the policy; sampling offloads the policy's parameters, gradients
  and optimizer state to host memory and wakes the sampler; a sync needs both. The Ray cluster
  is started inside the arm's process (`address = "local"`). Unless `--threads` is given, each
  actor gets half the machine's cores (`backend_threads`). The vLLM engine gets
  `enable_sleep_mode = true` here (vLLM's sleep mode needs CUDA: on CPU that arm is "not run";
  on GPU it fails at start until the Ray placement can host vLLM: docs/benchmarks.md, GPU).

Reported per (shape, placement, engine), in benchmarks/results/gpu_<shape>.json and .png:

* **engine start** (s): `info().capabilities["sampler_engine_start_seconds"]` (vLLM: engine
  core, KV cache, CUDA graphs / compile, first weight push), and the whole `connect` (s).
* **sampling**: generated tokens / s (exactly `new_tokens` per sample, no stopping).
* **training step**: seconds of forward_backward(ppo) + optim_step; trained (sample) tokens / s;
  MFU = model FLOPs / (seconds x `--peak-tflops`), model FLOPs = 6 N_mm T_proc + 6 V H T_scored
  + 12 L (heads x head_dim) S_attn, where N_mm are the transformer blocks' matmul weights,
  T_proc the tokens that must go through them (each group's prompt once, plus every sample),
  T_scored the sample tokens (the LM head runs only where a log-prob is needed), and S_attn the
  causal query-key pairs (a sample attends to its prompt and its own earlier tokens).
* **sync_weights**: seconds, bytes and GB/s (`SyncResult`, measured inside the Backend once the
  sync's mode holds), and the client's wall time around the call (`sync_wall_s`).
* **mode switches**, measured from the outside by probes: before the phase's main call each
  phase runs a tiny probe twice (sample: 1 prompt of 8 tokens, n=1, 1 new token; train: a no-grad
  `forward` of one 8 + 4-token sample); the first probe pays the switch into the phase's mode,
  the second does not, so `switch_to_sample_s` (policy offload) and `switch_to_train_s`
  (sampler sleep + policy onload) are first - second. `switch_to_sync_s` (sampler wake) is
  `sync_wall_s - sync_s` (the call's own round trip included: the `local` arm shows that
  baseline). The local arm runs the same probes (its "switches" are the noise floor). The main
  calls therefore run in a mode already held.
* **step time** (s): `step_s` = switch_to_sample + sample + switch_to_train + train + sync wall:
  one GRPO step as a loop on this placement pays it (the probes' own work excluded).
* **memory**, per phase (sample = its probes + the sample call; train = its probes +
  forward_backward + optim_step; sync):
  - `*_peak_gib`: `torch.cuda.max_memory_allocated` of THIS process (the benchmark's driver),
    reset before each phase. In `local` that is the backend's memory; in `colocated` the zones
    live in the Ray actors' processes, so it is only the driver's own (about 0).
  - `*_device_peak_gib`: the device's used memory, all processes (`torch.cuda.mem_get_info`:
    total - free, polled every 10 ms by a thread of the driver during the phase), so CUDA
    contexts (several hundred MiB each: the driver's, every actor's), caching-allocator reserves
    and vLLM's pools are included; `*_device_used_gib` the same read once after the phase.
  - `zones_memory_after_*`: `info().capabilities["zones_memory"]` after each phase: where each
    zone's memory is (colocated: the policy rank's device or "cpu (offloaded)", the sampler
    replica's `memory()`: weights_on, device_bytes, asleep).
  On CPU none of the memory numbers is measured.

Each (shape, placement, engine) runs in its own child process (JSON in and out, no pickle),
so GPU memory, Ray and vLLM's process-wide state start clean and one failure (e.g. out of
memory) does not lose the other results. On CUDA the children see one GPU (the first of
CUDA_VISIBLE_DEVICES, or GPU 0), so Ray's bundle and the driver's memory reads are on the same
device. Models are built once into the temp dir with a tokenizer that covers the whole
151936-token vocabulary (nothing is downloaded).

On the lent H200 (an environment with a CUDA build of torch and `ray[default]==2.60.0`, the
`ray` extra; vLLM is optional, its arms are recorded as "not run" without it), from the
repository root:

    python benchmarks/bench_gpu.py --shape 0.6b --shape 1.7b --placement local --placement colocated \\
        --engine torch --engine vllm

A run split into several commands (e.g. one per shape or engine, to fit a time limit) ends in
one results file per shape with `--merge`.

CPU smoke runs (< 2 minutes each on 2 cores): the core venv (no Ray: local only), and the Ray
environment scripts/ci/ray.sh builds (`FLOE_CI_BUILD_ONLY=1 bash scripts/ci/ray.sh`):

    python benchmarks/bench_gpu.py --shape tiny --device cpu --engine torch --threads 1
    ~/.cache/floe-ci/ray-<hash>/bin/python benchmarks/bench_gpu.py --shape tiny --device cpu --engine torch \\
        --placement local --placement colocated --threads 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
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
PLACEMENTS = ("local", "colocated")
COLOCATED_GPUS = 0.5  # of the one GPU, for the policy rank and for the sampler replica each


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


# -- one (shape, placement, engine) arm, in a child process -----------------------------------


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


def placement_config(placement: str, device: str, timeout_s: float) -> dict[str, Any]:
    """`BackendConfig.placement` of a `--placement` arm (see the module docstring); the Ray
    placement's start and call bounds are the arm's own timeout."""
    if placement == "local":
        return {"kind": "local"}
    gpus = COLOCATED_GPUS if device.startswith("cuda") else 0.0
    return {"kind": "ray", "address": "local", "colocate": True, "sync": "broadcast",
            "policy": {"workers": 1, "gpus": gpus, "cpus": 1}, "sampler": {"workers": 1, "gpus": gpus, "cpus": 1},
            "reference": {"colocate_with_policy": True}, "start_timeout_s": timeout_s, "call_timeout_s": timeout_s}


def backend_threads(placement: str, threads: int | None) -> int | None:
    """`BackendConfig.num_threads` of an arm: `--threads` when given; otherwise torch's default
    for `local` (one process), and half the machine's cores for `colocated`, whose two actors
    would each keep to 1 thread otherwise (floe.placement.ray.actors), which would make their
    host-side work (offload copies, the sync's fingerprints over gloo) single-threaded."""
    if threads or placement == "local":
        return threads
    return max(1, (os.cpu_count() or 2) // 2)


class DeviceMemory:
    """The device's used memory, all processes: `torch.cuda.mem_get_info()` (total - free) of
    this process's current CUDA device. `start()` begins polling every `interval_s` in a thread;
    `stop()` ends it and returns the largest value seen (GiB), the reading at stop included.
    Off CUDA every reading is None. The first reading creates this process's CUDA context."""

    def __init__(self, cuda: bool, interval_s: float = 0.01):
        self.cuda = cuda
        self.interval_s = interval_s
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def used_gib(self) -> float | None:
        if not self.cuda:
            return None
        import torch

        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, self.used_gib() or 0.0)

    def start(self) -> None:
        if not self.cuda:
            return
        self._peak = self.used_gib() or 0.0
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, name="bench-gpu-memory", daemon=True)
        self._thread.start()

    def stop(self) -> float | None:
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        self._thread = None
        return max(self._peak, self.used_gib() or 0.0)


def run_arm(name: str, placement: str, engine: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Start a backend for (shape `name`, `placement`, `engine`) and time `warmup` + `reps` RL
    iterations (module docstring: what each number measures)."""
    import torch

    import floe

    def log(msg: str) -> None:
        print(f"[{name}/{placement}/{engine}] {msg}", flush=True)

    cuda = opts["device"].startswith("cuda")
    threads = backend_threads(placement, opts["threads"])
    if threads:
        torch.set_num_threads(threads)
    device_memory = DeviceMemory(cuda)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def begin_phase() -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        device_memory.start()

    def end_phase(row: dict[str, Any], phase: str) -> None:
        sync()
        row[f"{phase}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        row[f"{phase}_device_peak_gib"] = device_memory.stop()
        row[f"{phase}_device_used_gib"] = device_memory.used_gib()

    shape, batch = SHAPES[name], opts["batch"]
    path = model_dir(name, opts["device"], log)
    max_len = batch["prompt_len"] + batch["new_tokens"] + 16
    engine_config: dict[str, Any] = {"name": engine}
    if engine == "vllm":
        engine_config.update(max_model_len=max_len, enforce_eager=opts["vllm_eager"],
                             gpu_memory_utilization=opts["vllm_gpu_memory_utilization"],
                             kv_cache_memory_gib=opts["vllm_kv_cache_gib"],
                             max_num_seqs=max(256, batch["prompts"] * batch["n"]))
        if placement == "colocated":
            engine_config["enable_sleep_mode"] = True  # the sampler sleeps while the policy trains
    else:
        engine_config["max_batch_sequences"] = max(256, batch["prompts"] * batch["n"])
    compute: dict[str, Any] = {"gradient_checkpointing": opts["gradient_checkpointing"]}
    if opts["microbatch_tokens"]:
        compute["max_tokens_per_microbatch"] = opts["microbatch_tokens"]
    placement_values = placement_config(placement, opts["device"], opts["arm_timeout"])
    config = floe.BackendConfig(
        model=str(path), dtype=opts["dtype"], device=opts["device"], seed=0, num_threads=threads,
        state_dir=tempfile.mkdtemp(prefix="floe-bench-gpu-state-"), optimizer=floe.OptimizerConfig(lr=1e-6),
        compute=floe.ComputeConfig(**compute), sampler=floe.SamplerConfig(engine=engine_config),
        reference=floe.ReferenceConfig(enabled=opts["reference"]), placement=placement_values,
    )
    before_gib = device_memory.used_gib()  # the driver's CUDA context exists from here on (CUDA only)
    row0: dict[str, Any] = {}
    begin_phase()
    began = time.perf_counter()
    client = floe.connect(config)
    sync()
    connect_s = time.perf_counter() - began
    end_phase(row0, "connect")
    info = client.info()
    start_s = info.capabilities.get("sampler_engine_start_seconds")
    out: dict[str, Any] = {
        "status": "ok", "placement": placement, "engine": engine, "placement_config": placement_values,
        "num_threads": threads,
        "engine_config": engine_config, "connect_s": connect_s, "engine_start_s": start_s, "dtype": info.dtype,
        "device": info.device, "connect_peak_gib": row0["connect_peak_gib"],
        "connect_device_peak_gib": row0["connect_device_peak_gib"], "device_used_before_connect_gib": before_gib,
        "device_used_after_connect_gib": row0["connect_device_used_gib"],
        "resident_gib": torch.cuda.memory_allocated() / 2**30 if cuda else None,
        "zones_memory_after_connect": info.capabilities.get("zones_memory"),
        "placement_info": info.capabilities.get("placement"),
        "gpu": torch.cuda.get_device_name() if cuda else None, "cuda": torch.version.cuda,
    }
    log(f"connected in {connect_s:.1f} s (engine start {start_s or 0:.1f} s), dtype {info.dtype} on {info.device}")

    rng = random.Random(0)
    prompts = [[rng.randrange(8, shape["vocab_size"]) for _ in range(batch["prompt_len"])]
               for _ in range(batch["prompts"])]
    probe_prompt = [rng.randrange(8, shape["vocab_size"]) for _ in range(8)]
    probe_batch = floe.Batch([floe.Group(probe_prompt, [floe.Sample(tokens=[rng.randrange(8, shape["vocab_size"])
                                                                            for _ in range(4)])])])

    def timed(call: Any) -> tuple[Any, float]:
        t0 = time.perf_counter()
        result = call()
        sync()
        return result, time.perf_counter() - t0

    iterations: list[dict[str, Any]] = []
    for it in range(opts["warmup"] + opts["reps"]):
        row: dict[str, Any] = {"warmup": it < opts["warmup"]}
        params = floe.SamplingParams(max_tokens=batch["new_tokens"], temperature=1.0, stop_at_eos=False, seed=it)
        probe_params = floe.SamplingParams(max_tokens=1, temperature=1.0, stop_at_eos=False, seed=it)

        begin_phase()  # sample: two probes (the first pays the switch into "sample"), then the call
        _, first = timed(lambda: client.sample([probe_prompt], 1, probe_params))  # noqa: B023
        _, second = timed(lambda: client.sample([probe_prompt], 1, probe_params))  # noqa: B023
        row["switch_to_sample_s"], row["sample_probe_s"] = first - second, second
        res, row["sample_s"] = timed(lambda: client.sample(prompts, batch["n"], params))  # noqa: B023
        end_phase(row, "sample")
        row["zones_memory_after_sample"] = client.info().capabilities.get("zones_memory")
        lens = [[len(s.tokens) for s in g.samples] for g in res.groups]
        row["generated_tokens"] = sum(map(sum, lens))
        ppo = grpo_batch(res, rng)

        begin_phase()  # train: two probes (the first pays the switch into "train"), then the step
        _, first = timed(lambda: client.forward(probe_batch, temperature=1.0))
        _, second = timed(lambda: client.forward(probe_batch, temperature=1.0))
        row["switch_to_train_s"], row["train_probe_s"] = first - second, second
        fb, row["forward_backward_s"] = timed(lambda: client.forward_backward(ppo, loss="ppo"))  # noqa: B023
        step, row["optim_step_s"] = timed(client.optim_step)
        row["train_s"] = row["forward_backward_s"] + row["optim_step_s"]
        end_phase(row, "train")
        row["zones_memory_after_train"] = client.info().capabilities.get("zones_memory")
        row["loss"], row["grad_norm"] = fb.metrics.get("loss"), step.grad_norm
        row.update(train_flops(shape, batch["prompt_len"], lens))

        begin_phase()  # sync: its wall time includes the switch into "sync" (the sampler wakes)
        synced, row["sync_wall_s"] = timed(client.sync_weights)
        end_phase(row, "sync")
        row["zones_memory_after_sync"] = client.info().capabilities.get("zones_memory")
        row["sync_s"], row["sync_bytes"] = synced.seconds, synced.bytes
        row["switch_to_sync_s"] = row["sync_wall_s"] - synced.seconds
        row["model_bytes"] = param_counts(shape)["total"] * (2 if opts["dtype"] == "bfloat16" else 4)
        row["step_s"] = (row["switch_to_sample_s"] + row["sample_s"] + row["switch_to_train_s"] + row["train_s"]
                         + row["sync_wall_s"])
        iterations.append(row)
        tag = "warm-up" if row["warmup"] else f"rep {it - opts['warmup'] + 1}/{opts['reps']}"
        log(f"{tag}: step {row['step_s']:.2f} s | sample {row['sample_s']:.2f} s "
            f"({row['generated_tokens'] / row['sample_s']:.0f} tok/s), train {row['train_s']:.2f} s "
            f"(MFU {row['total_flops'] / row['train_s'] / opts['peak_flops']:.2%}), sync {row['sync_s']:.3f} s "
            f"({synced.bytes / 2**20:.0f} MiB) | switches to sample/train/sync {row['switch_to_sample_s']:.3f}/"
            f"{row['switch_to_train_s']:.3f}/{row['switch_to_sync_s']:.3f} s")
    client.close()
    out["iterations"] = iterations
    out.update(summarise([r for r in iterations if not r["warmup"]], opts["peak_flops"]))
    return out


def summarise(rows: list[dict[str, Any]], peak_flops: float) -> dict[str, Any]:
    """Headline numbers from the timed iterations: the fastest repetition (as the other
    benchmarks report), medians alongside; switches (differences of two timings) as medians;
    peaks as the maximum over repetitions; zones_memory as the last repetition saw it."""
    def best(key: str) -> float:
        return min(r[key] for r in rows)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    def peak(key: str) -> float | None:
        values = [r[key] for r in rows if r[key] is not None]
        return max(values) if values else None

    first, last = rows[0], rows[-1]
    out = {
        "step_s": best("step_s"), "step_median_s": med("step_s"),
        "sample_s": best("sample_s"), "sample_median_s": med("sample_s"),
        "sample_tokens_per_s": first["generated_tokens"] / best("sample_s"),
        "train_s": best("train_s"), "train_median_s": med("train_s"),
        "forward_backward_s": best("forward_backward_s"), "optim_step_s": best("optim_step_s"),
        "train_tokens_per_s": first["scored_tokens"] / best("train_s"),
        "train_processed_tokens_per_s": first["processed_tokens"] / best("train_s"),
        "train_flops": first["total_flops"],
        "mfu": first["total_flops"] / (best("train_s") * peak_flops),
        "sync_s": best("sync_s"), "sync_median_s": med("sync_s"), "sync_wall_s": best("sync_wall_s"),
        "sync_bytes": first["sync_bytes"], "model_bytes": first["model_bytes"],
        "sync_gb_per_s": first["sync_bytes"] / best("sync_s") / 1e9,
        "switch_to_sample_s": med("switch_to_sample_s"), "switch_to_train_s": med("switch_to_train_s"),
        "switch_to_sync_s": med("switch_to_sync_s"),
        "sample_probe_s": med("sample_probe_s"), "train_probe_s": med("train_probe_s"),
    }
    for phase in ("sample", "train", "sync"):
        for kind in ("peak", "device_peak", "device_used"):
            out[f"{phase}_{kind}_gib"] = peak(f"{phase}_{kind}_gib")
        out[f"zones_memory_after_{phase}"] = last[f"zones_memory_after_{phase}"]
    return out


def child_main(request: Path, record: Path) -> None:
    """The child process: run one arm as `request` (JSON) says; write its result to `record`."""
    from floe.atomic import atomic_write_text

    req = json.loads(request.read_text())
    try:
        out = run_arm(req["shape"], req["placement"], req["engine"], req["opts"])
    except Exception as e:  # the parent records which arm failed and why, and goes on
        out = {"status": "error", "placement": req["placement"], "engine": req["engine"],
               "error": f"{type(e).__name__}: {e}"}
        print(f"[{req['shape']}/{req['placement']}/{req['engine']}] FAILED: {out['error']}", flush=True)
        atomic_write_text(record, json.dumps(out, indent=2))
        raise
    atomic_write_text(record, json.dumps(out, indent=2))


# -- the parent: arms in child processes, results and plots -----------------------------------


def plot(name: str, payload: dict[str, Any]) -> Path:
    """Five panels, one bar per arm (placement/engine): step time split into its parts,
    sampling tok/s, training tok/s (MFU over the bar), device memory peak per phase (the
    driver's allocator peak where the device's is not measured), sync GB/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = {e: r for e, r in payload["arms"].items() if r.get("status") == "ok"}
    fig, axes = plt.subplots(1, 5, figsize=(17, 3.8))
    labels = list(arms)
    colors = [f"C{i}" for i in range(len(labels))]
    ax = axes[0]
    parts = [("switch_to_sample_s", "switch to sample"), ("sample_s", "sample"), ("switch_to_train_s", "switch to train"),
             ("train_s", "train"), ("sync_wall_s", "sync (wall)")]
    fastest = [min((r for r in arms[e]["iterations"] if not r["warmup"]), key=lambda r: r["step_s"]) for e in labels]
    bottom = [0.0] * len(labels)
    for j, (key, label) in enumerate(parts):
        values = [max(r[key], 0.0) for r in fastest]  # a negative switch (noise) is drawn as 0
        ax.bar(range(len(labels)), values, bottom=bottom, label=label, color=f"C{j}")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, r in enumerate(fastest):
        ax.text(i, bottom[i], f"{r['step_s']:.2f} s", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_title("step time (s), fastest repetition", fontsize=9)
    ax.margins(y=0.5)
    if labels:
        ax.legend(fontsize=6, ncol=2, loc="upper center")
    panels = [("sampling (generated tok/s)", "sample_tokens_per_s"), ("training step (trained tok/s)", "train_tokens_per_s"),
              (None, None), ("sync_weights (GB/s)", "sync_gb_per_s")]
    for ax, (title, key) in zip(axes[1:], panels, strict=True):
        if key is None:
            device = any(arms[e].get("sample_device_peak_gib") is not None for e in labels)
            kind = "device_peak" if device else "peak"
            phases = [f"{p}_{kind}_gib" for p in ("sample", "train", "sync")]
            width = 0.8 / max(1, len(labels))
            for j, arm in enumerate(labels):
                values = [arms[arm].get(p) or 0.0 for p in phases]
                ax.bar([i - 0.4 + width * (j + 0.5) for i in range(3)], values, width, label=arm, color=colors[j])
            ax.set_xticks(range(3), ["sample", "train", "sync"])
            ax.set_title("device memory used, peak (GiB)" if device else "peak memory (GiB)", fontsize=9)
            if all(arms[e].get(p) is None for e in labels for p in phases):
                ax.text(1, 0.5, "not measured off CUDA", ha="center", va="center", transform=ax.transData)
                ax.set_ylim(0, 1)
            elif labels:
                ax.legend(fontsize=7)
            continue
        values = [arms[e][key] for e in labels]
        ax.bar(range(len(labels)), values, color=colors)
        for i, v in enumerate(values):
            note = f"{v:.0f}" if key != "sync_gb_per_s" else f"{v:.2f}"
            if key == "train_tokens_per_s":
                note += f"\nMFU {arms[labels[i]]['mfu']:.1%}"
            ax.text(i, v, note, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
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
    ap.add_argument("--placement", action="append", choices=PLACEMENTS,
                    help="repeatable; default local and colocated (module docstring)")
    ap.add_argument("--engine", action="append", choices=ENGINES, help="repeatable; default torch and vllm")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda (default: one GPU) or cpu (smoke run)")
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
                    help="vLLM's share of the GPU it may claim at start (default 0.5: the policy shares the GPU)")
    ap.add_argument("--vllm-kv-cache-gib", type=float, default=16.0, help="vLLM KV cache size (default 16 GiB)")
    ap.add_argument("--arm-timeout", type=float, default=1200.0, help="seconds one (shape, placement, engine) may take")
    ap.add_argument("--merge", action="store_true",
                    help="keep the arms of an existing results file of the same shape and settings that this run does "
                         "not run (so a run split into several commands, e.g. one per engine, ends in one file)")
    ap.add_argument("--child", nargs=2, metavar=("REQUEST", "RECORD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    for field in ("reps", "prompts", "n", "prompt_len", "new_tokens", "threads", "microbatch_tokens"):
        value = getattr(args, field)
        if value is not None and value < 1:
            ap.error(f"--{field.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup < 0 or args.peak_tflops <= 0 or args.arm_timeout <= 0:
        ap.error("--warmup must be >= 0, --peak-tflops and --arm-timeout > 0")
    return args


def not_run_reason(placement: str, engine: str, device: str) -> str | None:
    """Why this arm cannot run in this environment (None: it can)."""
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        return "vllm is not importable in this environment"
    if placement == "colocated" and importlib.util.find_spec("ray") is None:
        return ("ray is not importable in this environment (the `ray` extra; scripts/ci/ray.sh builds an "
                "environment with it)")
    if placement == "colocated" and engine == "vllm" and device == "cpu":
        return "colocation puts vLLM to sleep, and vLLM's sleep mode needs CUDA"
    return None


def child_env(device: str) -> dict[str, str]:
    """The arms' environment: on CUDA one GPU (the first visible), so Ray's bundle and the
    driver's memory reads are on the same device; Ray's usage reporting off (no network)."""
    env = dict(os.environ)
    if device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = (env.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


def main() -> None:
    args = arguments()
    if args.child:
        child_main(Path(args.child[0]), Path(args.child[1]))
        return
    shapes = list(dict.fromkeys(args.shape or ["0.6b", "1.7b"]))
    placements = list(dict.fromkeys(args.placement or list(PLACEMENTS)))
    engines = list(dict.fromkeys(args.engine or list(ENGINES)))
    work = Path(tempfile.mkdtemp(prefix="floe-bench-gpu-"))
    for name in shapes:
        batch = {k: getattr(args, k) or v for k, v in BATCHES[name].items()}
        opts = {"device": args.device, "dtype": args.dtype, "reps": args.reps, "warmup": args.warmup,
                "threads": args.threads, "reference": args.reference, "batch": batch,
                "gradient_checkpointing": args.gradient_checkpointing, "microbatch_tokens": args.microbatch_tokens,
                "vllm_eager": args.vllm_eager, "vllm_gpu_memory_utilization": args.vllm_gpu_memory_utilization,
                "vllm_kv_cache_gib": args.vllm_kv_cache_gib, "peak_flops": args.peak_tflops * 1e12,
                "arm_timeout": args.arm_timeout}
        payload: dict[str, Any] = {"shape": name, "qwen3_config": SHAPES[name], "params": param_counts(SHAPES[name]),
                                   "batch": batch, "opts": opts, "device_name": args.device, "arms": {}}
        if args.merge:
            payload = merged(payload)
        for placement in placements:
            for engine in engines:
                arm = f"{placement}/{engine}"
                print(f"[{name}/{arm}] starting ({batch['prompts']} prompts x n={batch['n']}, P={batch['prompt_len']}, "
                      f"R={batch['new_tokens']}, {args.dtype} on {args.device})", flush=True)
                reason = not_run_reason(placement, engine, args.device)
                if reason is not None:
                    payload["arms"][arm] = {"status": "not run", "placement": placement, "engine": engine, "error": reason}
                    print(f"[{name}/{arm}] not run: {reason}", flush=True)
                    continue
                stem = f"{name}_{placement}_{engine}"
                request, record = work / f"{stem}.request.json", work / f"{stem}.json"
                request.write_text(json.dumps({"shape": name, "placement": placement, "engine": engine, "opts": opts}))
                try:
                    rc = subprocess.run([sys.executable, __file__, "--child", str(request), str(record)],
                                        timeout=args.arm_timeout, check=False, env=child_env(args.device)).returncode
                except subprocess.TimeoutExpired:
                    rc = None
                if record.is_file():
                    result = json.loads(record.read_text())
                else:
                    result = {"status": "error", "placement": placement, "engine": engine,
                              "error": "timed out" if rc is None else f"child exited with {rc} and wrote no result"}
                payload["arms"][arm] = result
                if result.get("gpu"):
                    payload["device_name"] = result["gpu"]
                if result["status"] == "ok":
                    print(summary_line(name, arm, result), flush=True)
                write_json(f"gpu_{name}", payload)  # after every arm: a later failure keeps these
        path = write_json(f"gpu_{name}", payload)
        print(f"wrote {path} and {plot(name, payload)}", flush=True)


def merged(payload: dict[str, Any]) -> dict[str, Any]:
    """`payload` with the arms of the existing results file of its shape (`--merge`); the arms
    this run runs replace theirs as they finish. SystemExit when that file was made with other
    settings (batch or options other than --arm-timeout), naming the keys that differ."""
    path = RESULTS / f"gpu_{payload['shape']}.json"
    if not path.is_file():
        return payload
    old = json.loads(path.read_text())
    differ = sorted(k for k in payload["opts"].keys() | old.get("opts", {}).keys()
                    if k != "arm_timeout" and payload["opts"].get(k) != old.get("opts", {}).get(k))
    if old.get("batch") != payload["batch"]:
        differ.append("batch")
    if differ:
        raise SystemExit(f"--merge: {path} was made with other settings ({', '.join(differ)}); run without --merge "
                         "to replace it, or with its settings")
    return {**payload, "arms": dict(old.get("arms", {})), "device_name": old.get("device_name", payload["device_name"])}


def summary_line(name: str, arm: str, r: dict[str, Any]) -> str:
    """One arm's headline numbers (fastest repetition; switches: medians)."""
    return (f"[{name}/{arm}] step {r['step_s']:.2f} s | sample {r['sample_tokens_per_s']:.0f} tok/s | train "
            f"{r['train_s']:.2f} s, {r['train_tokens_per_s']:.0f} tok/s, MFU {r['mfu']:.2%} | sync {r['sync_s']:.3f} s "
            f"(wall {r['sync_wall_s']:.3f} s), {r['sync_bytes'] / 1e9:.3f} GB (parameters {r['model_bytes'] / 1e9:.3f} GB), "
            f"{r['sync_gb_per_s']:.2f} GB/s | switches to sample/train/sync {r['switch_to_sample_s']:.3f}/"
            f"{r['switch_to_train_s']:.3f}/{r['switch_to_sync_s']:.3f} s | GiB peak sample/train/sync: this process "
            f"{fmt_gib(r['sample_peak_gib'])}/{fmt_gib(r['train_peak_gib'])}/{fmt_gib(r['sync_peak_gib'])}, device "
            f"{fmt_gib(r['sample_device_peak_gib'])}/{fmt_gib(r['train_device_peak_gib'])}/"
            f"{fmt_gib(r['sync_device_peak_gib'])}")


def fmt_gib(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.1f}"


if __name__ == "__main__":
    main()
