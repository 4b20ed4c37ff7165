"""The HTTP transport's wire format: pure encode/decode functions used by client and server.

Every operation's request and every result is ONE safetensors blob (media type
`application/vnd.floe.safetensors`); nothing is ever pickled. The blob's `__metadata__`
holds `{"floe": "<control JSON>"}`: `{"v": 1, "op": ..., "args": {...}}` for a request,
`{"v": 1, "op": ..., "result": ...}` for a result. Token ids and float arrays travel as flat,
little-endian tensors; ragged structure travels as lengths:

  <name>            flat concatenation of a list of lists (I32/I64 for ids, F32/F64 for floats)
  <name>.lengths    I64, one length per list
  <name>.present    U8, for optional per-sample fields: which samples have one

A batch carries `group_sizes` (samples per group), `prompt`+`prompt.lengths` (each prompt
ONCE, however many samples share it; never padded), `tokens`+`tokens.lengths`, and the
optional `logprobs`, `weights`, `ref_logprobs`, `advantage` (per token) and
`advantage.scalar` (a length-1 list per sample). Floats go as F32 when that is exact (sampler
and policy log-probs are float32 already) and as F64 otherwise, so decoding always yields
exactly the numbers that were encoded: a remote call sees the same inputs as an in-process one.

`unpack` checks everything it is given (header size, UTF-8 JSON, dtypes, shapes, offsets,
lengths that add up) and raises `WireError` (HTTP 400) instead of trusting the sender.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from floe.client.client import Client
from floe.client.transport import OPERATIONS
from floe.errors import InvalidInput
from floe.types import (
    Batch,
    ForwardBackwardResult,
    ForwardResult,
    Group,
    Info,
    OptimStepResult,
    Sample,
    SampledGroup,
    SampledSequence,
    SampleResult,
    SamplingParams,
    StateResult,
    SyncResult,
)

MEDIA_TYPE = "application/vnd.floe.safetensors"
CLIENT_HEADER = "X-Floe-Client"  # the client's id
SEQ_HEADER = "X-Floe-Seq"  # the request's number within that client: 1, 2, 3, ...
REPLAYED_HEADER = "X-Floe-Replayed"  # "1" on an answer replayed from the server's cache
VERSION = 1
MAX_HEADER_BYTES = 1 << 20
MAX_TENSORS = 64
MAX_DIMS = 4

_DTYPES = {"I32": np.dtype("<i4"), "I64": np.dtype("<i8"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"), "U8": np.dtype("u1")}
_DTYPE_NAMES = {dt.str: name for name, dt in _DTYPES.items()}
_STOP_REASONS = ("stop_token", "stop_string", "length")
_OPTIONAL_SAMPLE_FIELDS = ("logprobs", "weights", "ref_logprobs")

Tensors = dict[str, np.ndarray]


class WireError(InvalidInput):
    """A body that is not a well-formed floe message. The server answers 400."""


# -- framing ----------------------------------------------------------------------------------


def pack(control: dict[str, Any], tensors: Tensors) -> bytes:
    """One safetensors blob: header (tensor specs + control JSON as metadata), then the data.

    Tensors are laid out largest dtype first so every one stays aligned; the data is copied
    once, into the returned bytes.
    """
    header: dict[str, Any] = {"__metadata__": {"floe": json.dumps(control, separators=(",", ":"))}}
    chunks: list[memoryview] = []
    offset = 0
    for name, arr in sorted(tensors.items(), key=lambda kv: (-kv[1].dtype.itemsize, kv[0])):
        arr = np.ascontiguousarray(arr)
        header[name] = {"dtype": _DTYPE_NAMES[arr.dtype.str], "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        chunks.append(memoryview(arr.reshape(-1)).cast("B"))
        offset += arr.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return b"".join([struct.pack("<Q", len(head)), head, *chunks])


def unpack(body: bytes) -> tuple[dict[str, Any], Tensors]:
    """Parse and check a blob from `pack`; arrays are read-only views into `body` (no copy)."""
    view = memoryview(body)
    if len(view) < 8:
        raise WireError("body", f"is {len(view)} bytes; a floe message is a safetensors blob")
    (head_len,) = struct.unpack_from("<Q", view)
    if head_len > min(len(view) - 8, MAX_HEADER_BYTES):
        raise WireError("body", f"declares a {head_len}-byte header but has {len(view) - 8} bytes after the size")
    try:
        header = json.loads(bytes(view[8 : 8 + head_len]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise WireError("body", "the safetensors header is not UTF-8 JSON") from None
    if not isinstance(header, dict):
        raise WireError("body", "the safetensors header must be a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not isinstance(meta.get("floe"), str):
        raise WireError("body.__metadata__", "must hold the control JSON as a string under 'floe'")
    try:
        control = json.loads(meta["floe"])
    except (ValueError, RecursionError):
        raise WireError("body.__metadata__.floe", "is not valid JSON") from None
    if not isinstance(control, dict) or control.get("v") != VERSION:
        raise WireError("body.__metadata__.floe", f"must be a JSON object with \"v\": {VERSION}")
    if len(header) > MAX_TENSORS:
        raise WireError("body", f"has {len(header)} tensors; at most {MAX_TENSORS}")
    data = view[8 + head_len :]
    return control, {name: _tensor(name, spec, data) for name, spec in header.items()}


def _tensor(name: str, spec: Any, data: memoryview) -> np.ndarray:
    field = f"body.{name}"
    if not isinstance(spec, dict):
        raise WireError(field, "tensor spec must be an object with dtype, shape, data_offsets")
    dtype = _DTYPES.get(spec.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise WireError(f"{field}.dtype", f"must be one of {sorted(_DTYPES)}, got {spec.get('dtype')!r}")
    shape, offsets = spec.get("shape"), spec.get("data_offsets")
    if not _int_list(shape) or len(shape) > MAX_DIMS:
        raise WireError(f"{field}.shape", f"must be a list of at most {MAX_DIMS} non-negative integers")
    if not _int_list(offsets) or len(offsets) != 2 or not offsets[0] <= offsets[1] <= len(data):
        raise WireError(f"{field}.data_offsets", f"must be [begin, end] within the {len(data)} data bytes")
    count = math.prod(shape)
    if count * dtype.itemsize != offsets[1] - offsets[0]:
        raise WireError(field, f"shape {shape} of {spec['dtype']} does not match {offsets[1] - offsets[0]} bytes")
    if count == 0:
        return np.empty(shape, dtype)
    return np.frombuffer(data, dtype=dtype, count=count, offset=offsets[0]).reshape(shape)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


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


def _decode_prompts(control: dict[str, Any], tensors: Tensors) -> list[list[int]]:
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


def _decode_batch(control: dict[str, Any], tensors: Tensors) -> Batch:
    sizes = _group_sizes(tensors)
    count = int(sizes.sum())
    prompts = _get_lists(tensors, "prompt", sizes.size, "int")
    tokens = _get_lists(tensors, "tokens", count, "int")
    extra = {name: _get_optional(tensors, name, count, "float") for name in _OPTIONAL_SAMPLE_FIELDS}
    per_token = _get_optional(tensors, "advantage", count, "float")
    scalar = _get_optional(tensors, "advantage.scalar", count, "float")
    samples = []
    for i in range(count):
        if per_token[i] is not None and scalar[i] is not None:
            raise WireError("body.advantage", f"sample {i} has both a scalar and a per-token advantage")
        if scalar[i] is not None and len(scalar[i]) != 1:
            raise WireError("body.advantage.scalar", f"sample {i}: a scalar advantage is one value")
        advantage = scalar[i][0] if scalar[i] is not None else per_token[i]
        samples.append(Sample(tokens[i], advantage=advantage, **{k: v[i] for k, v in extra.items()}))
    return Batch([Group(p, samples[a:b]) for p, a, b in zip(prompts, *_bounds(sizes))])


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
    return {"weights_version": r.weights_version, "num_tokens": r.num_tokens, "seconds": r.seconds}


def _decode_sample_result(result: dict[str, Any], tensors: Tensors) -> SampleResult:
    sizes = _group_sizes(tensors)
    count = int(sizes.sum())
    tokens = _get_lists(tensors, "tokens", count, "int")
    logprobs = _get_lists(tensors, "logprobs", count, "float")
    reasons = [_STOP_REASONS[i] for i in _need(tensors, "stop_reason", "u8").tolist()]
    versions = _need(tensors, "weights_version", "int").tolist()
    seqs = [SampledSequence(t, lp, r, v) for t, lp, r, v in zip(tokens, logprobs, reasons, versions)]  # type: ignore[arg-type]
    prompts = _get_lists(tensors, "prompt", sizes.size, "int")
    groups = [SampledGroup(p, ss) for p, ss in zip(prompts, _nest(seqs, sizes))]
    return SampleResult(groups, **result)


def _encode_forward_result(r: ForwardResult, tensors: Tensors) -> dict[str, Any]:
    _put_nested(tensors, "logprobs", r.logprobs)
    if r.entropy is not None:
        _put_lists(tensors, "entropy", [s for g in r.entropy for s in g], "float", lambda i: "result.entropy")
    return {"entropy": r.entropy is not None}


def _decode_forward_result(result: dict[str, Any], tensors: Tensors) -> ForwardResult:
    entropy = _get_nested(tensors, "entropy") if result.get("entropy") else None
    return ForwardResult(_get_nested(tensors, "logprobs"), entropy)


def _encode_fb_result(r: ForwardBackwardResult, tensors: Tensors) -> dict[str, Any]:
    _put_nested(tensors, "logprobs", r.logprobs)
    return {"metrics": r.metrics, "loss": r.loss, "loss_config": r.loss_config}


def _decode_fb_result(result: dict[str, Any], tensors: Tensors) -> ForwardBackwardResult:
    return ForwardBackwardResult(logprobs=_get_nested(tensors, "logprobs"), **result)


# Arguments that travel as tensors, per op (everything else is JSON in control["args"]).
_TENSOR_ARGS: dict[str, tuple[str, Callable[[Any, Tensors], None], Callable[[dict[str, Any], Tensors], Any]]] = {
    "sample": ("prompts", _encode_prompts, _decode_prompts),
    "forward": ("batch", _encode_batch, _decode_batch),
    "forward_backward": ("batch", _encode_batch, _decode_batch),
}
_TENSOR_RESULTS: dict[str, tuple[Callable[[Any, Tensors], dict[str, Any]], Callable[[dict[str, Any], Tensors], Any]]] = {
    "sample": (_encode_sample_result, _decode_sample_result),
    "forward": (_encode_forward_result, _decode_forward_result),
    "forward_backward": (_encode_fb_result, _decode_fb_result),
}
_JSON_RESULTS: dict[str, Callable[[Any], Any]] = {
    "optim_step": lambda d: OptimStepResult(**d),
    "sync_weights": lambda d: SyncResult(**d),
    "save_state": lambda d: StateResult(**d),
    "load_state": lambda d: StateResult(**d),
    "list_states": list,
    "export_hf": str,
    "info": lambda d: Info(**d),
}


def _check_op(op: str) -> None:
    if op not in OPERATIONS:
        raise InvalidInput("op", f"unknown operation {op!r}; one of {list(OPERATIONS)}")


# -- requests --------------------------------------------------------------------------------


def encode_request(op: str, kwargs: dict[str, Any]) -> bytes:
    """A Client call's keyword arguments as one message (raises InvalidInput on bad types)."""
    _check_op(op)
    tensors: Tensors = {}
    args = dict(kwargs)
    if op in _TENSOR_ARGS:
        name, encode, _ = _TENSOR_ARGS[op]
        if name in args:
            encode(args.pop(name), tensors)
    if op == "sample" and args.get("params") is not None:
        if not isinstance(args["params"], SamplingParams):
            raise InvalidInput("params", f"must be floe.SamplingParams, got {type(args['params']).__name__}")
        args["params"] = dataclasses.asdict(args["params"])
    for key, value in args.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise InvalidInput(key, f"must be JSON-serializable, got {type(value).__name__}") from None
    return pack({"v": VERSION, "op": op, "args": args}, tensors)


def decode_request(op: str, body: bytes) -> dict[str, Any]:
    """The keyword arguments for `Backend.<op>`, checked against the Client's signature."""
    _check_op(op)
    control, tensors = unpack(body)
    if control.get("op") != op:
        raise WireError("body.op", f"the message is for {control.get('op')!r}, sent to {op!r}")
    args = control.get("args")
    if not isinstance(args, dict):
        raise WireError("body.args", "must be a JSON object of keyword arguments")
    if op in _TENSOR_ARGS:
        name, _, decode = _TENSOR_ARGS[op]
        if name in args:
            raise WireError(f"body.args.{name}", "travels as tensors, not JSON")
        if tensors:
            args[name] = decode(control, tensors)
    elif tensors:
        raise WireError("body", f"operation {op!r} takes no tensors")
    if op == "sample" and isinstance(args.get("params"), dict):
        try:
            args["params"] = SamplingParams(**args["params"])
        except TypeError as e:
            raise InvalidInput("params", f"unknown or missing sampling parameter: {e}") from None
    try:
        inspect.signature(getattr(Client, op)).bind(None, **args)
    except TypeError as e:
        raise InvalidInput("body.args", str(e)) from None
    return args


# -- results ---------------------------------------------------------------------------------


def encode_result(op: str, result: Any) -> bytes:
    _check_op(op)
    tensors: Tensors = {}
    if op in _TENSOR_RESULTS:
        payload = _TENSOR_RESULTS[op][0](result, tensors)
    else:
        payload = dataclasses.asdict(result) if dataclasses.is_dataclass(result) else result
    return pack({"v": VERSION, "op": op, "result": payload}, tensors)


def decode_result(op: str, body: bytes) -> Any:
    _check_op(op)
    control, tensors = unpack(body)
    if control.get("op") != op or "result" not in control:
        raise WireError("body", f"not a result of {op!r}")
    if op in _TENSOR_RESULTS:
        return _TENSOR_RESULTS[op][1](control["result"], tensors)
    return _JSON_RESULTS[op](control["result"])
