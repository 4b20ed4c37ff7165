"""Atomic writes: the one way floe puts a file or a directory on disk.

A reader sees the old content or the new content, never a half-written one:
* `atomic_write_text` / `atomic_write_bytes`: write a temporary sibling, fsync, rename over.
* `atomic_directory(final)`: a context manager yielding a temporary sibling directory; on
  success it is swapped into place with two renames (old aside, new in). A crash between the
  two renames is repaired by `recover(final)`, which every reader of such a directory calls
  first (`recover_all(parent)` for a whole folder of them: the states' one listing,
  `floe.backend.state.list_states`, calls it). On an exception the temporary directory is
  removed and `final` is untouched.

Owners: every sibling a write makes carries its writer in its name,
`.<name>.tmp-<pid>@<host>-<random>` (the new version being written), `.<name>.old-<pid>@<host>`
(the old version during the swap) and `.<name>.deleted-<pid>@<host>-<random>` (a directory being
removed, `floe.backend.state.delete_state_dir`). Such a sibling is left over by a crash only
when its writer is dead: `recover` and `remove_dead_leftovers` act only on siblings whose
writer is this process or a process of this host that no longer exists, so a concurrent
writer's temporary directory (another process saving the same name) is never touched, and
those of killed writers do not stay forever. Siblings of another host (a shared filesystem)
are left to that host. Names without an owner (temp directories of an older floe) are
left alone; `.old-<pid>` and `.deleted-<pid>-<random>` ones, which have always carried the pid,
count as this host's.

`replace=False` (the default for directories) refuses to replace an existing `final`: callers
that own what they replace (a state of the same name, an earlier floe export) pass
`replace=True` after checking that it is theirs.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "atomic_directory", "atomic_write_bytes", "atomic_write_text", "owner_tag", "recover", "recover_all",
    "remove_dead_leftovers",
]

# ".<name>.<kind>-<pid>[@<host>][-<random>]"; the host is letters and digits only (owner_tag).
_SIBLING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|deleted)-(?P<pid>\d+)(?:@(?P<host>[A-Za-z0-9]+))?(?:-[0-9a-f]+)?$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


def owner_tag() -> str:
    """`<pid>@<host>`: who writes a sibling, in its name (module docstring)."""
    return f"{os.getpid()}@{_host()}"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    except OSError:
        return True
    return True


def _leftover(entry: Path) -> tuple[str, str, bool] | None:
    """(final name, kind, whether its writer is gone or is this process) for a sibling a write
    made, else None (not such a name, or a writer this host cannot judge)."""
    match = _SIBLING.match(entry.name)
    if match is None:
        return None
    host, pid = match["host"], int(match["pid"])
    if host is None and match["kind"] == "tmp":
        return None  # an older floe's temp name (mkdtemp's, no owner): nobody can tell whose it is
    if host is not None and host != _host():
        return None  # another host's writer (a shared filesystem): that host judges it
    ours_or_dead = pid == os.getpid() or not _pid_alive(pid)
    return match["name"], match["kind"], ours_or_dead


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
    moved aside by a writer that is gone (a crash between the two renames), move that version
    back. Then remove the siblings of `final` that dead writers left (`remove_dead_leftovers`)."""
    final = Path(final)
    if not final.exists():
        for old in sorted(final.parent.glob(f".{final.name}.old-*")):
            found = _leftover(old)
            if found is not None and found[0] == final.name and found[2] and old.is_dir() and any(old.iterdir()):
                os.replace(old, final)
                break
    remove_dead_leftovers(final.parent, final.name)


def remove_dead_leftovers(parent: Path, name: str | None = None) -> list[str]:
    """Remove the temporary, deleted and (once their directory is back) old siblings under
    `parent` (of `name` only, when given) whose writer is dead (module docstring); returns the
    names removed. Never touches a live writer's, another host's, or this process's own temp
    directories."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    removed = []
    for entry in parent.iterdir():
        found = _leftover(entry)
        if found is None or (name is not None and found[0] != name):
            continue
        final, kind, ours_or_dead = found
        pid = int(_SIBLING.match(entry.name)["pid"])  # type: ignore[index]
        if not ours_or_dead or (kind != "old" and pid == os.getpid()):
            continue  # a live writer's; or this process's own write, which is still under way
        if kind == "old" and not (parent / final).exists():
            continue  # the only copy of that directory: `recover` brings it back
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry.name)
    return removed


def recover_all(parent: Path) -> None:
    """`recover` every entry of `parent` whose swap a crash interrupted, then remove what dead
    writers left there."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    for old in parent.glob(".*.old-*"):
        found = _leftover(old)
        if found is not None:
            recover(parent / found[0])
    remove_dead_leftovers(parent)


@contextmanager
def atomic_directory(final: str | Path, *, replace: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to `final`; on success swap it into place.

    Raises FileExistsError (before yielding) when `final` exists and `replace` is False.
    Leftovers of dead writers of the same `final` are removed first; a live writer's temporary
    directory is left alone (module docstring).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    recover(final)
    if final.exists() and not replace:
        raise FileExistsError(f"{final} already exists")
    tag = owner_tag()
    tmp = final.parent / f".{final.name}.tmp-{tag}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    tmp.chmod(0o755)  # readable by others, like a checkpoint directory made with mkdir
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{tag}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None and not final.exists():
            os.replace(old, final)  # put the old version back; the new one is dropped
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
