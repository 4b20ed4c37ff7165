"""Atomic writes: the one way floe puts a file or a directory on disk.

A reader sees the old content or the new content, never a half-written one:
* `atomic_write_text` / `atomic_write_bytes`: write a temporary sibling, fsync, rename over.
* `atomic_directory(final)`: a context manager yielding a temporary sibling directory; on
  success it is swapped into place with two renames (old aside, new in). A crash between the
  two renames is repaired by `recover(final)`, which every reader of such a directory calls
  first (`recover_all(parent)` for a whole folder of them). On an exception the temporary
  directory is removed and `final` is untouched.

`replace=False` (the default for directories) refuses to replace an existing `final`: callers
that own what they replace (a state of the same name, an earlier floe export) pass
`replace=True` after checking that it is theirs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_directory", "atomic_write_bytes", "atomic_write_text", "recover", "recover_all"]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` atomically (temporary sibling, fsync, rename). Creates parents."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide shared run files from other users
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    """`atomic_write_bytes` of `text` encoded as UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def recover(final: Path) -> None:
    """Finish an interrupted directory swap: if `final` is missing but its previous version was
    moved aside (a crash between the two renames), move that version back."""
    final = Path(final)
    if final.exists():
        return
    for old in sorted(final.parent.glob(f".{final.name}.old-*")):
        if old.is_dir() and any(old.iterdir()):
            os.replace(old, final)
            return


def recover_all(parent: Path) -> None:
    """`recover` every entry of `parent` whose swap a crash interrupted."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    for old in parent.glob(".*.old-*"):
        recover(parent / old.name[1:].split(".old-")[0])


@contextmanager
def atomic_directory(final: str | Path, *, replace: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to `final`; on success swap it into place.

    Raises FileExistsError (before yielding) when `final` exists and `replace` is False.
    Leftover temporary directories of a crashed write of the same `final` are removed.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    recover(final)
    if final.exists() and not replace:
        raise FileExistsError(f"{final} already exists")
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp's 0o700 would make shared checkpoints unreadable to others
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
