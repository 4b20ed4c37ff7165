"""Reading the SQL query and the format verdict out of a text2sql completion.

Extraction looks only after the first ``</think>`` (the whole text when there is none) and
tries, in order:

1. the last ```` ```sql ```` block whose stripped content is longer than 6 characters;
2. the last generic ```` ``` ```` block (no language tag, or a tag other than sql/json) whose
   content contains ``SELECT`` (case-insensitive); a one-word language tag line is dropped;
3. the last ```` ```json ```` block that parses to an object with a string ``"sql"`` field
   (a block that does not parse, however malformed or deeply nested, is skipped);
4. a raw statement outside fenced blocks: from the first word ``SELECT`` up to the first
   ``;``, ``</answer>`` or the end of the text.

The format is correct when SQL was extracted and the text holds exactly one ``<think>`` and
exactly one ``</think>``, in that order.
"""

from __future__ import annotations

import json
import re

_SQL_BLOCK = re.compile(r"```sql(?!\w)(.*?)```", re.DOTALL | re.IGNORECASE)  # not ```sqlite
_ANY_BLOCK = re.compile(r"```(.*?)```", re.DOTALL)
_JSON_BLOCK = re.compile(r"```json(.*?)```", re.DOTALL | re.IGNORECASE)
_LANG_LINE = re.compile(r"^[A-Za-z0-9_+-]*[ \t]*(?:\n|$)")
_RAW_SELECT = re.compile(r"\bSELECT\b.*?(?=;|</answer>|```|\Z)", re.DOTALL | re.IGNORECASE)
_MIN_SQL_BLOCK_CHARS = 7  # "longer than 6 characters"


def answer_region(text: str) -> str:
    """The part of ``text`` after the first ``</think>`` (all of it when there is none)."""
    head, sep, tail = text.partition("</think>")
    return tail if sep else head


def extract_sql(text: str) -> str | None:
    """The SQL query of a completion, or None; see the module docstring for the order."""
    region = answer_region(text)
    sql_blocks = [b.strip() for b in _SQL_BLOCK.findall(region)]
    sql_blocks = [b for b in sql_blocks if len(b) >= _MIN_SQL_BLOCK_CHARS]
    if sql_blocks:
        return sql_blocks[-1]
    for block in reversed(_ANY_BLOCK.findall(region)):
        tag = block.split("\n", 1)[0].strip().lower()
        if tag in ("sql", "json"):
            continue
        # A first line that is one bare word is a language tag (```sqlite), unless it is SQL.
        body = _LANG_LINE.sub("", block, count=1) if "\n" in block and tag != "select" else block
        if "select" in body.lower():
            return body.strip()
    for block in reversed(_JSON_BLOCK.findall(region)):
        try:
            parsed = json.loads(block)
        except (ValueError, RecursionError):  # malformed, or nested deeper than the parser recurses
            continue
        if isinstance(parsed, dict) and isinstance(parsed.get("sql"), str) and parsed["sql"].strip():
            return parsed["sql"].strip()
    # Fenced blocks were all tried above; a raw statement is one outside them.
    raw = _RAW_SELECT.search(_ANY_BLOCK.sub(" ", region))
    return raw.group(0).strip() if raw else None


def format_ok(text: str, sql: str | None) -> bool:
    """SQL was extracted and there is exactly one <think> ... </think> pair, in order."""
    if sql is None or text.count("<think>") != 1 or text.count("</think>") != 1:
        return False
    return text.index("<think>") < text.index("</think>")
