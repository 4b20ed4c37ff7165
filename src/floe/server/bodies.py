"""Request bodies: the one JSON parser every route uses, with a nesting bound checked before the
parser runs (a deeply nested body would otherwise be a RecursionError, a 5xx), and the decoded
value's shape checked as an object."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from floe.errors import InvalidInput
from floe.protocol.strict_json import unique_keys

__all__ = ["MAX_JSON_DEPTH", "json_depth", "parse_json_object"]

MAX_JSON_DEPTH = 64  # deeper than any request of any protocol floe serves (the deepest is ~6)
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text (strings skipped), in linear time
    without recursion. Malformed text gives some number; the parser then refuses it."""
    stripped = _STRINGS.sub(b'""', raw)
    if not stripped:
        return 0
    steps = _OPEN[np.frombuffer(stripped, dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def _no_constant(name: str) -> float:
    raise InvalidInput("body", f"{name} is not a JSON number (send a finite number)")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidInput("body", f"{text} is out of range for a 64-bit float (send a finite number)")
    return value


def parse_json_object(raw: bytes, field: str = "body") -> dict[str, Any]:
    """A JSON object from a request body; InvalidInput(field) when it is not UTF-8 JSON, nests
    deeper than MAX_JSON_DEPTH, holds a non-finite number (`NaN`, `Infinity`, `1e400`; Python's
    parser accepts them), names a key twice in one object (strict_json) or is not an object;
    InvalidInput naming the value's path (`prompt`, `messages[0].content`) when a string holds a
    lone UTF-16 surrogate (`"\\ud800"`)."""
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise InvalidInput(field, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        data = json.loads(raw, parse_constant=_no_constant, parse_float=_finite, object_pairs_hook=unique_keys)
    except InvalidInput as exc:
        raise InvalidInput(field, exc.message) from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise InvalidInput(field, "must be a JSON object (the body is not valid JSON)") from None
    if not isinstance(data, dict):
        raise InvalidInput(field, f"must be a JSON object, got {type(data).__name__}")
    if _MAYBE_SURROGATE.search(raw):  # only a \uD800-\uDFFF escape can make one (UTF-8 bytes cannot)
        _refuse_lone_surrogates(data, "")
    return data


# A JSON string escape in the UTF-16 surrogate range; json.loads turns an unpaired one into a lone
# surrogate, which is not a Unicode character: tokenizers, SQLite and UTF-8 encoders then raise
# (a 500), so every route refuses it here, naming the field.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE = re.compile("[\ud800-\udfff]")
_SURROGATE_FIX = ("holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is not a Unicode "
                  "character: send valid text (a character outside the BMP is a surrogate pair, e.g. \\ud83d\\ude00)")


def _refuse_lone_surrogates(value: Any, path: str) -> None:
    """InvalidInput naming the first string (or object key) of the decoded `value` that holds a
    lone surrogate; `path` is where `value` is (`messages[0].content`). Depth is bounded by
    MAX_JSON_DEPTH, so the recursion is too."""
    if isinstance(value, str):
        if _LONE.search(value):
            raise InvalidInput(path or "body", _SURROGATE_FIX)
    elif isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if _LONE.search(key):
                raise InvalidInput(path or "body", f"has a key that {_SURROGATE_FIX}")
            _refuse_lone_surrogates(item, where)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _refuse_lone_surrogates(item, f"{path}[{i}]")
