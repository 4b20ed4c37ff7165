"""A correct answer for a task, written the way the env's prompt asks for it.

Used for SFT warm starts (`floe sft`, recipes' [warm_start]): the first assistant turn of an
ideal episode. Multi-turn envs demonstrate their first turn only.
"""

from __future__ import annotations

from collections.abc import Callable

from floe.envs import alphabet_sort
from floe.envs.base import Task


def _reverse_text(task: Task) -> str:
    return f"<reversed_text>{task.data['target']}</reversed_text>"


def _math(task: Task) -> str:
    return f"#### {task.data['target']}"


def _alphabet_sort(task: Task) -> str:
    lines = alphabet_sort.expected_lines(task.data["turns"], 0, task.data["sort_by"])
    tag = alphabet_sort.FIRST_TAG
    return f"<{tag}>\n" + "\n".join(lines) + f"\n</{tag}>"


def _text2sql(task: Task) -> str:
    return f"<think>\nLook up the tables the question needs.\n</think>\n<answer>\n```sql\n{task.data['gold_sql'][0]}\n```\n</answer>"


DEMONSTRATIONS: dict[str, Callable[[Task], str]] = {
    "reverse_text": _reverse_text,
    "math": _math,
    "alphabet_sort": _alphabet_sort,
    "text2sql": _text2sql,
}


def demonstration(family: str, task: Task) -> str:
    try:
        return DEMONSTRATIONS[family](task)
    except KeyError:
        raise ValueError(f"env {family!r} has no demonstrations; choose one of {sorted(DEMONSTRATIONS)}") from None
