"""Loading Hugging Face causal LMs and tokenizers from a directory or a hub id."""

from __future__ import annotations

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

transformers.utils.logging.disable_progress_bar()  # floe shows its own progress

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def load_model(
    path: str,
    dtype: str = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load a causal LM with SDPA attention, in eval mode (floe never uses dropout)."""
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=resolve_dtype(dtype),
        trust_remote_code=trust_remote_code,
        attn_implementation="sdpa",
    )
    model.to(device)
    model.eval()  # dropout off: RL log-probs must be deterministic functions of the weights
    model.config.use_cache = False
    return model


def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
