"""The text2sql env: BIRD-style text-to-SQL over SQLite databases, scored by execution.

Prompt: the database's CREATE statements (from sqlite_master), the question, and a request to
reason inside ``<think>...</think>`` and then answer with a ```` ```sql ```` block inside
``<answer>...</answer>``.

Reward (as the reference environment, minus its LIMIT-appending heuristic):
  * SQL is extracted as described in ``sql_extract`` (after the first ``</think>``);
  * the format is correct when SQL was extracted and there is exactly one ``<think>`` ...
    ``</think>`` pair, in order;
  * score = 1.0 when ``frozenset(predicted rows)`` equals ``frozenset(gold rows)`` for any gold
    alternative, 0.1 when the query runs but differs, 0.0 on error, timeout, more than
    ``row_cap`` rows, or no SQL;
  * if the format is correct, score = max(score, 0.1).

Model SQL runs in ``sql_sandbox`` (read-only URI, authorizer, single statement, deadline,
row cap, separate killable worker process). Gold results are computed once per (database,
gold SQL) through the same sandbox and cached on the family; a gold query that fails or exceeds
``row_cap`` is a data error and raises.

Data: generated databases (``sql_databases``) with template questions (``sql_questions``), or
BIRD rows (``db_id``, ``question``, ``SQL``, optional ``evidence``) with databases under
``db_root/<db_id>/<db_id>.sqlite``.
"""

from __future__ import annotations

import random
import threading
import weakref
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from floe.envs.base import Env, EnvFamily, Task
from floe.envs.options import DataFileOptions, parse_options
from floe.envs.single_turn import Score, SingleTurnEnv, prompt_messages
from floe.envs.splits import Draw, family_tasks
from floe.envs.sql_databases import SCHEMAS, db_id, ensure_database, read_schema_ddl, schema_rows
from floe.envs.sql_extract import extract_sql, format_ok
from floe.envs.sql_questions import TEMPLATES
from floe.envs.sql_sandbox import SqlRunner
from floe.paths import cache_root

NAME = "text2sql"
INSTRUCTION = (
    "Answer the question with one SQLite query. Think inside <think></think>, then give the "
    "query in a ```sql block inside <answer></answer>."
)
FORMAT_FLOOR = 0.1  # the score of a query that runs but is wrong, and of a well-formatted reply
DB_SUBDIR = "text2sql"  # generated databases live in <$FLOE_CACHE>/text2sql unless db_dir says otherwise


class Text2SqlOptions(DataFileOptions):
    """Options of the text2sql family (data files: BIRD .json/.jsonl rows, with db_root)."""

    db_dir: str | None = None  # where generated databases live; None = $FLOE_CACHE/text2sql (~/.cache/floe/text2sql)
    db_seed: int = 0  # which generated database instances (shared by train and eval)
    schemas: tuple[str, ...] = tuple(SCHEMAS)  # generated schemas to draw questions from
    db_root: str | None = None  # BIRD databases: db_root/<db_id>/<db_id>.sqlite (needs data_path)
    timeout_s: float = Field(5.0, gt=0)  # wall-clock limit per model query
    gold_timeout_s: float = Field(30.0, gt=0)
    row_cap: int = Field(1000, ge=1)  # more rows than this scores 0 (gold must stay within it)
    workers: int = Field(2, ge=1)  # sandbox worker processes (queries run in parallel up to this)
    start_method: Literal["fork", "forkserver", "spawn"] | None = None  # None: fork where available
    system_prompt: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> Text2SqlOptions:
        unknown = [s for s in self.schemas if s not in SCHEMAS]
        if unknown or not self.schemas:
            raise ValueError(f"schemas: unknown {unknown}; valid: {', '.join(SCHEMAS)} (at least one)")
        if self.data_path is not None and self.db_root is None:
            raise ValueError("db_root is required with data_path (BIRD databases live there)")
        if self.db_root is not None and self.data_path is None:
            raise ValueError("db_root is only used with data_path")
        return self


def user_prompt(schema_ddl: str, question: str) -> str:
    return f"Database schema:\n{schema_ddl}\n\nQuestion: {question}"


class Text2SqlFamily(EnvFamily):
    """Text-to-SQL by execution match; see the module docstring for the reward."""

    name = NAME
    options_model = Text2SqlOptions

    def __init__(self, **options: object) -> None:
        self.options = parse_options(Text2SqlOptions, NAME, options)
        self.db_dir = Path(self.options.db_dir).expanduser() if self.options.db_dir else cache_root() / DB_SUBDIR
        self.runner = SqlRunner(self.options.workers, self.options.start_method)  # starts no process until first use
        self._gold_cache: dict[tuple[str, str], frozenset] = {}
        self._gold_lock = threading.Lock()
        weakref.finalize(self, self.runner.close)

    def close(self) -> None:
        """Stop the sandbox worker processes (they restart on the next query)."""
        self.runner.close()

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        return family_tasks(
            NAME, split, count, seed, data_path=self.options.data_path, eval_data_path=self.options.eval_data_path,
            generator=self._generator, columns=("db_id", "question", "SQL"), rows=self._bird_rows,
            key=lambda r: f"{r['db_id']}|{r['question']}",
        )

    def _generator(self) -> Draw:
        """The draw function over the generated databases (built here when missing)."""
        opts = self.options
        databases = {s: ensure_database(s, opts.db_seed, self.db_dir) for s in opts.schemas}
        facts = {s: schema_rows(s, opts.db_seed) for s in opts.schemas}
        ddl = {s: read_schema_ddl(path) for s, path in databases.items()}

        def draw(rng: random.Random) -> tuple[str, dict]:
            schema = rng.choice(opts.schemas)
            question, gold = rng.choice(TEMPLATES[schema])(rng, facts[schema])
            data = {
                "db_id": db_id(schema, opts.db_seed),
                "db_path": str(databases[schema]),
                "schema": ddl[schema],
                "question": question,
                "gold_sql": [gold],
            }
            return f"{data['db_id']}|{question}", data

        return draw

    def make_env(self, task: Task) -> Env:
        data = task.data
        if not Path(data["db_path"]).is_file():
            raise ValueError(f"task {task.id}: database file not found: {data['db_path']}")
        messages = prompt_messages(INSTRUCTION, user_prompt(data["schema"], data["question"]), self.options.system_prompt)
        return SingleTurnEnv(messages, lambda completion: self.score(completion, data))

    def score(self, completion: str, data: dict) -> Score:
        """Score one completion for a task's data (see the module docstring)."""
        sql = extract_sql(completion)
        well_formed = format_ok(completion, sql)
        executed = correct = 0.0
        reward = 0.0
        if sql is not None:
            result = self.runner.run(data["db_path"], sql, self.options.timeout_s, self.options.row_cap)
            if result.ok:
                executed = 1.0
                predicted = frozenset(result.rows)
                correct = float(any(predicted == self.gold_rows(data["db_path"], g) for g in data["gold_sql"]))
                reward = 1.0 if correct else FORMAT_FLOOR
        if well_formed:
            reward = max(reward, FORMAT_FLOOR)
        return Score(
            reward=reward,
            metrics={
                "sql_found": float(sql is not None),
                "format_ok": float(well_formed),
                "executed": executed,
                "correct": correct,
            },
        )

    def gold_rows(self, db_path: str, gold_sql: str) -> frozenset:
        """The gold query's rows as a set, computed once per (database, SQL)."""
        key = (db_path, gold_sql)
        with self._gold_lock:
            if key in self._gold_cache:
                return self._gold_cache[key]
        result = self.runner.run(db_path, gold_sql, self.options.gold_timeout_s, self.options.row_cap)
        if not result.ok:
            raise ValueError(
                f"gold SQL failed on {db_path} ({result.status}: {result.message}); "
                f"check the data or raise row_cap/gold_timeout_s: {gold_sql}"
            )
        rows = frozenset(result.rows)
        with self._gold_lock:
            self._gold_cache[key] = rows
        return rows

    def _bird_rows(self, raw: list[dict], option: str) -> list[dict]:
        root = Path(self.options.db_root).expanduser()
        ddl: dict[str, str] = {}
        rows = []
        for i, row in enumerate(raw):
            name = str(row["db_id"])
            path = root / name / f"{name}.sqlite"
            if name not in ddl:
                if not path.is_file():
                    raise ValueError(f"{option}: row {i} db_id {name!r}: no database at {path} (db_root)")
                ddl[name] = read_schema_ddl(path)
            evidence = str(row.get("evidence") or "").strip()
            question = str(row["question"]) + (f"\nHint: {evidence}" if evidence else "")
            gold = row["SQL"] if isinstance(row["SQL"], list) else [row["SQL"]]
            rows.append(
                {"db_id": name, "db_path": str(path), "schema": ddl[name], "question": question, "gold_sql": gold}
            )
        return rows
