"""Client-side normalisation of `sample`'s prompts: common containers of token ids -> list[list[int]].

`as_prompts` runs once, in the client, before anything reaches the transport, so every
placement (in-process, HTTP, Ray) receives the same plain lists. Accepted:

* a list or tuple of prompts, each a list/tuple of ints, a 1-D integer numpy array or a 1-D
  integer torch tensor (ragged prompts are taken as they are);
* a single prompt: a flat list/tuple of ints, or a 1-D integer array/tensor;
* a 2-D integer numpy array or torch tensor: one prompt per row, every column kept (a raw
  array carries no padding information: pass a padded batch with its mask, below);
* a mapping with "input_ids" (a tokenizer's `BatchEncoding`, or a dict) holding any of the
  above, optionally with "attention_mask" of the same shape: each row keeps the ids where the
  mask is 1, which must be one contiguous run (left or right padding, nothing in between).

Integer scalars of numpy and torch count as ints. Anything else (text, floats, booleans,
3-D arrays, empty prompts, other mapping keys) raises InvalidInput naming `prompts` (or
`prompts[i]`, `prompts.input_ids`, `prompts.attention_mask`) and the accepted forms. Token-id
ranges are checked by the backend, which knows the vocabulary.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from floe.errors import InvalidInput

ACCEPTED = (
    "a list of token-id lists, a 1-D/2-D integer numpy array or torch tensor, or a tokenizer's "
    "BatchEncoding / a dict with 'input_ids' (and 'attention_mask' for padded batches)"
)
_MAPPING_KEYS = frozenset({"input_ids", "attention_mask"})


def as_prompts(prompts: Any) -> list[list[int]]:
    """`prompts` in any accepted form (module docstring) as a new list of lists of Python ints.

    Raises InvalidInput naming the offending part; the input is never modified.
    """
    if isinstance(prompts, Mapping):
        return _from_mapping(prompts)
    rows = _rows(prompts, "prompts")
    return [_ids(row, f"prompts[{i}]") for i, row in enumerate(rows)]


def _from_mapping(encoding: Mapping[Any, Any]) -> list[list[int]]:
    extra = sorted(str(k) for k in encoding if k not in _MAPPING_KEYS)
    if "input_ids" not in encoding:
        raise InvalidInput("prompts", f"a mapping of prompts needs 'input_ids'; got keys {sorted(map(str, encoding))}")
    if extra:
        raise InvalidInput(
            "prompts", f"unexpected keys {extra}: only 'input_ids' and 'attention_mask' are used; drop the others"
        )
    ids = [_ids(row, f"prompts.input_ids[{i}]") for i, row in enumerate(_rows(encoding["input_ids"], "prompts.input_ids"))]
    if encoding.get("attention_mask") is None:
        return ids
    field = "prompts.attention_mask"
    masks = [_ids(row, f"{field}[{i}]") for i, row in enumerate(_rows(encoding["attention_mask"], field))]
    if len(masks) != len(ids) or any(len(m) != len(r) for m, r in zip(masks, ids)):
        raise InvalidInput(field, "must have the shape of input_ids")
    out = []
    for i, (row, mask) in enumerate(zip(ids, masks)):
        if any(m not in (0, 1) for m in mask):
            raise InvalidInput(f"{field}[{i}]", "must hold only 0 (padding) and 1 (token)")
        kept = [k for k, m in enumerate(mask) if m == 1]
        if not kept:
            raise InvalidInput(f"{field}[{i}]", "masks out every token: a prompt must not be empty")
        if kept[-1] - kept[0] + 1 != len(kept):
            raise InvalidInput(f"{field}[{i}]", "must be 1 on one contiguous run (left or right padding only)")
        out.append(row[kept[0] : kept[-1] + 1])
    return out


def _rows(value: Any, field: str) -> list[Any]:
    """The prompts in `value` as a list of rows (each still to be read as ids)."""
    array = _as_array(value, field)
    if array is not None:
        if array.ndim == 1:
            return [array]
        if array.ndim == 2:
            return list(array)
        raise InvalidInput(field, f"must be 1-D (one prompt) or 2-D (one prompt per row), got {array.ndim}-D; {ACCEPTED}")
    if isinstance(value, (str, bytes)):
        raise InvalidInput(field, f"must be token ids, not text: encode it with client.tokenizer() or floe.chat; {ACCEPTED}")
    if not isinstance(value, (list, tuple)) or not value:
        what = "empty" if isinstance(value, (list, tuple)) else type(value).__name__
        raise InvalidInput(field, f"must be a non-empty batch of prompts, got {what}; {ACCEPTED}")
    if not any(_is_sequence(v) for v in value):
        return [value]  # one prompt given flat (its elements are checked as ids)
    return list(value)


def _is_sequence(v: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor):
        return v.ndim > 0
    return isinstance(v, (list, tuple, np.ndarray))


def _ids(row: Any, field: str) -> list[int]:
    """One prompt as a list of Python ints."""
    array = _as_array(row, field)
    if array is not None:
        if array.ndim != 1:
            raise InvalidInput(field, f"must be a 1-D sequence of token ids, got a {array.ndim}-D array")
        return [int(v) for v in array.tolist()]
    if not isinstance(row, (list, tuple)):
        raise InvalidInput(field, f"must be a list of token ids, got {type(row).__name__}")
    if not row:
        raise InvalidInput(field, "must not be empty")
    for v in row:
        if not _is_int(v):
            raise InvalidInput(field, f"token ids must be integers, got {v!r}")
    return [int(v) for v in row]


def _as_array(value: Any, field: str) -> np.ndarray | None:
    """A numpy view of a numpy array or torch tensor of integers; None for anything else.
    InvalidInput for arrays of another dtype (floats, booleans, objects) or empty ones."""
    torch = sys.modules.get("torch")  # a tensor exists only if torch was imported
    if torch is not None and isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise InvalidInput(field, f"token ids must be integers, got a tensor of {value.dtype}")
        value = value.detach().cpu().numpy()
    if not isinstance(value, np.ndarray):
        return None
    if value.dtype.kind not in "iu":
        raise InvalidInput(field, f"token ids must be integers, got an array of {value.dtype}")
    if value.size == 0:
        raise InvalidInput(field, "must not be empty")
    return value


def _is_int(v: Any) -> bool:
    if isinstance(v, (bool, np.bool_)):
        return False
    if isinstance(v, (int, np.integer)):
        return True
    torch = sys.modules.get("torch")
    return (
        torch is not None and isinstance(v, torch.Tensor) and v.ndim == 0
        and not (v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool)
    )
