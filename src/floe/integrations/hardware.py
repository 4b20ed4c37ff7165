"""What the verl and SkyRL mappings of device, dtype and engine keys share (pure).

Each plugin's own `hardware.py` reads its framework's keys; the pieces here are the ones both
need: a framework dtype name as floe's, the vLLM engine table built from a framework's vLLM
settings, and `floe.backend` overrides applied over what the recipe mapped to.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from floe.config import FLOAT16_REFUSED, deep_merge
from floe.errors import InvalidInput

__all__ = ["VLLM_KEYS", "describe", "floe_dtype", "vllm_engine", "with_overrides"]

_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32",
           "float16": "float16", "fp16": "float16", "half": "float16"}
# vLLM settings both frameworks name as floe's vLLM engine does (VllmEngineConfig)
VLLM_KEYS = ("gpu_memory_utilization", "enforce_eager", "max_num_seqs", "max_model_len", "enable_prefix_caching",
             "max_num_batched_tokens")


def floe_dtype(value: Any, key: str) -> str:
    """"bfloat16" or "float32" for a framework's dtype name (bf16, fp32, ...); InvalidInput(key)
    for float16 (FLOAT16_REFUSED) and for names that are no dtype."""
    if value not in _DTYPES:
        raise InvalidInput(key, f"unknown dtype {value!r}; floe trains in bfloat16 or float32")
    if _DTYPES[value] == "float16":
        raise InvalidInput(key, FLOAT16_REFUSED)
    return _DTYPES[value]


def vllm_engine(settings: Mapping[str, Any], dtype: str, policy_dtype: str, on_gpu: bool, switching: bool,
                chunked_prefill: bool) -> dict[str, Any]:
    """floe's `[sampler.engine]` table for vLLM from a framework's vLLM `settings` (the keys of
    `VLLM_KEYS` that are set), its sampler `dtype` (kept only when it differs from the policy's),
    and where it runs: chunked prefill on GPUs only (vLLM's CPU generators cannot rewind),
    sleep mode when training and generation take turns on the GPUs."""
    engine: dict[str, Any] = {"name": "vllm", **{k: settings[k] for k in VLLM_KEYS if settings.get(k) is not None}}
    if dtype != policy_dtype:
        engine["dtype"] = dtype
    if on_gpu:
        engine["enable_chunked_prefill"] = chunked_prefill
    if switching and on_gpu:
        engine["enable_sleep_mode"] = True
    return engine


def with_overrides(backend: dict[str, Any], overrides: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`backend` (what the recipe mapped to) with the `floe.backend` `overrides` merged in. A
    different `sampler.engine.name` or `placement.kind` replaces that table (its keys belong to
    the other kind); `model` is refused (InvalidInput("<where>.model"): it is the recipe's)."""
    if "model" in overrides:
        raise InvalidInput(f"{where}.model", "comes from the recipe's model path; drop it")
    out = dict(backend)
    sampler = overrides.get("sampler")
    engine = sampler.get("engine") if isinstance(sampler, Mapping) else None
    mapped_engine = (out.get("sampler") or {}).get("engine") or {}
    if isinstance(engine, Mapping) and engine.get("name", mapped_engine.get("name")) != mapped_engine.get("name"):
        out["sampler"] = {}
    placement = overrides.get("placement")
    mapped_kind = (out.get("placement") or {}).get("kind", "local")
    if isinstance(placement, Mapping) and placement.get("kind", mapped_kind) != mapped_kind:
        out["placement"] = {}
    return deep_merge(out, dict(overrides))


def describe(backend: Mapping[str, Any]) -> str:
    """One log line of where and how a BackendConfig dict trains and samples (the plugins log it
    at start, so a user sees what the recipe's keys chose)."""
    engine = ((backend.get("sampler") or {}).get("engine") or {}).get("name", "torch")
    placement = (backend.get("placement") or {}).get("kind", "local")
    checkpointing = (backend.get("compute") or {}).get("gradient_checkpointing", False)
    return (f"floe backend settings: device={backend.get('device', 'cpu')} dtype={backend.get('dtype', 'float32')} "
            f"engine={engine} placement={placement} gradient_checkpointing={checkpointing}")
