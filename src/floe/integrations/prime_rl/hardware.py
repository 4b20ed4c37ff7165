"""prime-rl's GPU split and inference settings -> the `[backend]` of the floe serve `floe prime-rl` starts (pure).

prime-rl's `rl` splits one node's GPUs between its trainer (`deployment.num_train_gpus`, FSDP
ranks) and its vLLM server (`deployment.num_infer_gpus`, `inference.vllm.*`). floe serve
does both jobs, so `prime_hardware` turns those keys into floe's placement and sampler engine
(floe.placement, docs/scale.md), and the orchestrator's side stays prime-rl's:

| prime-rl key | floe serve's `[backend]` |
|---|---|
| `deployment.num_train_gpus` = T, `num_infer_gpus` = I (defaults 1 and 1) | on a machine with >= T + I GPUs: Ray placement (started by floe serve), T policy ranks (FSDP2) of 1 GPU, I / tp sampler replicas of tp GPUs, not colocated (prime-rl keeps the two apart too); the reference in policy rank 0's actor. A recipe without `[deployment]` on a machine with one GPU: every zone on it (local); with none: the CPU |
| `inference.vllm.tensor_parallel_size` = tp, `data_parallel_size` | `sampler.engine.tensor_parallel_size` = tp; the replicas are I / tp (prime-rl's own rule); a `data_parallel_size` other than I / tp is refused |
| `inference.vllm.{gpu_memory_utilization, enforce_eager, max_model_len, enable_prefix_caching}` | the vLLM engine's keys of the same names (GPU runs: floe's vLLM engine, as prime-rl's `rl` serves with vLLM) |
| `inference.vllm.dtype` (`auto`, `bfloat16`, `float32`, `float16`) | `sampler.engine.dtype` (float16 samples; training stays bf16/fp32) |
| one GPU, no `[deployment]` | every zone on it; vLLM's `gpu_memory_utilization` 0.4 unless the recipe sets it |
| `inference.vllm.trust_remote_code` | `trust_remote_code` |
| `inference.vllm.tool_call_parser`, `reasoning_parser`, `chat_template` | accepted, listed at start: they shape vLLM's chat route; prime-rl's training client renders and parses on the token route (`/inference/v1/generate`), which they do not touch, and floe serve's chat route refuses `tools` |
| `trainer.model.ac` (activation checkpointing; on by default) | `compute.gradient_checkpointing` (floe recomputes every layer: `freq` / `mode` change memory and speed, not a number) |
| `trainer.model.optimization_dtype` | float32 only: floe keeps fp32 master weights; on GPUs compute is bf16 (`dtype = "bfloat16"`), as prime-rl's FSDP mixed precision |

Every other `[inference]` key configures prime-rl's own vLLM server process (router, ports,
logs, KV offload, its LoRA slots, quantization, expert parallelism, ...), which floe serve
replaces: refused by name, pointing at `[floe.backend]`. On the CPU there is no vLLM in
prime-rl's environment and nothing to split: floe's torch engine, float32, and the GPU-only
settings are listed as not applying to the CPU. The overlay's `[floe.backend]` is merged over
the result (`integrations.hardware.with_overrides`): that is how a CPU machine runs a recipe
whose `[deployment]` names GPUs (`[floe.backend] device = "cpu"`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from floe.errors import InvalidInput
from floe.integrations.hardware import floe_dtype

__all__ = ["PrimeHardware", "prime_hardware"]

# [inference.vllm] keys floe's vLLM engine takes under the same name (VllmEngineConfig)
ENGINE_KEYS = ("gpu_memory_utilization", "enforce_eager", "max_model_len", "enable_prefix_caching")
# [inference.vllm] keys of vLLM's chat route only (docstring)
CHAT_ROUTE_KEYS = ("tool_call_parser", "reasoning_parser", "chat_template")
PARALLEL_KEYS = ("tensor_parallel_size", "data_parallel_size")
SHARED_GPU_MEMORY = 0.4  # vLLM's share of a GPU the policy also trains on
REPLACED = ("configures prime-rl's own vLLM server process, which floe prime-rl replaces by floe serve; remove it "
            "(floe serve's settings go in the overlay's [floe.backend], docs/recipes.md)")


@dataclass(frozen=True)
class PrimeHardware:
    """`backend`: floe serve `[backend]` keys (device, dtype, compute, sampler, placement, ...),
    before the overlay's `[floe.backend]`; `gpus`: GPUs the mapping uses (0 = the CPU);
    `notes`: keys accepted without effect on this machine, each with why (printed at start)."""

    backend: dict[str, Any]
    gpus: int
    notes: list[str] = field(default_factory=list)


def _count(table: Mapping[str, Any], key: str, field_name: str, default: int, low: int) -> int:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidInput(field_name, f"must be an integer >= {low}, got {value!r}")
    return value


def _table(raw: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(key, "must be a table")
    return value


def _checkpointing(model: Mapping[str, Any]) -> bool:
    """trainer.model.ac: prime-rl checkpoints activations unless `ac` is explicitly empty (null)."""
    if "ac" not in model:
        return True
    ac = model["ac"]
    if ac is None or ac is False:
        return False
    if not isinstance(ac, dict):
        raise InvalidInput("trainer.model.ac", f"must be a table (prime-rl's ActivationCheckpointConfig), got {ac!r}")
    return True


def prime_hardware(raw: Mapping[str, Any], cuda_gpus: int, overlay: Mapping[str, Any]) -> PrimeHardware:
    """floe serve's `[backend]` keys for prime-rl's layered config `raw` (merged TOML, plain
    dicts) on a machine with `cuda_gpus` CUDA GPUs, per the module's table. `overlay` is the
    `[floe.backend]` table: when it sets `device` or `placement`, it decides where floe serve
    runs and the recipe's GPU split is not checked against this machine. Raises InvalidInput
    naming the prime-rl key that cannot be honoured."""
    deployment = _table(raw, "deployment")
    inference = _table(raw, "inference")
    vllm = _table(inference, "vllm") if inference else {}
    for key in inference:
        if key != "vllm":
            raise InvalidInput(f"inference.{key}", REPLACED)
    for key in vllm:
        if key not in (*ENGINE_KEYS, *CHAT_ROUTE_KEYS, *PARALLEL_KEYS, "dtype", "trust_remote_code"):
            raise InvalidInput(f"inference.vllm.{key}", REPLACED)
    model = _table(_table(raw, "trainer"), "model")
    if model.get("optimization_dtype", "float32") != "float32":
        raise InvalidInput("trainer.model.optimization_dtype", "floe keeps fp32 master weights (bf16 compute on GPUs "
                           "comes with them); set it to \"float32\"")

    train = _count(deployment, "num_train_gpus", "deployment.num_train_gpus", 1, 1)
    infer = _count(deployment, "num_infer_gpus", "deployment.num_infer_gpus", 1, 1)
    tp = _count(vllm, "tensor_parallel_size", "inference.vllm.tensor_parallel_size", 1, 1)
    if infer % tp:
        raise InvalidInput("inference.vllm.tensor_parallel_size", f"is {tp}; it must divide deployment.num_infer_gpus "
                           f"({infer}): each sampler replica spans tensor_parallel_size GPUs")
    replicas = infer // tp
    if _count(vllm, "data_parallel_size", "inference.vllm.data_parallel_size", replicas, 1) != replicas:
        raise InvalidInput("inference.vllm.data_parallel_size", f"is {vllm['data_parallel_size']}; with "
                           f"{infer} inference GPUs and tensor_parallel_size {tp} there are {replicas} replicas "
                           "(deployment.num_infer_gpus / tensor_parallel_size): set it to that or remove it")
    trust = vllm.get("trust_remote_code", False)
    if not isinstance(trust, bool):
        raise InvalidInput("inference.vllm.trust_remote_code", f"must be true or false, got {trust!r}")
    sampler_dtype = vllm.get("dtype", "auto")
    if sampler_dtype != "auto":
        sampler_dtype = floe_dtype(sampler_dtype, "inference.vllm.dtype", sampling=True)
    notes = [f"inference.vllm.{k} (vLLM's chat route; prime-rl trains on the token route)" for k in CHAT_ROUTE_KEYS
             if k in vllm]
    compute = {"gradient_checkpointing": _checkpointing(model)}
    base: dict[str, Any] = {"compute": compute, **({"trust_remote_code": True} if trust else {})}

    placed_by_overlay = "device" in overlay or "placement" in overlay
    if placed_by_overlay or (cuda_gpus == 0 and not deployment):
        # the CPU (or where the overlay puts floe serve): floe's defaults; vLLM's GPU settings wait for GPUs
        gpu_only = [f"inference.vllm.{k}" for k in (*ENGINE_KEYS, *PARALLEL_KEYS) if k in vllm]
        gpu_only += [f"deployment.{k}" for k in ("num_train_gpus", "num_infer_gpus", "gpus_per_node") if k in deployment]
        if sampler_dtype != "auto":
            gpu_only.append("inference.vllm.dtype")
        where = "[floe.backend] places floe serve" if placed_by_overlay else "this machine has no GPU"
        notes += [f"{k} ({where}; prime-rl's GPU split and vLLM settings apply on GPUs)" for k in gpu_only]
        return PrimeHardware(base, 0, notes)

    need = train + infer
    if cuda_gpus == 1 and not deployment:
        gpus, placement = 1, {"kind": "local"}  # prime-rl's default split needs 2; floe shares the one GPU
    elif cuda_gpus >= need:
        gpus = need
        placement = {
            "kind": "ray", "colocate": False,
            "policy": {"workers": train, "gpus": 1},
            "sampler": {"workers": replicas, "gpus": tp},
            "reference": {"colocate_with_policy": True},
        }
    else:
        field_name = "deployment.num_train_gpus" if deployment else "deployment"
        raise InvalidInput(field_name, f"prime-rl's split asks for {train} training + {infer} inference GPUs; this "
                           f"machine has {cuda_gpus} CUDA GPU(s). Set deployment.num_train_gpus / num_infer_gpus to fit, "
                           "or place floe serve yourself in the overlay ([floe.backend] device = \"cpu\" for the CPU)")
    engine: dict[str, Any] = {"name": "vllm", **{k: vllm[k] for k in ENGINE_KEYS if k in vllm}}
    if tp > 1:
        engine["tensor_parallel_size"] = tp
    if sampler_dtype != "auto":
        engine["dtype"] = sampler_dtype
    if placement["kind"] == "local" and "gpu_memory_utilization" not in vllm:
        # vLLM's default 0.9 assumes a GPU of its own; here the policy trains on the same one
        engine["gpu_memory_utilization"] = SHARED_GPU_MEMORY
        notes.append(f"one GPU for training and sampling: vLLM takes gpu_memory_utilization {SHARED_GPU_MEMORY} "
                     "(inference.vllm.gpu_memory_utilization sets it)")
    backend = {**base, "device": "cuda", "dtype": "bfloat16", "sampler": {"engine": engine}, "placement": placement}
    return PrimeHardware(backend, gpus, notes)
