"""The JSON decoding rule every parser of request bytes shares: an object that names a key twice
is refused. Python's json module keeps the last value silently; which one the sender meant is
ambiguous (and two parsers on one path may each pick another), so it is an error naming the key."""

from __future__ import annotations

from typing import Any

from floe.errors import InvalidInput

__all__ = ["unique_keys"]


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads(..., object_pairs_hook=unique_keys)`: the object as a dict; InvalidInput("body")
    naming the first key that appears twice in one object."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise InvalidInput("body", f"the JSON object names key {key!r} twice; send each key once")
            seen.add(key)
    return out
