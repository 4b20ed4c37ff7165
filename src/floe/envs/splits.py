"""Deterministic, disjoint train/eval task selection.

A task belongs to "train" or "eval" by a stable hash of its content key, independent of the seed.
Generators draw candidates from a seeded RNG and keep only those whose key hashes into the
requested split, so eval never contains a train task for any pair of seeds, and the same seed
always yields the same list. File-backed data uses the same rule (or explicit split files).
`family_tasks` is the one way a family answers ``tasks``: generated, or read from the file its
``data_path`` / ``eval_data_path`` options name.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from floe.envs.base import SPLITS, Task
from floe.envs.datafile import read_rows

Draw = Callable[[random.Random], tuple[str, dict]]  # rng -> (content key, task data)

# One bucket in EVAL_BUCKETS goes to eval (20%): small generated spaces (e.g. one-digit
# additions) still leave enough distinct eval problems.
EVAL_BUCKETS = 5


@dataclass(frozen=True)
class DataFile:
    """The file a split reads: its path, the option that named it, and whether that file
    holds only this split (an `eval_data_path`) or must be hash-split."""

    path: str
    option: str
    presplit: bool


def data_file(data_path: str | None, eval_data_path: str | None, split: str) -> DataFile | None:
    """Where `split` comes from: a user's file, or None when floe generates the data."""
    if data_path is None:
        return None
    if split == "eval" and eval_data_path is not None:
        return DataFile(eval_data_path, "eval_data_path", True)
    return DataFile(data_path, "data_path", False)


def check_request(split: str, count: int, seed: int) -> None:
    """Raise ValueError naming the field when a ``tasks`` request is malformed."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"count must be a non-negative int; got {count!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int; got {seed!r}")  # noqa: TRY004 - one error type for every bad argument here


def split_of(key: str) -> str:
    """The split a task with content ``key`` belongs to."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % EVAL_BUCKETS == 0 else "train"


def rng_for(family: str, split: str, seed: int) -> random.Random:
    # String seeds are hashed with SHA-512 by `random`, so this is stable across processes.
    return random.Random(f"floe.envs/{family}/{split}/{seed}")


def generate_tasks(
    family: str,
    split: str,
    count: int,
    seed: int,
    draw: Draw,
) -> list[Task]:
    """``count`` tasks of ``split`` from ``draw(rng) -> (content key, task data)``."""
    check_request(split, count, seed)
    rng = rng_for(family, split, seed)
    tasks: list[Task] = []
    # A generous bound, so a difficulty setting with no problems in this split fails loudly
    # instead of looping forever.
    budget = 100 * count + 1000
    while len(tasks) < count:
        if budget == 0:
            raise ValueError(
                f"{family}: could not generate {count} {split} tasks; the configured difficulty "
                "allows too few distinct problems (widen the length/number options)"
            )
        budget -= 1
        key, data = draw(rng)
        if split_of(key) == split:
            tasks.append(Task(id=f"{family}/{split}/{seed}/{len(tasks)}", data=data))
    return tasks


def select_rows(
    family: str,
    split: str,
    count: int,
    seed: int,
    rows: Sequence[dict],
    key: Callable[[dict], str],
    presplit: bool,
) -> list[Task]:
    """``count`` tasks of ``split`` chosen from file rows.

    ``presplit`` means ``rows`` already are exactly this split (a separate eval file); otherwise
    rows are assigned to splits by ``split_of(key(row))``. The choice is a seeded shuffle.
    """
    check_request(split, count, seed)
    pool = [r for r in rows if presplit or split_of(key(r)) == split]
    if count > len(pool):
        raise ValueError(f"{family}: count={count} but the data file has only {len(pool)} {split} rows")
    rng_for(family, split, seed).shuffle(pool)
    return [Task(id=f"{family}/{split}/{seed}/{i}", data=row) for i, row in enumerate(pool[:count])]


def family_tasks(
    family: str,
    split: str,
    count: int,
    seed: int,
    *,
    data_path: str | None,
    eval_data_path: str | None,
    generator: Callable[[], Draw],
    columns: tuple[str, ...],
    rows: Callable[[list[dict], str], list[dict]],
    key: Callable[[dict], str],
) -> list[Task]:
    """``count`` tasks of ``split`` for ``family``: generated when ``data_path`` is None, else
    read from the file (``eval_data_path`` for eval when given).

    ``generator()`` returns the draw function (called only when generating, so a family can
    prepare generated data lazily); ``columns`` are the columns every file row must have;
    ``rows(file_rows, option)`` turns the file's rows into task data (``option`` names the
    option that gave the file, for errors); ``key(data)`` is a task's content key (its split).
    """
    source = data_file(data_path, eval_data_path, split)
    if source is None:
        return generate_tasks(family, split, count, seed, generator())
    data = rows(read_rows(source.path, columns, source.option), source.option)
    return select_rows(family, split, count, seed, data, key=key, presplit=source.presplit)
