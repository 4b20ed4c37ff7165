"""Reading the public datasets' row files (JSONL, JSON arrays, parquet) into plain dicts.

Families that accept ``data_path`` use this to load rows and check the columns they need, so a
wrong file fails with the path, the row and the missing column instead of a KeyError later.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_rows(path: str, required: tuple[str, ...], option: str = "data_path") -> list[dict]:
    """Rows of ``path`` (.jsonl, .json or .parquet), each checked to have ``required`` columns."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"{option}: no such file: {path}")
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        rows = _read_jsonl(file, option)
    elif suffix == ".json":
        rows = json.loads(file.read_text(encoding="utf-8"))
        if not isinstance(rows, list):
            raise ValueError(f"{option}: {path} must hold a JSON array of objects")
    elif suffix == ".parquet":
        rows = _read_parquet(file, option)
    else:
        raise ValueError(f"{option}: unsupported file type {suffix!r} for {path}; use .jsonl, .json or .parquet")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{option}: row {i} of {path} is not an object")  # noqa: TRY004 - bad file content, reported as a value error
        missing = [c for c in required if c not in row]
        if missing:
            raise ValueError(f"{option}: row {i} of {path} lacks column(s) {', '.join(missing)}")
    return rows


def _read_jsonl(file: Path, option: str) -> list[dict]:
    rows = []
    with file.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{option}: {file} line {lineno} is not valid JSON ({err.msg})") from None
    return rows


def _read_parquet(file: Path, option: str) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"{option}: reading parquet ({file}) needs pyarrow, which is not installed; "
            "install pyarrow or convert the file to .jsonl"
        ) from None
    return pq.read_table(file).to_pylist()
