"""SkyRL 0.4.0's placement, precision, memory and engine settings -> the embedded floe backend (pure; no SkyRL import).

`skyrl_hardware` reads ``asdict(cfg.trainer)`` and ``asdict(cfg.generator)`` and returns the
BackendConfig keys that make the embedded backend train and sample where and how the recipe
says: on its GPUs, in its dtype, with its engine. Keys floe cannot honour raise InvalidInput
naming the SkyRL key. SkyRL itself has no CPU mode (its placement counts GPUs), so a CPU run
says ``floe.backend.device=cpu``.

| SkyRL key | floe BackendConfig |
|---|---|
| trainer.placement.policy_num_gpus_per_node × policy_num_nodes = G | GPUs of the run: placement (floe.placement.gpus) |
| trainer.placement.colocate_all, trainer.policy/ref.fsdp_config.cpu_offload | training and generation take turns on the GPUs (colocated Ray placement; vLLM sleep mode) |
| trainer.bf16, trainer.policy.fsdp_config.mixed_precision.param_dtype | dtype (bfloat16: bf16 compute, fp32 masters) |
| trainer.gradient_checkpointing | compute.gradient_checkpointing |
| trainer.flash_attn | attn_implementation flash_attention_2 on GPUs (auto on the CPU) |
| trainer.max_tokens_per_microbatch (> 0) | compute.max_tokens_per_microbatch |
| trainer.logprobs_chunk_size | compute.logprob_chunk_tokens |
| generator.inference_engine.backend (vllm) | sampler.engine.name |
| generator.inference_engine.model_dtype | sampler.engine.dtype |
| generator.inference_engine.{gpu_memory_utilization, enforce_eager, max_num_seqs, enable_prefix_caching, max_num_batched_tokens, enable_chunked_prefill} | the vLLM engine's keys of the same names |
| trainer.policy.model.lora.{rank (> 0), alpha, dropout (0), target_modules, exclude_modules, init_method (kaiming, gaussian)} | lora.{rank, alpha, dropout, target_modules, exclude_modules, init} (`skyrl_lora`; on either placement) |
| trainer.policy.model.lora.{lora_sync_path, sync_mode, share_expert_adapters, max_loras, max_cpu_loras} | SkyRL's defaults only (floe syncs merged weights in memory) |
| generator.inference_engine.num_engines × tensor_parallel_size × data_parallel_size | must divide G: one single-GPU sampler replica per GPU |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from floe.errors import InvalidInput
from floe.integrations.hardware import floe_dtype, lora_table, vllm_engine
from floe.placement.gpus import GpuLayout, placement_for

_ENGINE = "generator.inference_engine"
# inference_engine keys that must keep SkyRL's default: what else they ask for floe does not do
_ENGINE_OFF: dict[str, tuple[Any, str]] = {
    "pipeline_parallel_size": (1, "floe's sampler replicas each hold the whole model on one GPU"),
    "expert_parallel_size": (1, "floe's sampler replicas each hold the whole model on one GPU"),
    "fp8_weight_sync_mode": (None, "floe syncs the policy's weights in the sampler's own dtype, verified"),
    "enable_return_routed_experts": (False, "floe's sampler returns tokens and log-probs"),
    "speculative_config": (None, "floe's sampler has no speculative decoding"),
    "enable_pd": (False, "floe's sampler runs prefill and decode in one engine"),
    "external_proxy_url": (None, "the sampler is floe's own; to share one, run `floe serve` and set floe.url"),
    "external_server_urls": (None, "the sampler is floe's own; to share one, run `floe serve` and set floe.url"),
    "run_engines_locally": (True, "floe's sampler runs inside floe's backend"),
}


@dataclass(frozen=True)
class SkyRLHardware:
    """`backend`: BackendConfig keys; `gpus`: GPUs the run needs (0 on the CPU); `engine`: floe's sampler engine."""

    backend: dict[str, Any]
    gpus: int
    engine: str


def _int(section: Mapping[str, Any], key: str, where: str, low: int) -> int:
    value = section.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidInput(f"{where}.{key}", f"must be an integer >= {low}, got {value!r}")
    return value


_LORA = "trainer.policy.model.lora"
# LoRA keys that must keep SkyRL's default: what else they ask for floe does not do
_LORA_OFF: dict[str, tuple[Any, str]] = {
    "lora_sync_path": ("/tmp/skyrl_lora_sync", "floe syncs the merged weights in memory, no adapter files"),
    "sync_mode": ("disk", "Megatron's adapter-only sync; floe syncs the merged weights in memory"),
    "share_expert_adapters": (True, "Megatron's grouped-expert adapters; floe trains peft on FSDP"),
    "max_loras": (1, "floe's sampler serves the one policy adapter, merged into its weights"),
    "max_cpu_loras": (None, "floe's sampler serves the one policy adapter, merged into its weights"),
}
_INIT = {"kaiming": "kaiming", "true": "kaiming", "gaussian": "gaussian"}


def skyrl_lora(lora: Mapping[str, Any]) -> dict[str, Any] | None:
    """floe's `[lora]` table from ``trainer.policy.model.lora`` (``asdict``; None for rank 0):
    rank, alpha, dropout (0 only), target_modules, exclude_modules, init_method (kaiming or
    gaussian, peft's init_lora_weights as SkyRL's FSDP worker passes it); the sync and serving
    keys keep their defaults (`_LORA_OFF`). InvalidInput naming the SkyRL key otherwise."""
    table = lora_table(lora.get("rank", 0), lora.get("alpha", 16), lora.get("target_modules", "all-linear"),
                       lora.get("exclude_modules"), {k: f"{_LORA}.{k}" for k in
                                                     ("rank", "alpha", "target_modules", "exclude_modules")})
    if table is None:
        return None
    if lora.get("dropout", 0.0) != 0:
        raise InvalidInput(f"{_LORA}.dropout", "floe runs without dropout (RL log-probs are deterministic functions of "
                                               "the weights); set it to 0")
    init = str(lora.get("init_method", "kaiming")).lower()
    if init not in _INIT:
        raise InvalidInput(f"{_LORA}.init_method", f"floe initialises A as peft's kaiming (default) or gaussian, got "
                                                   f"{lora.get('init_method')!r}")
    table["init"] = _INIT[init]
    for key, (default, why) in _LORA_OFF.items():
        if lora.get(key, default) != default:
            raise InvalidInput(f"{_LORA}.{key}", f"{why}; keep SkyRL's default {default!r}")
    return table


def skyrl_hardware(trainer: Mapping[str, Any], generator: Mapping[str, Any], device: str | None = None) -> SkyRLHardware:
    """The backend keys for SkyRL's ``trainer`` and ``generator`` sections (``asdict``), per the
    module's table. `device`: ``floe.backend.device`` if given (``cpu`` for a CPU run), else
    ``cuda``. Raises InvalidInput naming the SkyRL key for a setting floe cannot honour."""
    device = device or "cuda"
    if not isinstance(device, str) or device.split(":")[0] not in ("cuda", "cpu"):
        raise InvalidInput("floe.backend.device", f"floe's zones run on CUDA GPUs or the CPU, got {device!r}")
    on_gpu = device.startswith("cuda")
    placement_cfg = trainer.get("placement") or {}
    gpus = (_int(placement_cfg, "policy_num_gpus_per_node", "trainer.placement", 1)
            * _int(placement_cfg, "policy_num_nodes", "trainer.placement", 1)) if on_gpu else 0
    if trainer.get("strategy", "fsdp") not in ("fsdp", "fsdp2"):
        raise InvalidInput("trainer.strategy", f"floe's policy trains with FSDP2 (fsdp or fsdp2), got {trainer.get('strategy')!r}")
    if not placement_cfg.get("colocate_policy_ref", True):
        raise InvalidInput("trainer.placement.colocate_policy_ref", "floe keeps the reference with the policy (policy "
                           "rank 0's process); set it true (the reference's numbers do not depend on where it runs)")

    policy, ref = trainer.get("policy") or {}, trainer.get("ref") or {}
    for name, section in (("policy", policy), ("ref", ref)):
        if section.get("sequence_parallel_size", 1) != 1:
            raise InvalidInput(f"trainer.{name}.sequence_parallel_size", "floe has no sequence parallelism; set it to 1")
        fsdp = section.get("fsdp_config") or {}
        if fsdp.get("fsdp_size", -1) not in (-1, gpus or -1):
            raise InvalidInput(f"trainer.{name}.fsdp_config.fsdp_size", "floe shards the policy over every GPU of the "
                               "run; use -1")

    dtype = "bfloat16" if trainer.get("bf16", True) else "float32"
    mixed = (policy.get("fsdp_config") or {}).get("mixed_precision")
    if mixed:
        where = "trainer.policy.fsdp_config.mixed_precision"
        dtype = floe_dtype(mixed.get("param_dtype", dtype), f"{where}.param_dtype")
        for key in ("reduce_dtype", "buffer_dtype"):
            if floe_dtype(mixed.get(key, "fp32"), f"{where}.{key}") != "float32":
                raise InvalidInput(f"{where}.{key}", "floe reduces gradients and keeps buffers in fp32; set fp32")

    engine_cfg = generator.get("inference_engine") or {}
    backend_name = engine_cfg.get("backend", "vllm")
    if backend_name != "vllm":
        raise InvalidInput(f"{_ENGINE}.backend", f"floe's sampler engines are vLLM and floe's torch engine; use vllm "
                           f"(or floe.backend.sampler.engine.name=torch), got {backend_name!r}")
    for key, (default, why) in _ENGINE_OFF.items():
        if engine_cfg.get(key, default) != default:
            raise InvalidInput(f"{_ENGINE}.{key}", f"{why}; keep {default!r} (got {engine_cfg[key]!r})")
    replicas = 1
    for key in ("num_engines", "tensor_parallel_size", "data_parallel_size"):
        replicas *= _int(engine_cfg, key, _ENGINE, 1) if key in engine_cfg else 1
    if gpus and gpus % replicas:
        raise InvalidInput(f"{_ENGINE}.num_engines", f"num_engines x tensor_parallel_size x data_parallel_size "
                           f"({replicas}) must divide the policy's {gpus} GPUs: floe runs one single-GPU sampler "
                           "replica per GPU")

    offload = any(bool((s.get("fsdp_config") or {}).get("cpu_offload", False)) for s in (policy, ref))
    placement = placement_for(GpuLayout(gpus, bool(placement_cfg.get("colocate_all", True)) or offload))

    engine_dtype = floe_dtype(engine_cfg.get("model_dtype", "bfloat16"), f"{_ENGINE}.model_dtype", sampling=True)
    engine = vllm_engine(engine_cfg, engine_dtype, dtype, on_gpu, placement["kind"] == "ray",
                         bool(engine_cfg.get("enable_chunked_prefill", True)))

    compute: dict[str, Any] = {"gradient_checkpointing": bool(trainer.get("gradient_checkpointing", True))}
    if (trainer.get("max_tokens_per_microbatch") or -1) > 0:
        compute["max_tokens_per_microbatch"] = int(trainer["max_tokens_per_microbatch"])
    if trainer.get("logprobs_chunk_size"):
        compute["logprob_chunk_tokens"] = _int(trainer, "logprobs_chunk_size", "trainer", 1)
    attn = "flash_attention_2" if on_gpu and trainer.get("flash_attn", True) else "auto"
    backend = {"device": device, "dtype": dtype, "attn_implementation": attn, "compute": compute,
               "sampler": {"engine": engine}, "placement": placement}
    lora = skyrl_lora((policy.get("model") or {}).get("lora") or {})
    if lora is not None:
        backend["lora"] = lora
    return SkyRLHardware(backend, gpus, "vllm")
