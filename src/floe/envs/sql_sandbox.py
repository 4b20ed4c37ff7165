"""Running untrusted (model-written) SQL against a SQLite file without letting it do harm.

Layers, each enough on its own for some attacks and together for all we know of:

1. the database is opened ``file:PATH?mode=ro`` (URI), so SQLite refuses any write;
2. an authorizer allows only SQLITE_SELECT / READ / FUNCTION / RECURSIVE (what a plain SELECT,
   including recursive CTEs, needs), so INSERT/UPDATE/DELETE/DROP/CREATE/ATTACH/DETACH/PRAGMA
   and ``load_extension`` are denied at prepare time; ATTACH is also limited to 0 databases;
3. Python's ``execute`` accepts a single statement only;
4. a progress handler aborts the statement once its wall-clock deadline passes;
5. at most ``row_cap + 1`` rows are fetched; more than ``row_cap`` is reported, not returned;
6. it all runs in a worker process of a ``ProcessPoolExecutor`` owned by a ``SqlRunner``: if the
   worker does not answer within the deadline plus a grace period (a query stuck where the
   progress handler cannot fire), the pool's processes are killed and the pool is recreated.

Only plain strings, numbers and tuples of SQLite values cross the process boundary.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import sqlite3
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from urllib.parse import quote

BACKSTOP_GRACE_S = 2.0  # how long past its own deadline a worker may take before it is killed
_PROGRESS_EVERY = 1000  # SQLite VM instructions between deadline checks
_MAX_VALUE_BYTES = 1_000_000  # SQLITE_LIMIT_LENGTH: no giant strings/blobs (e.g. zeroblob(1e9))
_HEAP_LIMIT_BYTES = 256 * 1024 * 1024  # per worker process; sorts and temp tables stay in memory

_ALLOWED_ACTIONS = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)
_DENIED_FUNCTIONS = frozenset({"load_extension"})

# Statuses of a QueryResult.
OK, ERROR, TIMEOUT, TOO_MANY_ROWS, KILLED = "ok", "error", "timeout", "too_many_rows", "killed"


@dataclass(frozen=True)
class QueryResult:
    """The outcome of one sandboxed query; ``rows`` is empty unless ``status == "ok"``."""

    status: str
    rows: tuple[tuple, ...]
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK


def _authorize(action: int, arg1: str | None, arg2: str | None, db_name: str | None, source: str | None) -> int:
    if action not in _ALLOWED_ACTIONS:
        return sqlite3.SQLITE_DENY
    # For SQLITE_FUNCTION, arg2 is the function name.
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def run_readonly(db_path: str, sql: str, timeout_s: float, row_cap: int) -> tuple[str, list[tuple], str]:
    """Run ``sql`` on ``db_path`` with every in-process guard; returns (status, rows, message).

    Meant for the worker process: it sets SQLite's process-wide heap limit.
    """
    deadline = time.monotonic() + timeout_s
    uri = f"file:{quote(os.path.abspath(db_path))}?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=True)
    except sqlite3.Error as err:
        return ERROR, [], f"cannot open database: {err}"
    try:
        # Our own settings go in before the authorizer, which would deny these PRAGMAs.
        conn.execute("PRAGMA temp_store=MEMORY")  # sorts never spill files, not even to /tmp
        conn.execute(f"PRAGMA hard_heap_limit={_HEAP_LIMIT_BYTES}")
        conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, _MAX_VALUE_BYTES)
        conn.set_authorizer(_authorize)
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), _PROGRESS_EVERY)
        cursor = conn.execute(sql)
        rows = cursor.fetchmany(row_cap + 1)
        if len(rows) > row_cap:
            return TOO_MANY_ROWS, [], f"more than row_cap={row_cap} rows"
        return OK, [tuple(r) for r in rows], ""
    except sqlite3.OperationalError as err:
        if time.monotonic() > deadline:
            return TIMEOUT, [], f"exceeded {timeout_s}s"
        return ERROR, [], str(err)
    except Exception as err:  # noqa: BLE001 - any failure of model-written SQL is a plain error
        return ERROR, [], f"{type(err).__name__}: {err}"
    finally:
        conn.close()


def default_start_method() -> str:
    """"fork" where the OS has it, else "spawn".

    fork starts a worker in milliseconds and never re-imports the caller's ``__main__`` (spawn and
    forkserver do, which breaks scripts without a main guard, stdin scripts and some notebooks).
    The worker only runs SQLite, and a worker that a fork left wedged is caught by the backstop.
    """
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


class SqlRunner:
    """Owns the worker pool that runs sandboxed queries; created lazily, reused, replaced when killed.

    Thread-safe: concurrent ``run`` calls share the pool (``workers`` processes); callers beyond
    ``workers`` wait their turn before their query's clock starts.
    """

    def __init__(self, workers: int = 1, start_method: str | None = None) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1; got {workers}")
        self.workers = workers
        self._context = multiprocessing.get_context(start_method or default_start_method())
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        # At most one query per worker in flight: a query that waited in the pool's queue behind
        # others would otherwise run out its backstop and get a healthy pool killed.
        self._slots = threading.BoundedSemaphore(workers)

    def run(self, db_path: str, sql: str, timeout_s: float, row_cap: int, wait_s: float | None = None) -> QueryResult:
        """Run ``sql`` in a worker; give up (killing the pool) after ``wait_s``.

        ``wait_s`` defaults to ``timeout_s + BACKSTOP_GRACE_S``.
        """
        wait = timeout_s + BACKSTOP_GRACE_S if wait_s is None else wait_s
        with self._slots:
            return self._run(db_path, sql, timeout_s, row_cap, wait)

    def _run(self, db_path: str, sql: str, timeout_s: float, row_cap: int, wait: float) -> QueryResult:
        # One retry: another thread's kill may break the pool under a query that was healthy.
        for attempt in range(2):
            pool = self._get_pool()
            try:
                future = pool.submit(run_readonly, db_path, sql, timeout_s, row_cap)
                status, rows, message = future.result(timeout=wait)
            except concurrent.futures.TimeoutError:
                self._kill(pool)
                return QueryResult(KILLED, (), f"worker did not answer within {wait}s; killed")
            except (BrokenProcessPool, RuntimeError) as err:
                # RuntimeError: submit() raced with a shutdown of this pool.
                self._discard(pool)
                if attempt == 1:
                    return QueryResult(ERROR, (), f"worker failed: {err}")
                continue
            return QueryResult(status, tuple(rows), message)
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Shut the pool down (a later ``run`` starts a new one)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _get_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(self.workers, mp_context=self._context)
            return self._pool

    def _discard(self, pool: concurrent.futures.ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)

    def _kill(self, pool: concurrent.futures.ProcessPoolExecutor) -> None:
        # ProcessPoolExecutor has no public kill before Python 3.14 (kill_workers), so we reach
        # for its process table; shutdown alone would wait for the stuck query forever.
        procs = list((getattr(pool, "_processes", None) or {}).values())
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.join(timeout=5)
        self._discard(pool)
