"""Tensor codecs of the wire format: the ragged payloads of floe's operations <-> flat arrays.

A codec turns one typed value into named, flat, little-endian numpy arrays (and back); the
framing (one safetensors blob per message) is protocol/wire.py's job, and which operation uses
which codec is its record in protocol/ops.py. Ragged structure travels as lengths:

  <name>            flat concatenation of a list of lists (I32/I64 for ids, F32/F64 for floats)
  <name>.lengths    I64, one length per list
  <name>.present    U8, for optional per-sample fields: which samples have one

A batch carries `group_sizes` (samples per group), `prompt`+`prompt.lengths` (each prompt
ONCE, however many samples share it; never padded), `tokens`+`tokens.lengths`, and the
optional `logprobs`, `weights`, `ref_logprobs`, `advantage` (per token),
`advantage.scalar` and `temperature` (each a length-1 list per sample). A sample result
carries each sequence's `temperature` the same optional way, and its optional `top_logprobs`
as `top_logprobs.ids` + `top_logprobs` (per sequence: tokens × k, flattened). Floats go as F32 when that is exact (sampler
and policy log-probs are float32 already) and as F64 otherwise, so decoding always yields
exactly the numbers that were encoded: a remote call sees the same inputs as an in-process one.

Encoders raise InvalidInput naming the caller's field for values of the wrong type; decoders
check every length and dtype and raise WireError instead of trusting the sender.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from floe.errors import InvalidInput
from floe.protocol.errors import WireError
from floe.types import (
    Batch,
    ForwardBackwardResult,
    ForwardResult,
    Group,
    Sample,
    SampledGroup,
    SampledSequence,
    SampleResult,
)

Tensors = dict[str, np.ndarray]

_STOP_REASONS = ("stop_token", "stop_string", "length")
_OPTIONAL_SAMPLE_FIELDS = ("logprobs", "weights", "ref_logprobs")


@dataclass(frozen=True)
class ArgCodec:
    """How one request argument travels as tensors: `encode(value, tensors)` adds arrays
    (InvalidInput on a value of the wrong type); `decode(tensors)` rebuilds the value."""

    encode: Callable[[Any, Tensors], None]
    decode: Callable[[Tensors], Any]


@dataclass(frozen=True)
class ResultCodec:
    """How a result travels: `encode(result, tensors)` adds arrays and returns the JSON-able
    rest; `decode(json_rest, tensors)` rebuilds the result."""

    encode: Callable[[Any, Tensors], dict[str, Any]]
    decode: Callable[[dict[str, Any], Tensors], Any]


# -- ragged lists <-> flat tensors ---------------------------------------------------------------


def _flat(lists: list[Any], kind: str, field_of: Callable[[int], str]) -> np.ndarray:
    """Concatenate lists of ids (kind 'int') or numbers (kind 'float') into one array.

    Ids go as I32 when they fit; floats as F32 when that is exact, else F64. A value of the
    wrong type raises InvalidInput naming the list it came from.
    """
    flat = [v for values in lists for v in values]
    arr = np.array(flat) if flat else np.zeros(0, np.int32 if kind == "int" else np.float32)
    allowed = "iu" if kind == "int" else "iuf"
    if arr.ndim != 1 or arr.dtype.kind not in allowed:
        _raise_first_bad(lists, kind, field_of)
    if kind == "int":
        small = arr.size == 0 or (arr.min() >= -(2**31) and arr.max() < 2**31)
        return arr.astype(np.int32 if small else np.int64)
    wide = np.asarray(arr, dtype=np.float64)
    narrow = wide.astype(np.float32)
    return narrow if np.array_equal(narrow, wide, equal_nan=True) else wide


def _raise_first_bad(lists: list[Any], kind: str, field_of: Callable[[int], str]) -> None:
    for i, values in enumerate(lists):
        for v in values:
            if kind == "int" and type(v) is not int:
                raise InvalidInput(field_of(i), f"token ids must be integers, got {v!r}")
            if kind == "float" and (type(v) not in (int, float)):
                raise InvalidInput(field_of(i), f"must be a list of numbers, got an element {v!r}")
    raise InvalidInput(field_of(0), "values must fit in 64-bit integers / floats")


def _put_lists(tensors: Tensors, name: str, lists: list[Any], kind: str, field_of: Callable[[int], str]) -> None:
    for i, values in enumerate(lists):
        if not isinstance(values, list):
            what = "token ids" if kind == "int" else "numbers"
            raise InvalidInput(field_of(i), f"must be a list of {what}, got {type(values).__name__}")
    tensors[name] = _flat(lists, kind, field_of)
    tensors[f"{name}.lengths"] = np.array([len(v) for v in lists], dtype=np.int64)


def _get_lists(tensors: Tensors, name: str, count: int, kind: str) -> list[list[Any]]:
    data, lengths = _need(tensors, name, kind), _need(tensors, f"{name}.lengths", "int")
    if lengths.shape != (count,) or (count and (lengths.min() < 0 or lengths.max() > data.size)):
        raise WireError(f"body.{name}.lengths", f"must be {count} non-negative lengths")
    if data.ndim != 1 or int(lengths.sum()) != data.size:
        raise WireError(f"body.{name}", f"has {data.size} values but its lengths add up to {int(lengths.sum())}")
    values = data.tolist()
    out, start = [], 0
    for n in lengths.tolist():
        out.append(values[start : start + n])
        start += n
    return out


def _put_optional(tensors: Tensors, name: str, values: list[Any], kind: str, field_of: Callable[[int], str]) -> None:
    present = [v is not None for v in values]
    if any(present):
        idx = [i for i, p in enumerate(present) if p]
        tensors[f"{name}.present"] = np.array(present, dtype=np.uint8)
        _put_lists(tensors, name, [values[i] for i in idx], kind, lambda k: field_of(idx[k]))


def _get_optional(tensors: Tensors, name: str, count: int, kind: str) -> list[Any]:
    if f"{name}.present" not in tensors:
        if name in tensors:
            raise WireError(f"body.{name}.present", "is missing")
        return [None] * count
    present = _need(tensors, f"{name}.present", "u8")
    if present.shape != (count,) or present.max(initial=0) > 1:
        raise WireError(f"body.{name}.present", f"must be {count} flags of 0 or 1")
    lists = iter(_get_lists(tensors, name, int(present.sum()), kind))
    return [next(lists) if p else None for p in present.tolist()]


def _need(tensors: Tensors, name: str, kind: str) -> np.ndarray:
    arr = tensors.get(name)
    if arr is None:
        raise WireError(f"body.{name}", "is missing")
    kinds = {"int": "iu", "float": "f", "u8": "u"}[kind]
    if arr.dtype.kind not in kinds:
        raise WireError(f"body.{name}", f"has dtype {arr.dtype}; expected {kind}")
    return arr


# -- op-specific payloads ------------------------------------------------------------------------


def _encode_prompts(prompts: Any, tensors: Tensors) -> None:
    if not isinstance(prompts, list):
        raise InvalidInput("prompts", "must be a non-empty list of token-id lists")
    _put_lists(tensors, "prompt", prompts, "int", lambda i: f"prompts[{i}]")


def _decode_prompts(tensors: Tensors) -> list[list[int]]:
    lengths = _need(tensors, "prompt.lengths", "int")
    return _get_lists(tensors, "prompt", lengths.size, "int")


def _encode_batch(batch: Any, tensors: Tensors) -> None:
    groups = batch.groups if isinstance(batch, Batch) else batch
    if not isinstance(groups, list) or not all(isinstance(g, Group) for g in groups):
        raise InvalidInput("batch", f"must be a floe.Batch or a list of floe.Group, got {type(batch).__name__}")
    for gi, g in enumerate(groups):
        if not isinstance(g.samples, list) or not all(isinstance(s, Sample) for s in g.samples):
            raise InvalidInput(f"batch.groups[{gi}].samples", "must be a non-empty list of floe.Sample")
    where = [(gi, si) for gi, g in enumerate(groups) for si in range(len(g.samples))]
    samples = [s for g in groups for s in g.samples]

    def sample_field(name: str) -> Callable[[int], str]:
        return lambda k: f"batch.groups[{where[k][0]}].samples[{where[k][1]}].{name}"

    tensors["group_sizes"] = np.array([len(g.samples) for g in groups], dtype=np.int64)
    _put_lists(tensors, "prompt", [g.prompt for g in groups], "int", lambda i: f"batch.groups[{i}].prompt")
    _put_lists(tensors, "tokens", [s.tokens for s in samples], "int", sample_field("tokens"))
    for name in _OPTIONAL_SAMPLE_FIELDS:
        _put_optional(tensors, name, [getattr(s, name) for s in samples], "float", sample_field(name))
    for i, s in enumerate(samples):
        if s.advantage is not None and not isinstance(s.advantage, (list, int, float)):
            raise InvalidInput(sample_field("advantage")(i), f"must be a finite number or a per-token list, got {s.advantage!r}")
    per_token = [s.advantage if isinstance(s.advantage, list) else None for s in samples]
    scalar = [[s.advantage] if isinstance(s.advantage, (int, float)) else None for s in samples]
    _put_optional(tensors, "advantage", per_token, "float", sample_field("advantage"))
    _put_optional(tensors, "advantage.scalar", scalar, "float", sample_field("advantage"))
    _put_scalars(tensors, "temperature", [s.temperature for s in samples], sample_field("temperature"))


def _decode_batch(tensors: Tensors) -> Batch:
    sizes = _group_sizes(tensors)
    count = int(sizes.sum())
    prompts = _get_lists(tensors, "prompt", sizes.size, "int")
    tokens = _get_lists(tensors, "tokens", count, "int")
    extra = {name: _get_optional(tensors, name, count, "float") for name in _OPTIONAL_SAMPLE_FIELDS}
    per_token = _get_optional(tensors, "advantage", count, "float")
    scalar = _get_optional(tensors, "advantage.scalar", count, "float")
    temperatures = _get_scalars(tensors, "temperature", count)
    samples = []
    for i in range(count):
        if per_token[i] is not None and scalar[i] is not None:
            raise WireError("body.advantage", f"sample {i} has both a scalar and a per-token advantage")
        if scalar[i] is not None and len(scalar[i]) != 1:
            raise WireError("body.advantage.scalar", f"sample {i}: a scalar advantage is one value")
        advantage = scalar[i][0] if scalar[i] is not None else per_token[i]
        samples.append(
            Sample(tokens[i], advantage=advantage, temperature=temperatures[i], **{k: v[i] for k, v in extra.items()})
        )
    return Batch([Group(p, samples[a:b]) for p, a, b in zip(prompts, *_bounds(sizes))])


def _put_scalars(tensors: Tensors, name: str, values: list[Any], field_of: Callable[[int], str]) -> None:
    """Optional numbers, one per sample (None = absent), as length-1 lists under `name`."""
    for i, v in enumerate(values):
        if v is not None and type(v) not in (int, float):
            raise InvalidInput(field_of(i), f"must be a number or None, got {v!r}")
    _put_optional(tensors, name, [[v] if v is not None else None for v in values], "float", field_of)


def _get_scalars(tensors: Tensors, name: str, count: int) -> list[float | None]:
    values = _get_optional(tensors, name, count, "float")
    for i, v in enumerate(values):
        if v is not None and len(v) != 1:
            raise WireError(f"body.{name}", f"sample {i}: a {name} is one value")
    return [v[0] if v is not None else None for v in values]


def _group_sizes(tensors: Tensors) -> np.ndarray:
    sizes = _need(tensors, "group_sizes", "int")
    if sizes.ndim != 1 or (sizes.size and (sizes.min() < 0 or sizes.max() > 1 << 31)) or int(sizes.sum()) > 1 << 31:
        raise WireError("body.group_sizes", "must be a 1-D list of non-negative sample counts")
    return sizes


def _bounds(sizes: np.ndarray) -> tuple[list[int], list[int]]:
    ends = np.cumsum(sizes).tolist()
    return [0] + ends[:-1], ends


def _nest(flat: list[Any], sizes: np.ndarray) -> list[list[Any]]:
    return [flat[a:b] for a, b in zip(*_bounds(sizes))]


def _put_nested(tensors: Tensors, name: str, nested: list[list[list[float]]]) -> None:
    """[group][sample][token] floats (a result's log-probs), with `group_sizes` alongside."""
    tensors["group_sizes"] = np.array([len(g) for g in nested], dtype=np.int64)
    _put_lists(tensors, name, [s for g in nested for s in g], "float", lambda i: f"result.{name}")


def _get_nested(tensors: Tensors, name: str) -> list[list[list[float]]]:
    sizes = _group_sizes(tensors)
    return _nest(_get_lists(tensors, name, int(sizes.sum()), "float"), sizes)


def _encode_sample_result(r: SampleResult, tensors: Tensors) -> dict[str, Any]:
    seqs = [s for g in r.groups for s in g.samples]
    tensors["group_sizes"] = np.array([len(g.samples) for g in r.groups], dtype=np.int64)
    _put_lists(tensors, "prompt", [g.prompt for g in r.groups], "int", lambda i: "result.prompt")
    _put_lists(tensors, "tokens", [s.tokens for s in seqs], "int", lambda i: "result.tokens")
    _put_lists(tensors, "logprobs", [s.logprobs for s in seqs], "float", lambda i: "result.logprobs")
    tensors["stop_reason"] = np.array([_STOP_REASONS.index(s.stop_reason) for s in seqs], dtype=np.uint8)
    tensors["weights_version"] = np.array([s.weights_version for s in seqs], dtype=np.int64)
    _put_scalars(tensors, "temperature", [s.temperature for s in seqs], lambda i: "result.temperature")
    _put_top_logprobs(tensors, seqs)
    return {"weights_version": r.weights_version, "num_tokens": r.num_tokens, "seconds": r.seconds}


def _put_top_logprobs(tensors: Tensors, seqs: list[SampledSequence]) -> None:
    """Each sequence's optional `top_logprobs` ([token][k] (id, log-prob), the same k for all
    its tokens) as flat `top_logprobs.ids` and `top_logprobs` lists, k = length / tokens."""
    ids: list[list[int] | None] = []
    values: list[list[float] | None] = []
    for i, s in enumerate(seqs):
        top = s.top_logprobs
        if top is None:
            ids.append(None)
            values.append(None)
            continue
        k = len(top[0]) if top else 0
        if len(top) != len(s.tokens) or any(len(alts) != k for alts in top):
            raise InvalidInput(f"result.top_logprobs[{i}]", "must hold the same number of alternatives for each token")
        ids.append([t for alts in top for t, _ in alts])
        values.append([lp for alts in top for _, lp in alts])
    _put_optional(tensors, "top_logprobs.ids", ids, "int", lambda i: f"result.top_logprobs[{i}]")
    _put_optional(tensors, "top_logprobs", values, "float", lambda i: f"result.top_logprobs[{i}]")


def _get_top_logprobs(tensors: Tensors, tokens: list[list[int]]) -> list[list[list[tuple[int, float]]] | None]:
    ids = _get_optional(tensors, "top_logprobs.ids", len(tokens), "int")
    values = _get_optional(tensors, "top_logprobs", len(tokens), "float")
    out: list[list[list[tuple[int, float]]] | None] = []
    for i, (seq_ids, seq_values, seq_tokens) in enumerate(zip(ids, values, tokens)):
        if seq_ids is None or seq_values is None:
            if seq_ids is not None or seq_values is not None:
                raise WireError("body.top_logprobs.present", f"sequence {i} has ids or log-probs but not both")
            out.append(None)
            continue
        n = len(seq_tokens)
        if len(seq_ids) != len(seq_values) or (n == 0 and seq_ids) or (n and len(seq_ids) % n):
            raise WireError("body.top_logprobs", f"sequence {i}: {len(seq_ids)} ids and {len(seq_values)} log-probs for {n} tokens")
        k = len(seq_ids) // n if n else 0
        pairs = list(zip(seq_ids, seq_values))
        out.append([pairs[t * k : (t + 1) * k] for t in range(n)])
    return out


def _decode_sample_result(result: dict[str, Any], tensors: Tensors) -> SampleResult:
    sizes = _group_sizes(tensors)
    count = int(sizes.sum())
    tokens = _get_lists(tensors, "tokens", count, "int")
    logprobs = _get_lists(tensors, "logprobs", count, "float")
    reasons = [_STOP_REASONS[i] for i in _need(tensors, "stop_reason", "u8").tolist()]
    versions = _need(tensors, "weights_version", "int").tolist()
    temperatures = _get_scalars(tensors, "temperature", count)
    tops = _get_top_logprobs(tensors, tokens)
    seqs = [
        SampledSequence(t, lp, r, v, temp, top)  # type: ignore[arg-type]
        for t, lp, r, v, temp, top in zip(tokens, logprobs, reasons, versions, temperatures, tops)
    ]
    prompts = _get_lists(tensors, "prompt", sizes.size, "int")
    groups = [SampledGroup(p, ss) for p, ss in zip(prompts, _nest(seqs, sizes))]
    return SampleResult(groups, **result)


def _encode_forward_result(r: ForwardResult, tensors: Tensors) -> dict[str, Any]:
    _put_nested(tensors, "logprobs", r.logprobs)
    if r.entropy is not None:
        _put_lists(tensors, "entropy", [s for g in r.entropy for s in g], "float", lambda i: "result.entropy")
    return {"entropy": r.entropy is not None, "metrics": r.metrics}


def _decode_forward_result(result: dict[str, Any], tensors: Tensors) -> ForwardResult:
    entropy = _get_nested(tensors, "entropy") if result.get("entropy") else None
    return ForwardResult(_get_nested(tensors, "logprobs"), entropy, dict(result.get("metrics") or {}))


def _encode_fb_result(r: ForwardBackwardResult, tensors: Tensors) -> dict[str, Any]:
    _put_nested(tensors, "logprobs", r.logprobs)
    return {"metrics": r.metrics, "loss": r.loss, "loss_config": r.loss_config}


def _decode_fb_result(result: dict[str, Any], tensors: Tensors) -> ForwardBackwardResult:
    return ForwardBackwardResult(logprobs=_get_nested(tensors, "logprobs"), **result)


PROMPTS = ArgCodec(_encode_prompts, _decode_prompts)
"""list[list[int]]: each prompt once, as `prompt` + `prompt.lengths`."""
BATCH = ArgCodec(_encode_batch, _decode_batch)
"""floe.Batch (or a list of floe.Group): prompts once per group, samples' ragged fields."""
SAMPLE_RESULT = ResultCodec(_encode_sample_result, _decode_sample_result)
FORWARD_RESULT = ResultCodec(_encode_forward_result, _decode_forward_result)
FORWARD_BACKWARD_RESULT = ResultCodec(_encode_fb_result, _decode_fb_result)
