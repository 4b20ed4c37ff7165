"""Client-chosen names and the one way they become paths.

Every name a client sends that ends up on disk (a native state name, a Tinker run, session,
sampler or checkpoint id) goes through `check_name`, and every path built from such names goes
through `path_under`: one strict pattern, checked before any path exists, and a final check
that the path stays inside its root. Nothing else in floe joins a client string to a path.

The pattern: 1-128 characters from letters, digits, `_ . : -`, not starting with `.` or `-`,
no `..`, matched in full (`re.fullmatch`, so a trailing newline is not "the end of the line").
Names starting with `.` are therefore never client names: floe keeps its own namespaces there
(`<state_dir>/.tinker/` for the Tinker service, `.<name>.tmp-*` for writes in progress), and
no client name can reach them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from floe.errors import InvalidInput

__all__ = ["NAME_RULE", "check_name", "path_under"]

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,127}")
NAME_RULE = "1-128 letters, digits, '_', '.', ':', '-', starting with a letter, digit or '_', without '..'"


def check_name(value: Any, field: str) -> str:
    """`value` when it is a valid name; InvalidInput(field) saying the rule otherwise."""
    if not isinstance(value, str) or _NAME.fullmatch(value) is None or ".." in value:
        shown = repr(value) if isinstance(value, str) and len(value) <= 80 else type(value).__name__
        raise InvalidInput(field, f"must be {NAME_RULE}; got {shown}")
    return value


def path_under(root: Path, *names: Any, field: str) -> Path:
    """`root / names[0] / names[1] ...`, each name checked by `check_name` (InvalidInput(field)),
    and the result checked to resolve inside `root` (a symlink placed under the root cannot lead
    out of it)."""
    parts = [check_name(n, field) for n in names]
    path = Path(root).joinpath(*parts)
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:
        raise InvalidInput(field, f"{'/'.join(parts)!r} leads outside the server's storage")
    return path
