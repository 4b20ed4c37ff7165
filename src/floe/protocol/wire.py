"""The HTTP wire format: one safetensors blob per request or result; nothing is ever pickled.

Every message is ONE safetensors blob (media type `application/vnd.floe.safetensors`). Its
`__metadata__` holds `{"floe": "<control JSON>"}`: `{"v": 1, "op": ..., "args": {...}}` for a
request, `{"v": 1, "op": ..., "result": ...}` for a result. An operation's record in
protocol/ops.py decides what travels how: its tensor argument and tensor result go through
their codec (protocol/codecs.py: token ids and floats as flat little-endian arrays, ragged
structure as lengths, each prompt once), dataclass arguments (SamplingParams) as JSON objects,
everything else as JSON; a request's arguments are checked against the operation's signature.

`unpack` checks everything it is given (header size, UTF-8 JSON, dtypes, shapes, offsets) and
the codecs check lengths that add up; a malformed message raises `WireError` (HTTP 400)
instead of being trusted. An unknown operation raises InvalidInput("op", ...).
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from typing import Any, TypeGuard

import numpy as np

from floe.errors import InvalidInput
from floe.protocol.codecs import Tensors
from floe.protocol.errors import WireError
from floe.protocol.ops import get_op
from floe.protocol.strict_json import unique_keys

__all__ = [
    "CLIENT_HEADER", "MEDIA_TYPE", "REPLAYED_HEADER", "SEQ_HEADER", "VERSION", "Tensors", "WireError",
    "decode_request", "decode_result", "encode_request", "encode_result", "pack", "unpack",
]

MEDIA_TYPE = "application/vnd.floe.safetensors"
CLIENT_HEADER = "X-Floe-Client"  # the client's id
SEQ_HEADER = "X-Floe-Seq"  # the request's number within that client: 1, 2, 3, ...
REPLAYED_HEADER = "X-Floe-Replayed"  # "1" on an answer replayed from the server's cache
VERSION = 1
MAX_HEADER_BYTES = 1 << 20
MAX_TENSORS = 64
MAX_DIMS = 4
# Elements a tensor's shape may describe, counting a 0 dimension as 1: a tensor with data is
# bounded by its bytes anyway, but an empty one ([0, 2**70]) is not, and numpy refuses (a 500) to
# even describe one past 2**63 bytes. 2**40 is beyond any body floe accepts.
MAX_SHAPE_ELEMENTS = 1 << 40

_DTYPES = {"I32": np.dtype("<i4"), "I64": np.dtype("<i8"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"), "U8": np.dtype("u1")}
_DTYPE_NAMES = {dt.str: name for name, dt in _DTYPES.items()}


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
        chunks.append(arr.reshape(-1).data.cast("B"))
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
        header = json.loads(bytes(view[8 : 8 + head_len]).decode("utf-8"), object_pairs_hook=unique_keys)
    except InvalidInput as exc:
        raise WireError("body", f"the safetensors header: {exc.message}") from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise WireError("body", "the safetensors header is not UTF-8 JSON") from None
    if not isinstance(header, dict):
        raise WireError("body", "the safetensors header must be a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not isinstance(meta.get("floe"), str):
        raise WireError("body.__metadata__", "must hold the control JSON as a string under 'floe'")
    try:
        control = json.loads(meta["floe"], object_pairs_hook=unique_keys)
    except InvalidInput as exc:
        raise WireError("body.__metadata__.floe", exc.message) from None
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
    if math.prod(d or 1 for d in shape) > MAX_SHAPE_ELEMENTS:
        raise WireError(f"{field}.shape", f"{_shown_shape(shape)} describes more than 2**40 elements (a zero "
                                          "dimension counted as 1); no tensor floe exchanges is that large: send the "
                                          "tensor's real shape")
    count = math.prod(shape)
    if count * dtype.itemsize != offsets[1] - offsets[0]:
        raise WireError(field, f"shape {shape} of {spec['dtype']} does not match {offsets[1] - offsets[0]} bytes")
    if count == 0:
        return np.empty(shape, dtype)
    return np.frombuffer(data, dtype=dtype, count=count, offset=offsets[0]).reshape(shape)


def _shown_shape(shape: list[int]) -> str:
    return "[" + ", ".join(str(d) if d < 10**12 else f"~2**{d.bit_length() - 1}" for d in shape) + "]"


def _int_list(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


# -- requests --------------------------------------------------------------------------------


def encode_request(op: str, kwargs: dict[str, Any]) -> bytes:
    """A call's keyword arguments as one message.

    Raises InvalidInput("op") for an unknown operation and InvalidInput naming the argument
    (or the element inside it) for a value of the wrong type.
    """
    spec = get_op(op)
    tensors: Tensors = {}
    args = dict(kwargs)
    if spec.tensor_arg is not None and spec.arg_codec is not None and spec.tensor_arg in args:
        spec.arg_codec.encode(args.pop(spec.tensor_arg), tensors)
    for name, cls in spec.dataclass_args:
        if args.get(name) is not None:
            if not isinstance(args[name], cls):
                raise InvalidInput(name, f"must be floe.{cls.__name__}, got {type(args[name]).__name__}")
            args[name] = dataclasses.asdict(args[name])
    for key, value in args.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise InvalidInput(key, f"must be JSON-serializable, got {type(value).__name__}") from None
    return pack({"v": VERSION, "op": op, "args": args}, tensors)


def decode_request(op: str, body: bytes) -> dict[str, Any]:
    """The keyword arguments for `Backend.<op>`, checked against the operation's signature.

    Raises WireError for a malformed message and InvalidInput for arguments the signature
    does not accept (unknown, missing, or a dataclass argument with unknown fields).
    """
    spec = get_op(op)
    control, tensors = unpack(body)
    if control.get("op") != op:
        raise WireError("body.op", f"the message is for {control.get('op')!r}, sent to {op!r}")
    args = control.get("args")
    if not isinstance(args, dict):
        raise WireError("body.args", "must be a JSON object of keyword arguments")
    if spec.tensor_arg is not None and spec.arg_codec is not None:
        if spec.tensor_arg in args:
            raise WireError(f"body.args.{spec.tensor_arg}", "travels as tensors, not JSON")
        if tensors:
            args[spec.tensor_arg] = spec.arg_codec.decode(tensors)
    elif tensors:
        raise WireError("body", f"operation {op!r} takes no tensors")
    for name, cls in spec.dataclass_args:
        if isinstance(args.get(name), dict):
            try:
                args[name] = cls(**args[name])
            except TypeError as e:
                raise InvalidInput(name, f"unknown or missing {cls.__name__} field: {e}") from None
    try:
        spec.signature.bind(**args)
    except TypeError as e:
        raise InvalidInput("body.args", str(e)) from None
    return args


# -- results ---------------------------------------------------------------------------------


def encode_result(op: str, result: Any) -> bytes:
    """An operation's result as one message (tensors through its codec, the rest as JSON)."""
    spec = get_op(op)
    tensors: Tensors = {}
    if spec.result_codec is not None:
        payload = spec.result_codec.encode(result, tensors)
    else:
        payload = dataclasses.asdict(result) if dataclasses.is_dataclass(result) and not isinstance(result, type) else result
    return pack({"v": VERSION, "op": op, "result": payload}, tensors)


def decode_result(op: str, body: bytes) -> Any:
    """The typed result of `op` (an instance of the operation's result class); WireError when
    the message is not a well-formed result of `op`."""
    spec = get_op(op)
    control, tensors = unpack(body)
    if control.get("op") != op or "result" not in control:
        raise WireError("body", f"not a result of {op!r}")
    payload = control["result"]
    if spec.result_codec is not None:
        return spec.result_codec.decode(payload, tensors)
    if not dataclasses.is_dataclass(spec.result):
        if not isinstance(payload, spec.result):
            raise WireError("body.result", f"must be a {spec.result.__name__}, got {type(payload).__name__}")
        return payload
    if not isinstance(payload, dict):
        raise WireError("body.result", f"must be a JSON object of {spec.result.__name__}'s fields")
    try:
        return spec.result(**payload)
    except TypeError as e:
        raise WireError("body.result", f"is not a {spec.result.__name__}: {e}") from None
