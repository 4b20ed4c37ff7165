"""The Tinker service's registry on disk: sessions, training runs, samplers and checkpoints, each
with its owner, in one SQLite database (`<state_dir>/.tinker/tinker.sqlite3`). It survives the
clients that made the rows and server restarts; the files of a checkpoint live next to it
(`Layout`).

Access goes through one place: every lookup takes the asking `Principal` and answers only what
it may see (`Principal.may_see`: its own rows, and checkpoints their owner published) or change
(`may_change`: its own); anything else is `NotFound`, the same answer as for an id that does not
exist, so a tenant cannot learn another's ids. Counts per owner are bounded here
(`Limits`), before anything is created, and nothing stays for good unless it is in use: a
finished session keeps only its id (its metadata is cleared at once) and goes after a grace
period (`forget_finished_sessions`); a run that is closed or lost goes once it has no
checkpoint and no open session (`forget_unused_runs`). So the registry of a key is bounded by
its limits, not by how long it has been used.

Times are Unix seconds (float). JSON columns hold dicts / lists.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from floe.errors import InvalidInput, NotFound, StateError
from floe.names import check_name, path_under
from floe.server.principals import Principal

__all__ = ["CHECKPOINT_KINDS", "Checkpoint", "Layout", "Limits", "NotFound", "RunRow", "SamplerRow", "SessionRow",
           "Store", "parse_tinker_path"]

# The path segment of each checkpoint kind, as in tinker://<run>/<segment>/<name>.
CHECKPOINT_KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
# The run statuses that hold a place under Limits.runs (SQL tuple): a run that may still train.
OPEN_RUN_STATUSES = "('creating', 'live', 'offloaded')"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
  id TEXT PRIMARY KEY, owner TEXT NOT NULL, tags TEXT NOT NULL, user_metadata TEXT NOT NULL,
  display_name TEXT, project_id TEXT, sdk_version TEXT, created REAL NOT NULL, last_seen REAL NOT NULL,
  finished INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS sessions_owner ON sessions(owner, created);
CREATE TABLE IF NOT EXISTS runs (
  id TEXT PRIMARY KEY, owner TEXT NOT NULL, session_id TEXT NOT NULL, base_model TEXT NOT NULL, base TEXT NOT NULL,
  lora TEXT, user_metadata TEXT NOT NULL, created REAL NOT NULL, last_request REAL NOT NULL,
  status TEXT NOT NULL, next_seq INTEGER NOT NULL DEFAULT 1, version INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS runs_owner ON runs(owner, created);
CREATE TABLE IF NOT EXISTS samplers (
  id TEXT PRIMARY KEY, owner TEXT NOT NULL, session_id TEXT NOT NULL, base_model TEXT NOT NULL, base TEXT NOT NULL,
  run_id TEXT, model_path TEXT, version INTEGER NOT NULL, kind TEXT NOT NULL, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS samplers_session ON samplers(session_id);
CREATE TABLE IF NOT EXISTS checkpoints (
  run_id TEXT NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL, owner TEXT NOT NULL, base_model TEXT NOT NULL,
  base TEXT NOT NULL, created REAL NOT NULL, size_bytes INTEGER, expires REAL, public INTEGER NOT NULL DEFAULT 0,
  user_metadata TEXT NOT NULL, info TEXT NOT NULL, PRIMARY KEY (run_id, kind, name));
CREATE INDEX IF NOT EXISTS checkpoints_owner ON checkpoints(owner, created);
"""


@dataclass(frozen=True)
class Limits:
    """Counts per owner, checked before a row is created (`[server] tinker_max_*`)."""

    sessions: int = 64  # open (not finished) sessions
    runs: int = 1000  # open training runs (creating, live or offloaded): closing a session frees its runs
    checkpoints: int = 5000
    samplers_per_session: int = 4096


@dataclass(frozen=True)
class SessionRow:
    id: str
    owner: str
    tags: list[str]
    user_metadata: dict[str, Any]
    display_name: str | None
    project_id: str | None
    created: float
    last_seen: float
    finished: bool


@dataclass(frozen=True)
class RunRow:
    """A training run. `base_model`: the base model's name as the run asked for it, `base`: the
    server's key of that model. `lora`: its LoRA spec as JSON (None: a full fine-tune); `status`:
    "live" (in memory), "offloaded" (its exact state under Layout.live), "closed" (its session
    finished) or "lost" (the server stopped without offloading it)."""

    id: str
    owner: str
    session_id: str
    base_model: str
    base: str
    lora: dict[str, Any] | None
    user_metadata: dict[str, Any]
    created: float
    last_request: float
    status: str
    next_seq: int
    version: int


@dataclass(frozen=True)
class SamplerRow:
    """A sampler: of a run's weights at `version` (`run_id`; kind "snapshot" or "inflight"), of a
    sampler checkpoint (`model_path`, kind "checkpoint") or of the base model (kind "base")."""

    id: str
    owner: str
    session_id: str
    base_model: str
    base: str
    run_id: str | None
    model_path: str | None
    version: int
    kind: str
    created: float


@dataclass(frozen=True)
class Checkpoint:
    run_id: str
    kind: str  # a key of CHECKPOINT_KINDS
    name: str
    owner: str
    base_model: str
    base: str
    created: float
    size_bytes: int | None
    expires: float | None
    public: bool
    user_metadata: dict[str, str]
    info: dict[str, Any]  # what loading it needs to know: lora spec, version

    @property
    def path(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"


def parse_tinker_path(path: Any, field: str, kinds: tuple[str, ...] = tuple(CHECKPOINT_KINDS)) -> tuple[str, str, str]:
    """(run id, kind, name) of `tinker://<run>/<kind>/<name>`, every part checked by
    floe.names.check_name; InvalidInput(field) otherwise."""
    shape = " or ".join(f"tinker://<run>/{k}/<name>" for k in kinds)
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise InvalidInput(field, f"must be a {shape} path")
    parts = path.removeprefix("tinker://").split("/")
    if len(parts) != 3 or parts[1] not in kinds:
        raise InvalidInput(field, f"must be a {shape} path, got {path[:200]!r}")
    run_id, kind, name = parts
    return check_name(run_id, field), kind, check_name(name, field)


class Layout:
    """Where the Tinker service's files live, under one root that no native state name reaches
    (`<state_dir>/.tinker`): every path from a client id goes through floe.names.path_under."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.runs = self.root / "runs"

    def checkpoint(self, run_id: str, kind: str, name: str, field: str = "path") -> Path:
        if kind not in CHECKPOINT_KINDS:
            raise InvalidInput(field, f"unknown checkpoint kind {kind!r}")
        return path_under(self.runs, run_id, kind, name, field=field)

    def live(self, run_id: str) -> Path:
        """A run's exact state while it is out of memory (offloaded)."""
        return path_under(self.runs, run_id, "live", field="model_id")

    def snapshot(self, run_id: str, sampler_id: str) -> Path:
        """A sampler snapshot's weights while they are out of memory."""
        return path_under(self.runs, run_id, "snapshots", sampler_id, field="sampler_id")

    def run_dir(self, run_id: str) -> Path:
        return path_under(self.runs, run_id, field="model_id")


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


class Store:
    """The registry (see the module docstring). Thread-safe: one connection, one lock."""

    def __init__(self, path: Path, limits: Limits | None = None):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.limits = limits or Limits()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.RLock()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _one(self, sql: str, *args: Any) -> tuple[Any, ...] | None:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def _all(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- sessions -------------------------------------------------------------------------------

    def add_session(self, row: SessionRow) -> None:
        with self._tx() as db:
            (open_count,) = db.execute("SELECT COUNT(*) FROM sessions WHERE owner = ? AND finished = 0",
                                       (row.owner,)).fetchone()
            if open_count >= self.limits.sessions:
                raise StateError(f"this key has {open_count} open sessions, the server's limit ([server] "
                                 "tinker_max_sessions); close() finished ServiceClients, or wait for idle ones to expire")
            db.execute("INSERT INTO sessions VALUES (?,?,?,?,?,?,?,?,?,?)", (
                row.id, row.owner, json.dumps(row.tags), json.dumps(row.user_metadata), row.display_name,
                row.project_id, None, row.created, row.last_seen, int(row.finished)))

    @staticmethod
    def _session(r: tuple[Any, ...]) -> SessionRow:
        return SessionRow(r[0], r[1], json.loads(r[2]), json.loads(r[3]), r[4], r[5], r[7], r[8], bool(r[9]))

    def session(self, session_id: Any, who: Principal, field: str = "session_id") -> SessionRow:
        """The session, if `who` owns it; NotFound otherwise."""
        r = self._one("SELECT * FROM sessions WHERE id = ?", session_id) if isinstance(session_id, str) else None
        if r is None or not who.may_change(r[1]):
            raise NotFound(field, f"no session {str(session_id)[:80]!r} for this key")
        return self._session(r)

    def session_any(self, session_id: str) -> SessionRow | None:
        """A session whatever its owner (the service's own bookkeeping, never a client's answer)."""
        r = self._one("SELECT * FROM sessions WHERE id = ?", session_id)
        return None if r is None else self._session(r)

    def sessions(self, who: Principal, offset: int = 0, limit: int = 100) -> tuple[list[SessionRow], int]:
        rows = self._all("SELECT * FROM sessions WHERE owner = ? ORDER BY created DESC LIMIT ? OFFSET ?",
                         who.id, limit, offset)
        (total,) = self._one("SELECT COUNT(*) FROM sessions WHERE owner = ?", who.id) or (0,)
        return [self._session(r) for r in rows], int(total)

    def touch_session(self, session_id: str, now: float) -> None:
        with self._tx() as db:
            db.execute("UPDATE sessions SET last_seen = ? WHERE id = ?", (now, session_id))

    def finish_session(self, session_id: str, now: float) -> None:
        """Mark the session finished at `now` and drop what a client put in it (tags, metadata,
        names): only its id stays, for the grace period of `forget_finished_sessions`, so that
        the SDK's heartbeat hears 410 (finished) and stops, and a late request gets the clear
        "has finished" refusal instead of "no session"."""
        with self._tx() as db:
            db.execute("UPDATE sessions SET finished = 1, tags = '[]', user_metadata = '{}', display_name = NULL, "
                       "project_id = NULL, last_seen = ? WHERE id = ?", (now, session_id))

    def forget_finished_sessions(self, before: float) -> int:
        """Delete the sessions that finished before `before`; their runs keep listing (a run row
        stands on its own). The number deleted."""
        with self._tx() as db:
            return db.execute("DELETE FROM sessions WHERE finished = 1 AND last_seen < ?", (before,)).rowcount

    def idle_sessions(self, before: float) -> list[str]:
        """Open sessions whose last heartbeat or request is older than `before`."""
        return [r[0] for r in self._all("SELECT id FROM sessions WHERE finished = 0 AND last_seen < ?", before)]

    # -- runs -----------------------------------------------------------------------------------

    def add_run(self, row: RunRow) -> None:
        with self._tx() as db:
            if db.execute("SELECT 1 FROM runs WHERE id = ?", (row.id,)).fetchone() is not None:
                raise InvalidInput("model_id", f"a training run {row.id!r} exists already")
            (count,) = db.execute(f"SELECT COUNT(*) FROM runs WHERE owner = ? AND status IN {OPEN_RUN_STATUSES}",
                                  (row.owner,)).fetchone()
            if count >= self.limits.runs:
                raise StateError(f"this key has {count} open training runs, the server's limit ([server] "
                                 "tinker_max_runs); close() ServiceClients you no longer train with (their runs "
                                 "close, their checkpoints stay), or wait for idle sessions to expire")
            db.execute("INSERT INTO runs VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", (
                row.id, row.owner, row.session_id, row.base_model, row.base, None if row.lora is None else json.dumps(row.lora),
                json.dumps(row.user_metadata), row.created, row.last_request, row.status, row.next_seq, row.version))

    @staticmethod
    def _run(r: tuple[Any, ...]) -> RunRow:
        return RunRow(r[0], r[1], r[2], r[3], r[4], _loads(r[5]), json.loads(r[6]), r[7], r[8], r[9], r[10], r[11])

    def run(self, run_id: Any, who: Principal, field: str = "model_id") -> RunRow:
        """The run, if `who` owns it; NotFound otherwise."""
        r = self._one("SELECT * FROM runs WHERE id = ?", run_id) if isinstance(run_id, str) else None
        if r is None or not who.may_change(r[1]):
            raise NotFound(field, f"no training run {str(run_id)[:80]!r} for this key")
        return self._run(r)

    def run_any(self, run_id: str) -> RunRow | None:
        """A run whatever its owner (the service's own bookkeeping, never a client's answer)."""
        r = self._one("SELECT * FROM runs WHERE id = ?", run_id)
        return None if r is None else self._run(r)

    def runs(self, who: Principal, offset: int = 0, limit: int = 100) -> tuple[list[RunRow], int]:
        rows = self._all("SELECT * FROM runs WHERE owner = ? ORDER BY created DESC LIMIT ? OFFSET ?", who.id, limit, offset)
        (total,) = self._one("SELECT COUNT(*) FROM runs WHERE owner = ?", who.id) or (0,)
        return [self._run(r) for r in rows], int(total)

    def session_runs(self, session_id: str) -> list[RunRow]:
        return [self._run(r) for r in self._all("SELECT * FROM runs WHERE session_id = ? ORDER BY created", session_id)]

    def runs_with_status(self, status: str) -> list[RunRow]:
        return [self._run(r) for r in self._all("SELECT * FROM runs WHERE status = ?", status)]

    def update_run(self, run_id: str, **values: Any) -> None:
        """Set columns of a run: status, next_seq, version, last_request, lora, user_metadata."""
        allowed = {"status", "next_seq", "version", "last_request", "lora", "user_metadata"}
        if not values or set(values) - allowed:
            raise ValueError(f"update_run: columns {sorted(values)} not in {sorted(allowed)}")
        encoded = {k: (json.dumps(v) if k in ("lora", "user_metadata") and v is not None else v) for k, v in values.items()}
        sets = ", ".join(f"{k} = ?" for k in encoded)
        with self._tx() as db:
            db.execute(f"UPDATE runs SET {sets} WHERE id = ?", (*encoded.values(), run_id))

    def forget_unused_runs(self) -> list[str]:
        """Delete the runs that can never be used again and hold nothing: closed or lost, with no
        checkpoint, and no open session (a lost run's open session still hears why its run is
        gone). The ids deleted (the caller removes their directories)."""
        unused = (f"status NOT IN {OPEN_RUN_STATUSES} AND NOT EXISTS (SELECT 1 FROM checkpoints c WHERE "
                  "c.run_id = runs.id) AND NOT EXISTS (SELECT 1 FROM sessions s WHERE s.id = runs.session_id AND "
                  "s.finished = 0)")
        with self._tx() as db:
            ids = [r[0] for r in db.execute(f"SELECT id FROM runs WHERE {unused}").fetchall()]
            db.execute(f"DELETE FROM runs WHERE {unused}")
        return ids

    def remove_run(self, run_id: str) -> None:
        """Forget a run that never started (its create failed)."""
        with self._tx() as db:
            db.execute("DELETE FROM runs WHERE id = ?", (run_id,))

    # -- samplers -------------------------------------------------------------------------------

    def add_sampler(self, row: SamplerRow) -> None:
        with self._tx() as db:
            (count,) = db.execute("SELECT COUNT(*) FROM samplers WHERE session_id = ?", (row.session_id,)).fetchone()
            if count >= self.limits.samplers_per_session and db.execute(
                    "SELECT 1 FROM samplers WHERE id = ?", (row.id,)).fetchone() is None:
                raise StateError(f"this session has {count} samplers, the server's limit per session ([server] "
                                 "tinker_max_samplers_per_session); start a new ServiceClient")
            db.execute("INSERT OR REPLACE INTO samplers VALUES (?,?,?,?,?,?,?,?,?,?)", (
                row.id, row.owner, row.session_id, row.base_model, row.base, row.run_id, row.model_path, row.version, row.kind,
                row.created))

    def sampler(self, sampler_id: Any, who: Principal, field: str = "sampling_session_id") -> SamplerRow:
        r = self._one("SELECT * FROM samplers WHERE id = ?", sampler_id) if isinstance(sampler_id, str) else None
        if r is None or not who.may_change(r[1]):
            raise NotFound(field, f"no sampler {str(sampler_id)[:80]!r} for this key")
        return SamplerRow(*r)

    def session_samplers(self, session_id: str) -> list[SamplerRow]:
        return [SamplerRow(*r) for r in self._all("SELECT * FROM samplers WHERE session_id = ? ORDER BY created", session_id)]

    def inflight_samplers(self, run_id: str) -> list[SamplerRow]:
        return [SamplerRow(*r) for r in self._all("SELECT * FROM samplers WHERE run_id = ? AND kind = 'inflight'", run_id)]

    def remove_sampler(self, sampler_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM samplers WHERE id = ?", (sampler_id,))

    def remove_samplers(self, session_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM samplers WHERE session_id = ?", (session_id,))

    # -- checkpoints ----------------------------------------------------------------------------

    @staticmethod
    def _checkpoint(r: tuple[Any, ...]) -> Checkpoint:
        return Checkpoint(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], bool(r[9]), json.loads(r[10]),
                          json.loads(r[11]))

    def checkpoint(self, path: Any, who: Principal, field: str = "path", change: bool = False,
                   kinds: tuple[str, ...] = tuple(CHECKPOINT_KINDS)) -> Checkpoint:
        """The checkpoint at a tinker:// path, if `who` may see it (its own, or published; `change`:
        its own only) and it has not expired; NotFound otherwise."""
        run_id, kind, name = parse_tinker_path(path, field, kinds)
        r = self._one("SELECT * FROM checkpoints WHERE run_id = ? AND kind = ? AND name = ?", run_id, kind, name)
        ok = r is not None and (who.may_change(r[3]) if change else who.may_see(r[3], bool(r[9])))
        if not ok or (r[8] is not None and r[8] <= time.time()):  # type: ignore[index]
            raise NotFound(field, f"no checkpoint {path!r} for this key")
        return self._checkpoint(r)  # type: ignore[arg-type]

    def find_checkpoint(self, run_id: str, kind: str, name: str) -> Checkpoint | None:
        r = self._one("SELECT * FROM checkpoints WHERE run_id = ? AND kind = ? AND name = ?", run_id, kind, name)
        return None if r is None else self._checkpoint(r)

    def put_checkpoint(self, row: Checkpoint) -> None:
        """Record a checkpoint (replacing one of the same path, which the caller owns)."""
        with self._tx() as db:
            exists = db.execute("SELECT 1 FROM checkpoints WHERE run_id = ? AND kind = ? AND name = ?",
                                (row.run_id, row.kind, row.name)).fetchone() is not None
            if not exists:
                (count,) = db.execute("SELECT COUNT(*) FROM checkpoints WHERE owner = ?", (row.owner,)).fetchone()
                if count >= self.limits.checkpoints:
                    raise StateError(f"this key has {count} checkpoints, the server's limit ([server] "
                                     "tinker_max_checkpoints); delete some (tinker checkpoint delete)")
            db.execute("INSERT OR REPLACE INTO checkpoints VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", (
                row.run_id, row.kind, row.name, row.owner, row.base_model, row.base, row.created, row.size_bytes, row.expires,
                int(row.public), json.dumps(row.user_metadata), json.dumps(row.info)))

    def checkpoints(self, who: Principal, run_id: str | None = None, offset: int = 0,
                    limit: int = 100) -> tuple[list[Checkpoint], int]:
        """`who`'s checkpoints (of one run, or all), newest first, unexpired."""
        now = time.time()
        where = "owner = ? AND (expires IS NULL OR expires > ?)" + (" AND run_id = ?" if run_id is not None else "")
        args: tuple[Any, ...] = (who.id, now) + ((run_id,) if run_id is not None else ())
        rows = self._all(f"SELECT * FROM checkpoints WHERE {where} ORDER BY created DESC LIMIT ? OFFSET ?",
                         *args, limit, offset)
        (total,) = self._one(f"SELECT COUNT(*) FROM checkpoints WHERE {where}", *args) or (0,)
        return [self._checkpoint(r) for r in rows], int(total)

    def update_checkpoint(self, row: Checkpoint, **values: Any) -> None:
        """Set `public` or `expires` of a checkpoint."""
        if not values or set(values) - {"public", "expires"}:
            raise ValueError(f"update_checkpoint: {sorted(values)}")
        sets = ", ".join(f"{k} = ?" for k in values)
        with self._tx() as db:
            db.execute(f"UPDATE checkpoints SET {sets} WHERE run_id = ? AND kind = ? AND name = ?",
                       (*[int(v) if isinstance(v, bool) else v for v in values.values()], row.run_id, row.kind, row.name))

    def remove_checkpoint(self, row: Checkpoint) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM checkpoints WHERE run_id = ? AND kind = ? AND name = ?", (row.run_id, row.kind, row.name))

    def expired_checkpoints(self, now: float) -> list[Checkpoint]:
        return [self._checkpoint(r) for r in self._all("SELECT * FROM checkpoints WHERE expires IS NOT NULL AND expires <= ?",
                                                       now)]
