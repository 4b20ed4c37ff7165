"""verl's device, precision, memory and engine settings -> the plugin's floe backend (pure; no verl import).

A stock verl recipe says where and how to train: `trainer.device` and the GPU count, the
FSDP mixed-precision dtype, gradient checkpointing, offload, and the rollout engine with its
vLLM settings. `verl_hardware` turns those keys into the BackendConfig keys of the `floe serve`
the plugin starts, so the recipe needs no floe-specific key to train and sample on its GPUs, in
its dtype, with its engine. Keys floe cannot honour are refused with InvalidInput naming the verl
key and the fix. Keys that change only speed or memory inside verl's own engine and have no
counterpart in floe (torch.compile, liger kernels, remove-padding, FSDP wrap and prefetch
details, micro-batch sizes in sequences) are accepted as they are: docs/integrations.md lists
them and why they change no number.

| verl key | floe BackendConfig |
|---|---|
| trainer.device (cuda, cpu; verl 0.9.1 itself always says cuda, see `verl_hardware`) | device (`+floe.backend.device=cpu` for the CPU) |
| trainer.n_gpus_per_node × trainer.nnodes | GPUs of the run: placement (floe.placement.gpus) |
| actor.fsdp_config.{param_offload, optimizer_offload, offload_policy}, ref.fsdp_config.param_offload, rollout.free_cache_engine | training and generation take turns on the GPUs (colocated Ray placement; vLLM sleep mode) |
| actor.fsdp_config.dtype (ref's must match) | dtype (bfloat16: bf16 compute, fp32 masters) |
| actor.fsdp_config.model_dtype | fp32 only (floe's master weights) |
| model.enable_gradient_checkpointing | compute.gradient_checkpointing |
| model.trust_remote_code | trust_remote_code |
| actor.use_dynamic_bsz + ppo_max_token_len_per_gpu | compute.max_tokens_per_microbatch |
| rollout.name (vllm, floe) | sampler.engine.name (vllm, torch) |
| rollout.tensor_model_parallel_size × data_parallel_size | must divide the GPUs: floe runs one single-GPU sampler replica per GPU |
| rollout.dtype | sampler.engine.dtype |
| rollout.{gpu_memory_utilization, enforce_eager, max_num_seqs, max_model_len, enable_prefix_caching, max_num_batched_tokens, enable_chunked_prefill} | the vLLM engine's keys of the same names |
| model.lora_rank (> 0), lora_alpha | lora.rank, lora.alpha (`verl_lora`; on either placement) |
| model.target_modules ("all-linear" or names), exclude_modules (a name or names) | lora.target_modules, lora.exclude_modules |
| model.target_parameters, lora_adapter_path, lora.rank (Megatron) | refused unless null / 0 |
| rollout.layered_summon, model.use_shm | accepted: memory / file-copy details of verl's own sync and loading; floe syncs merged weights itself |

The plugin's own backend takes these; a `floe.url` server keeps the configuration it was started
with (the plugin then only checks that the keys are valid).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from floe.errors import InvalidInput
from floe.integrations.hardware import floe_dtype, lora_table, vllm_engine
from floe.placement.gpus import GpuLayout, placement_for

ARO = "actor_rollout_ref"
ROLLOUT = f"{ARO}.rollout"
ACTOR = f"{ARO}.actor"
REF = f"{ARO}.ref"
MODEL = f"{ARO}.model"

# verl rollout.name -> floe sampler engine
ENGINES = {"vllm": "vllm", "floe": "torch"}

@dataclass(frozen=True)
class VerlHardware:
    """`backend`: BackendConfig keys (device, dtype, compute, sampler, placement, ...);
    `gpus`: GPUs the run needs (0 on the CPU), for the plugin's check against the Ray cluster;
    `engine`: floe's sampler engine name."""

    backend: dict[str, Any]
    gpus: int
    engine: str


def _get(cfg: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return default if node is None else node


def _int(cfg: Mapping[str, Any], dotted: str, default: int, low: int) -> int:
    value = _get(cfg, dotted, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidInput(dotted, f"must be an integer >= {low}, got {value!r}")
    return value


def _dtype(cfg: Mapping[str, Any], dotted: str, default: str, sampling: bool = False) -> str:
    return floe_dtype(_get(cfg, dotted, default), dotted, sampling)


def _flag(cfg: Mapping[str, Any], dotted: str, default: bool) -> bool:
    value = _get(cfg, dotted, default)
    if not isinstance(value, bool):
        raise InvalidInput(dotted, f"must be true or false, got {value!r}")
    return value


def _must_be(cfg: Mapping[str, Any], dotted: str, allowed: tuple[Any, ...], why: str) -> None:
    value = _get(cfg, dotted, allowed[0])
    if value not in allowed:
        raise InvalidInput(dotted, f"{why} (got {value!r})")


def verl_lora(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """floe's `[lora]` table from verl's FSDP LoRA keys of `actor_rollout_ref.model` (None for
    lora_rank 0), per the module's table; InvalidInput naming the verl key for the LoRA settings
    floe cannot honour: target_parameters (adapters on bare nn.Parameters), lora_adapter_path
    (a pre-trained adapter to continue from: floe resumes its own states), Megatron's `lora`
    block."""
    if _get(cfg, f"{MODEL}.target_parameters") not in (None, []):
        raise InvalidInput(f"{MODEL}.target_parameters", "floe adapts linear modules only (target_modules); set it null")
    if _get(cfg, f"{MODEL}.lora.rank", 0) not in (0, None):
        raise InvalidInput(f"{MODEL}.lora.rank", "that is Megatron's LoRA block; floe trains with FSDP: set "
                                                 "model.lora_rank / lora_alpha / target_modules instead")
    lora = lora_table(_get(cfg, f"{MODEL}.lora_rank", 0), _get(cfg, f"{MODEL}.lora_alpha", 16),
                      _get(cfg, f"{MODEL}.target_modules", "all-linear"), _get(cfg, f"{MODEL}.exclude_modules"),
                      {k: f"{MODEL}.{v}" for k, v in (("rank", "lora_rank"), ("alpha", "lora_alpha"),
                                                       ("target_modules", "target_modules"),
                                                       ("exclude_modules", "exclude_modules"))})
    if lora is not None and _get(cfg, f"{MODEL}.lora_adapter_path") is not None:
        raise InvalidInput(f"{MODEL}.lora_adapter_path", "floe starts the adapter from peft's init (B = 0) and resumes "
                                                         "its own states (trainer.resume_mode); set it null")
    return lora


def verl_hardware(cfg: Mapping[str, Any], device: str | None = None) -> VerlHardware:
    """The backend keys for a resolved verl config (plain dicts), per the module's table.

    `device`: the `floe.backend.device` override, if any, in place of `trainer.device`. verl
    0.9.1 cannot itself ask for the CPU: `main_ppo`'s `auto_set_device` turns trainer.device=cpu
    into "cuda" on a machine without an accelerator (its platform detection falls back to
    nvidia), so a CPU run says `+floe.backend.device=cpu`. Raises InvalidInput naming the verl
    key for a setting floe cannot honour."""
    field = "floe.backend.device" if device is not None else "trainer.device"
    device = device if device is not None else _get(cfg, "trainer.device", "cuda")
    if not isinstance(device, str) or device.split(":")[0] not in ("cuda", "cpu"):
        raise InvalidInput(field, f"floe's zones run on CUDA GPUs or the CPU, got {device!r}; "
                                  "use trainer.device=cuda, or +floe.backend.device=cpu for the CPU")
    device = device.split(":")[0] if field == "trainer.device" else device
    on_gpu = device.startswith("cuda")
    gpus = _int(cfg, "trainer.n_gpus_per_node", 8, 1) * _int(cfg, "trainer.nnodes", 1, 1) if on_gpu else 0

    _must_be(cfg, f"{ACTOR}.strategy", ("fsdp", "fsdp2"), "floe's policy trains with FSDP2 (strategy fsdp or fsdp2)")
    _must_be(cfg, f"{ACTOR}.fsdp_config.fsdp_size", (-1, gpus or -1),
             "floe shards the policy over every GPU of the run; use fsdp_size=-1")
    for key in (f"{ACTOR}.ulysses_sequence_parallel_size", f"{ACTOR}.fsdp_config.ulysses_sequence_parallel_size",
                f"{REF}.ulysses_sequence_parallel_size"):
        _must_be(cfg, key, (1,), "floe has no sequence parallelism; set it to 1 (long sequences: "
                                 "model.enable_gradient_checkpointing and actor.ppo_max_token_len_per_gpu bound memory)")
    if _get(cfg, f"{MODEL}.mtp.enable", False):
        raise InvalidInput(f"{MODEL}.mtp.enable", "floe trains and samples the causal LM without multi-token prediction "
                           "heads; set it false")
    if _get(cfg, f"{ROLLOUT}.engine_kwargs.vllm", None):
        raise InvalidInput(f"{ROLLOUT}.engine_kwargs.vllm", "floe builds its vLLM engine from the rollout keys of the "
                           "table (docs/integrations.md) and floe.backend.sampler.engine (docs/engines.md), not from "
                           "vLLM keyword arguments")
    for key in (f"{ACTOR}.fsdp_config.qat.enable", f"{REF}.fsdp_config.qat.enable"):
        if _get(cfg, key, False):
            raise InvalidInput(key, "floe trains without quantization-aware training (verl's FSDP engine fake-quantises "
                               "the model); set it false")
    if _flag(cfg, f"{MODEL}.enable_activation_offload", False):
        raise InvalidInput(f"{MODEL}.enable_activation_offload", "floe does not offload activations; set it false and "
                           "keep model.enable_gradient_checkpointing=true to bound activation memory")
    for key in (f"{ACTOR}.fsdp_config.model_dtype", f"{REF}.fsdp_config.model_dtype"):
        if _dtype(cfg, key, "fp32") != "float32":
            raise InvalidInput(key, "floe keeps fp32 master weights (bf16 compute comes from fsdp_config.dtype); "
                                    "set model_dtype=fp32")
    dtype = _dtype(cfg, f"{ACTOR}.fsdp_config.dtype", "bfloat16")
    if _dtype(cfg, f"{REF}.fsdp_config.dtype", "bfloat16") != dtype:
        raise InvalidInput(f"{REF}.fsdp_config.dtype", f"floe computes every zone in one dtype; set it to the actor's "
                                                       f"({ACTOR}.fsdp_config.dtype={dtype})")

    name = _get(cfg, f"{ROLLOUT}.name", "vllm")
    if name not in ENGINES:
        raise InvalidInput(f"{ROLLOUT}.name", f"floe's sampler engines are vLLM and floe's torch engine; "
                                              f"use rollout.name=vllm or rollout.name=floe (got {name!r})")
    engine = ENGINES[name]
    # floe runs one sampler replica per GPU (its weights pushed in process), so verl's
    # tensor x data parallel rollout groups become that many single-GPU replicas over the same
    # GPUs: the same sampling, more weight memory per GPU (docs/integrations.md).
    replica_gpus = _int(cfg, f"{ROLLOUT}.tensor_model_parallel_size", 1, 1) * _int(cfg, f"{ROLLOUT}.data_parallel_size", 1, 1)
    if gpus and gpus % replica_gpus:
        raise InvalidInput(f"{ROLLOUT}.tensor_model_parallel_size",
                           f"tensor_model_parallel_size x data_parallel_size ({replica_gpus}) must divide the run's "
                           f"{gpus} GPUs (trainer.n_gpus_per_node x trainer.nnodes)")
    for key in ("pipeline_model_parallel_size", "expert_parallel_size"):
        _must_be(cfg, f"{ROLLOUT}.{key}", (1,), "floe's sampler replicas each hold the whole model on one GPU; "
                                                "set it to 1")
    _must_be(cfg, f"{ROLLOUT}.logprobs_mode", ("processed_logprobs",),
             "floe's samplers record the log-probs of the distribution they sample from (processed_logprobs)")
    _must_be(cfg, f"{ROLLOUT}.quantization", (None,), "floe samples with the policy's own weights; set it null")

    offload = [_flag(cfg, key, False) for key in (f"{ACTOR}.fsdp_config.param_offload",
                                                 f"{ACTOR}.fsdp_config.optimizer_offload",
                                                 f"{ACTOR}.fsdp_config.offload_policy",
                                                 f"{REF}.fsdp_config.param_offload")]
    switching = any(offload) or _flag(cfg, f"{ROLLOUT}.free_cache_engine", True)
    placement = placement_for(GpuLayout(gpus, switching))

    rollout_dtype = _dtype(cfg, f"{ROLLOUT}.dtype", "bfloat16", sampling=True)
    if engine == "vllm":
        sampler_engine = vllm_engine(_get(cfg, ROLLOUT, {}), rollout_dtype, dtype, on_gpu, placement["kind"] == "ray",
                                     _flag(cfg, f"{ROLLOUT}.enable_chunked_prefill", True))
    else:
        sampler_engine = {"name": engine, **({"dtype": rollout_dtype} if rollout_dtype != dtype else {})}

    compute: dict[str, Any] = {"gradient_checkpointing": _flag(cfg, f"{MODEL}.enable_gradient_checkpointing", True)}
    if _flag(cfg, f"{ACTOR}.use_dynamic_bsz", False):
        compute["max_tokens_per_microbatch"] = _int(cfg, f"{ACTOR}.ppo_max_token_len_per_gpu", 16384, 1)

    backend = {
        "device": device, "dtype": dtype, "trust_remote_code": _flag(cfg, f"{MODEL}.trust_remote_code", False),
        "compute": compute, "sampler": {"engine": sampler_engine}, "placement": placement,
    }
    lora = verl_lora(cfg)
    if lora is not None:
        backend["lora"] = lora
    return VerlHardware(backend, gpus, engine)
