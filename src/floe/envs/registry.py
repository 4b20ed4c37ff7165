"""The name -> EnvFamily registry behind ``floe.envs.make_family``.

Families are imported on first use, so importing ``floe.envs`` (which every sandbox worker
process does) stays cheap.
"""

from __future__ import annotations

import importlib

from floe.envs.base import EnvFamily

# name -> (module, class)
_REGISTRY: dict[str, tuple[str, str]] = {
    "reverse_text": ("floe.envs.reverse_text", "ReverseTextFamily"),
    "math": ("floe.envs.math", "MathFamily"),
    "alphabet_sort": ("floe.envs.alphabet_sort", "AlphabetSortFamily"),
    "text2sql": ("floe.envs.text2sql", "Text2SqlFamily"),
}

FAMILIES: tuple[str, ...] = tuple(_REGISTRY)


def make_family(name: str, **options: object) -> EnvFamily:
    """Build the env family ``name`` with ``options``.

    Raises ValueError naming an unknown family (listing the valid ones) or unknown/invalid
    options (listing the family's valid options).
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown env family {name!r}; valid families: {', '.join(FAMILIES)}")
    module_name, class_name = _REGISTRY[name]
    family_class = getattr(importlib.import_module(module_name), class_name)
    return family_class(**options)
