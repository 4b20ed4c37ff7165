"""Loading Hugging Face causal LMs and tokenizers from a directory or a hub id.

This module owns the choice of attention implementation (`BackendConfig.attn_implementation`):
`"auto"` takes SDPA where the architecture supports it and eager attention otherwise (what
transformers itself would choose), decided from the model class's `_supports_*` flags before
any weight is read; an explicit choice the architecture or this machine cannot run is an
`InvalidInput` that names the ones it can.

It also owns the checks that run before anything loads (`check_model_source`; the device check,
which needs torch alone, is `floe.devices.check_device`),
shared by the Backend's start-up and the CLI's preflight (`floe.rl.preflight`), so a wrong
device or model path is one InvalidInput line naming the field and the fix.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from floe.errors import InvalidInput

transformers.utils.logging.disable_progress_bar()  # floe shows its own progress

HUB_TIMEOUT_S = 10.0  # how long `check_model_source` waits for the hub to answer
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Implementation name -> the model-class flag that says the architecture supports it.
# Eager attention is every architecture's reference implementation and needs no flag.
_SUPPORT_FLAGS = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn", "flash_attention_2": "_supports_flash_attn"}
# Implementation name -> check that this machine can run it, and what it needs otherwise.
_AVAILABLE = {
    "flex_attention": (transformers.utils.is_torch_flex_attn_available, "a PyTorch build with flex attention"),
    "flash_attention_2": (transformers.utils.is_flash_attn_2_available, "the flash-attn package and a CUDA GPU"),
}


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype for "float32", "bfloat16" or "float16"; ValueError for anything else."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def check_model_source(path: str, field: str = "model") -> None:
    """InvalidInput(field, ...) unless ``path`` is a model directory (with a config.json), or a hub
    id that is cached locally or that the hub answers for within HUB_TIMEOUT_S seconds.

    Nothing is downloaded. A hub id not in the cache with HF_HUB_OFFLINE (or
    TRANSFORMERS_OFFLINE) set, unknown to the hub, gated, or unreachable is an error that says so.
    """
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise InvalidInput(field, f"{path} is not a Hugging Face model directory (it has no config.json)")
        return
    if path.startswith((".", "/", "~")) or not _REPO_ID.fullmatch(path):
        raise InvalidInput(field, f"no such model directory: {path}; give an existing directory or a hub id like Qwen/Qwen3-0.6B")
    from huggingface_hub import try_to_load_from_cache  # noqa: PLC0415 - only for hub ids

    if isinstance(try_to_load_from_cache(path, "config.json"), str):
        return
    if _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE")):
        raise InvalidInput(field, f"{path!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                                  "download it first (hf download) or give a local directory")
    from huggingface_hub import HfApi, constants  # noqa: PLC0415
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError  # noqa: PLC0415

    try:
        HfApi().model_info(path, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        raise InvalidInput(field, f"{path!r} is gated on the hub; accept its terms and log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise InvalidInput(field, f"no model {path!r} on the Hugging Face hub (or it is private: log in); "
                                  "check the name or give a local directory") from None
    except Exception as e:  # noqa: BLE001 - any network failure means the same to the user
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise InvalidInput(field, f"cannot reach the Hugging Face hub ({constants.ENDPOINT}) to fetch {path!r}: {reason}; "
                                  "check the network, or give a local directory") from None


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def causal_lm_class(config: PretrainedConfig, path: str, trust_remote_code: bool = False) -> type[PreTrainedModel]:
    """The class `AutoModelForCausalLM` would instantiate for `config` (read from `path`).

    Raises InvalidInput("model", ...) when transformers has no causal-LM class for the model type.
    """
    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForCausalLM" in auto_map:
        return get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], path)
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        hint = (
            "; the model ships its own code: set trust_remote_code = true to use it"
            if "AutoModelForCausalLM" in auto_map
            else "; floe trains decoder-only causal LMs (AutoModelForCausalLM)"
        )
        raise InvalidInput(
            "model",
            f"{path}: model type {config.model_type!r} has no causal-LM class in transformers {transformers.__version__}"
            + hint,
        ) from None


def supported_attn_implementations(model_class: type[PreTrainedModel]) -> list[str]:
    """The attention implementations `model_class` supports: eager, then those its flags allow."""
    return ["eager"] + [name for name, flag in _SUPPORT_FLAGS.items() if getattr(model_class, flag, False)]


def resolve_attn_implementation(model_class: type[PreTrainedModel], requested: str = "auto") -> str:
    """The attention implementation to load `model_class` with.

    "auto" -> "sdpa" when the class supports it, else "eager". Any other value must be one of
    `supported_attn_implementations(model_class)` and runnable here (flash-attn installed for
    "flash_attention_2", a torch with flex attention for "flex_attention"); otherwise
    InvalidInput("attn_implementation", ...) naming the supported ones.
    """
    supported = supported_attn_implementations(model_class)
    if requested == "auto":
        return "sdpa" if "sdpa" in supported else "eager"
    if requested not in supported:
        raise InvalidInput(
            "attn_implementation",
            f"{model_class.__name__} does not support {requested!r}; use 'auto' or one of {supported}",
        )
    check = _AVAILABLE.get(requested)
    if check is not None and not check[0]():
        runnable = [name for name in supported if name not in _AVAILABLE or _AVAILABLE[name][0]()]
        raise InvalidInput(
            "attn_implementation",
            f"{requested!r} needs {check[1]}, which this machine lacks; use 'auto' or one of {runnable}",
        )
    return requested


def context_length(config: PretrainedConfig) -> int:
    """Tokens a model of `config` takes at once (prompt + generated); unbounded (2**31) when the
    config states no `max_position_embeddings`."""
    return int(getattr(config, "max_position_embeddings", 2**31))


def load_model(
    path: str,
    dtype: str = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str = "auto",
) -> PreTrainedModel:
    """Load a causal LM in eval mode (floe never uses dropout), with `use_cache` off.

    `attn_implementation` as in `resolve_attn_implementation` (default "auto": SDPA where the
    architecture supports it, else eager); the attention choice is checked before any weight
    is read. The loaded model's `config._attn_implementation` records what runs.
    Raises InvalidInput for a model that is not a causal LM or an unsupported attention choice.
    """
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    model_class = causal_lm_class(config, path, trust_remote_code)
    model = model_class.from_pretrained(
        path,
        config=config,
        dtype=resolve_dtype(dtype),
        trust_remote_code=trust_remote_code,
        attn_implementation=resolve_attn_implementation(model_class, attn_implementation),
    )
    model.to(device)
    model.eval()  # dropout off: RL log-probs must be deterministic functions of the weights
    model.config.use_cache = False
    return model


def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The model's tokenizer; one without a pad token pads with its eos token."""
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
