"""Model loading (any HF causal LM) and the tiny-model kit used by tests and demos."""

from floe.models.loading import load_model, load_tokenizer, resolve_attn_implementation, resolve_dtype
from floe.models.tiny import make_tiny

__all__ = ["load_model", "load_tokenizer", "make_tiny", "resolve_attn_implementation", "resolve_dtype"]
