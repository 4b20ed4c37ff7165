"""What the verl and SkyRL stock-recipe suites share: a transcribed recipe and a key's name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StockRecipe:
    """A framework's example script as its command-line keys (`key=value`, Hydra's `+` kept)."""

    name: str
    source: str  # the script's path in the framework's repository (the snapshot each module names)
    keys: tuple[str, ...]


def key_name(key: str) -> str:
    """`a.b=c` and `+a.b=c` -> `a.b`."""
    return key.split("=", 1)[0].lstrip("+")
