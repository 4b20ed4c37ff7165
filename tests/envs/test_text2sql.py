"""text2sql: scoring by execution, generated databases, BIRD files, and the SQL sandbox's safety."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest

from floe.envs import make_family
from floe.envs.sql_databases import ensure_database
from floe.envs.sql_sandbox import KILLED, OK

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    db_dir = tmp_path_factory.mktemp("dbs")
    fam = make_family("text2sql", db_dir=str(db_dir), timeout_s=TIMEOUT_S, row_cap=100)
    yield fam
    fam.close()


@pytest.fixture(scope="module")
def company_task(family):
    return next(t for t in family.tasks("train", 50, 0) if t.data["db_id"].startswith("company"))


def _answer(sql: str, think: bool) -> str:
    block = f"<answer>```sql\n{sql}\n```</answer>"
    return f"<think>I will query it.</think>{block}" if think else block


def _snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def test_prompt_has_schema_question_and_format(family, company_task) -> None:
    system, user = family.make_env(company_task).initial_messages()
    assert "<think>" in system["content"] and "```sql" in system["content"] and "<answer>" in system["content"]
    assert "CREATE TABLE employees" in user["content"] and "CREATE TABLE departments" in user["content"]
    assert user["content"].endswith(f"Question: {company_task.data['question']}")


def test_perfect_answer_scores_one_and_garbage_scores_zero(family) -> None:
    for task in family.tasks("eval", 12, 0):
        perfect = family.make_env(task).step(_answer(task.data["gold_sql"][0], think=True))
        assert perfect.reward == 1.0 and perfect.metrics["correct"] == 1.0
        garbage = family.make_env(task).step("I don't know.")
        assert garbage.reward == 0.0 and garbage.metrics["sql_found"] == 0.0


def test_score_levels(family, company_task) -> None:
    def reward(text: str) -> float:
        return family.make_env(company_task).step(text).reward

    gold = company_task.data["gold_sql"][0]
    assert reward(_answer(gold, think=False)) == 1.0  # correct without the format still scores 1
    assert reward(_answer("SELECT 'no'", think=False)) == 0.1  # runs but differs
    assert reward(_answer("SELECT nope FROM nowhere", think=False)) == 0.0  # error
    assert reward(_answer("SELECT nope FROM nowhere", think=True)) == 0.1  # format floor
    assert reward("<think>hmm</think> no query") == 0.0  # format needs SQL
    # Row order does not matter (sets are compared), duplicates neither.
    assert reward(_answer(f"SELECT * FROM ({gold}) UNION ALL SELECT * FROM ({gold})", think=False)) == 1.0


def test_any_gold_alternative_counts(family, company_task) -> None:
    data = dict(company_task.data, gold_sql=["SELECT 'first'", "SELECT 'second'"])
    assert family.score(_answer("SELECT 'second'", think=False), data).reward == 1.0


def test_gold_results_are_cached(family, company_task) -> None:
    path, gold = company_task.data["db_path"], company_task.data["gold_sql"][0]
    assert family.gold_rows(path, gold) is family.gold_rows(path, gold)


def test_gold_over_row_cap_is_a_data_error(family, company_task) -> None:
    with pytest.raises(ValueError, match="row_cap"):
        family.gold_rows(company_task.data["db_path"], "SELECT * FROM employees a, employees b")


ATTACKS = {
    "insert": "INSERT INTO employees (id, name, department_id, salary, hire_year) VALUES (999, 'X', 1, 1, 2000)",
    "update": "UPDATE employees SET salary = 0",
    "update_returning": "UPDATE employees SET salary = 0 RETURNING id",
    "delete": "DELETE FROM employees",
    "drop": "DROP TABLE employees",
    "create": "CREATE TABLE evil (x)",
    "attach": "ATTACH DATABASE '{dir}/evil.sqlite' AS evil",
    "vacuum_into": "VACUUM INTO '{dir}/copy.sqlite'",
    "pragma_writable_schema": "PRAGMA writable_schema=1",
    "pragma_journal_mode": "PRAGMA journal_mode=delete",
    "pragma_function": "SELECT * FROM pragma_table_info('employees')",
    "two_statements": "SELECT 1; DROP TABLE employees",
    "load_extension": "SELECT load_extension('/tmp/evil')",
    "infinite_cte": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT count(*) FROM c",
    "huge_result": "SELECT * FROM employees a, employees b, employees c",
    # 30**6 = 729 million rows: far more than a second of work.
    "huge_count": "SELECT count(*) FROM employees a, employees b, employees c, employees d, employees e, employees f",
}


@pytest.mark.parametrize("think", [False, True], ids=["no_think", "think"])
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_harmful_queries_score_nothing_and_change_nothing(family, company_task, attack: str, think: bool) -> None:
    directory = Path(company_task.data["db_path"]).parent
    before = _snapshot(directory)
    sql = ATTACKS[attack].format(dir=directory)
    start = time.monotonic()
    result = family.make_env(company_task).step(_answer(sql, think))
    elapsed = time.monotonic() - start
    assert result.metrics["executed"] == 0.0
    assert result.reward == (0.1 if think else 0.0)
    assert elapsed < TIMEOUT_S + 3
    assert _snapshot(directory) == before  # same files, same bytes, same mtimes


def test_backstop_kills_a_stuck_worker_and_recovers(family, company_task) -> None:
    path = company_task.data["db_path"]
    endless = ATTACKS["infinite_cte"]
    start = time.monotonic()
    # The in-worker deadline (60 s) is past the backstop (1 s): only the kill can end this.
    result = family.runner.run(path, endless, timeout_s=60, row_cap=10, wait_s=1.0)
    assert result.status == KILLED and time.monotonic() - start < 4
    again = family.runner.run(path, "SELECT count(*) FROM employees", timeout_s=5, row_cap=10)
    assert again.status == OK and again.rows == ((30,),)


def test_databases_are_built_once_and_atomically(tmp_path) -> None:
    path = ensure_database("shop", 0, tmp_path)
    stamp = path.stat().st_mtime_ns
    assert ensure_database("shop", 0, tmp_path) == path and path.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp or journal files left
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (40,)
    other = ensure_database("shop", 0, tmp_path / "again")
    assert other.read_bytes() == path.read_bytes()  # same seed, same database


def test_make_env_rejects_a_missing_database(family, company_task) -> None:
    from floe.envs.base import Task

    moved = Task(id="t1", data=dict(company_task.data, db_path="/nonexistent/db.sqlite"))
    with pytest.raises(ValueError, match="t1.*not found"):
        family.make_env(moved)


def test_reads_bird_format(tmp_path) -> None:
    db_root = tmp_path / "dev_databases"
    (db_root / "zoo").mkdir(parents=True)
    with sqlite3.connect(db_root / "zoo" / "zoo.sqlite") as conn:
        conn.execute("CREATE TABLE animals (name TEXT, legs INTEGER)")
        conn.executemany("INSERT INTO animals VALUES (?, ?)", [("cat", 4), ("bird", 2), ("snake", 0)])
    conn.close()
    rows = [
        {"question_id": i, "db_id": "zoo", "question": f"Which animals have more than {i} legs?",
         "evidence": "legs is the number of legs", "SQL": f"SELECT name FROM animals WHERE legs > {i}"}
        for i in range(20)
    ]
    data_path = tmp_path / "dev.json"
    data_path.write_text(json.dumps(rows))
    family = make_family("text2sql", data_path=str(data_path), db_root=str(db_root), timeout_s=TIMEOUT_S)
    try:
        task = family.tasks("train", 3, 0)[0]
        assert "CREATE TABLE animals" in task.data["schema"] and "Hint: legs is" in task.data["question"]
        assert family.make_env(task).step(_answer(task.data["gold_sql"][0], think=True)).reward == 1.0
    finally:
        family.close()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([dict(rows[0], db_id="missing")]))
    with pytest.raises(ValueError, match="db_root"):
        make_family("text2sql", data_path=str(bad), db_root=str(db_root)).tasks("train", 1, 0)


def test_concurrent_callers_do_not_eat_each_others_time(company_task) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from floe.envs.sql_sandbox import SqlRunner

    runner = SqlRunner(workers=1)
    # About 0.3 s of work each (timed here, on the started worker: a loaded machine is slower);
    # four callers on one worker take 4x that in all, longer than any single call may wait (3x).
    # Each call's clock must start when its query starts.
    slow = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x < 600000) SELECT count(*) FROM c"
    try:
        runner.run(company_task.data["db_path"], "SELECT 1", 5, 10)  # the worker process starts
        began = time.monotonic()
        assert runner.run(company_task.data["db_path"], slow, 5, 10).status == OK
        wait_s = max(1.0, 3 * (time.monotonic() - began))
        with ThreadPoolExecutor(4) as threads:
            results = list(
                threads.map(lambda _: runner.run(company_task.data["db_path"], slow, 5, 10, wait_s=wait_s), range(4))
            )
    finally:
        runner.close()
    assert [r.status for r in results] == [OK] * 4
    assert all(r.rows == ((600000,),) for r in results)
