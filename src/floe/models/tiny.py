"""The tiny-model kit: a small random-init Qwen3 plus a character-level tokenizer.

`make_tiny` writes an ordinary Hugging Face directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a chat template, and the `TINY_MARKER` file), so
tests and demos go through the same loading code as a real model and nothing is ever
downloaded.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from floe.atomic import atomic_directory
from floe.errors import InvalidInput

TINY_MARKER = "floe_tiny.json"  # in every directory make_tiny writes: it may replace those only

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHARACTERS = sorted(set(string.printable) - set("\x0b\x0c\r"))

# A plain chat template the character tokenizer can render: role markers are single tokens.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def make_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: every printable ASCII character is one token."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    # BPE with no merges splits text into single characters; Fuse joins them back on decode.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<|end|>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_tiny(
    path: str | os.PathLike,
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """Build a random-init Qwen3 with the given dimensions and save it as an HF directory.

    `path` must be new, empty, or an earlier make_tiny directory (it carries TINY_MARKER);
    anything else is refused with InvalidInput("path", ...) and left untouched. The directory
    is written through `floe.atomic.atomic_directory`, so a crash never leaves a half-written
    model behind. Returns the path.
    """
    path = Path(path)
    if path.exists() and not (path.is_dir() and (not any(path.iterdir()) or (path / TINY_MARKER).is_file())):
        raise InvalidInput("path", f"{path} exists and was not written by make_tiny; choose a new or empty directory")
    spec = {
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads, "num_key_value_heads": num_key_value_heads, "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": tie_word_embeddings, "seed": seed,
    }
    tok = make_char_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim or hidden_size // num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        attention_dropout=0.0,
        use_cache=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    with atomic_directory(path, replace=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / TINY_MARKER).write_text(json.dumps(spec, indent=2) + "\n")
    return path
