"""text2sql SQL extraction order and the format rule."""

from __future__ import annotations

import pytest

from floe.envs.sql_extract import extract_sql, format_ok


@pytest.mark.parametrize(
    ("text", "sql"),
    [
        # 1. the last ```sql block longer than 6 characters
        ("```sql\nSELECT 1\n```\n```sql\nSELECT 2\n```", "SELECT 2"),
        ("```sql\nSELECT a FROM t\n```\n```sql\nSEL\n```", "SELECT a FROM t"),  # short block skipped
        ("```SQL\nselect 3\n```", "select 3"),
        # 2. a generic block with SELECT (language tag line dropped), before json and raw text
        ("```\nSELECT name FROM t\n```", "SELECT name FROM t"),
        ("```sqlite\nselect x from y\n```", "select x from y"),
        ("```python\nprint(1)\n```\n```\nSELECT 4\n```", "SELECT 4"),
        ('```json\n{"sql": "SELECT 5"}\n```\n```\nSELECT 6\n```', "SELECT 6"),
        # 3. a ```json {"sql": ...} block
        ('```json\n{"sql": "SELECT 7 FROM t"}\n```', "SELECT 7 FROM t"),
        ('```json\n{"query": "SELECT 8"}\n```\nSELECT 9', "SELECT 9"),  # no "sql" key: falls through
        # 4. a raw SELECT statement, up to ";" or "</answer>"
        ("The query is SELECT a FROM t; done", "SELECT a FROM t"),
        ("<answer>SELECT b FROM t</answer>", "SELECT b FROM t"),
        ("nothing here", None),
        ("```sql\nSEL\n```", None),
    ],
)
def test_extraction_order(text: str, sql: str | None) -> None:
    assert extract_sql(text) == sql


def test_only_text_after_the_first_think_close_is_searched() -> None:
    text = "<think>```sql\nSELECT wrong\n```</think><answer>```sql\nSELECT right\n```</answer>"
    assert extract_sql(text) == "SELECT right"
    assert extract_sql("<think>maybe SELECT a FROM t</think> no query") is None
    # Without </think> the whole text is searched.
    assert extract_sql("<think>SELECT c FROM t") == "SELECT c FROM t"


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("<think>plan</think><answer>```sql\nSELECT 1\n```</answer>", True),
        ("<answer>```sql\nSELECT 1\n```</answer>", False),  # no think
        ("<think>a</think><think>b</think>```sql\nSELECT 1\n```", False),  # two pairs
        ("</think><think>```sql\nSELECT 1\n```", False),  # out of order
        ("<think>plan</think><answer>no query</answer>", False),  # no SQL
    ],
)
def test_format_rule(text: str, ok: bool) -> None:
    assert format_ok(text, extract_sql(text)) is ok
