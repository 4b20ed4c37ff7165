"""The math env: GSM8K-style word problems answered with the ``#### answer`` convention.

Reward (verl's gsm8k "strict" method): look only at the last 300 characters of the completion
(verl clips there to keep the regex cheap on long outputs, so an answer earlier than that is
ignored), take the LAST match of ``#### (\\-?[0-9\\.\\,]+)``, remove "," and "$", and score
1.0 when it equals the target string exactly, else 0.0. Note the regex requires "#### " to be
followed directly by a digit, "-", "." or ",": "#### $5" does not match (as in verl), and
"5.0" does not equal "5".

Data: generated arithmetic word problems with integer answers at three levels (1: one addition
or subtraction of small numbers; 2: two steps; 3: three steps with multiplication/division),
or GSM8K JSONL rows (``question``, ``answer`` ending in ``#### N``).
"""

from __future__ import annotations

import random
import re

from pydantic import Field, model_validator

from floe.envs.base import Env, EnvFamily, Task
from floe.envs.options import DataFileOptions, parse_options
from floe.envs.single_turn import Score, SingleTurnEnv, prompt_messages
from floe.envs.splits import family_tasks

NAME = "math"
INSTRUCTION = "Solve the problem. End your answer with #### and the number."
CLIP_CHARS = 300  # verl's _SOLUTION_CLIP_CHARS
_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")

_PEOPLE = ("Tom", "Ann", "Sam", "Mia", "Ben", "Eva", "Leo", "Zoe", "Max", "Ivy")
_ITEMS = ("apples", "pens", "books", "coins", "cards", "eggs", "shells", "stamps")


class MathOptions(DataFileOptions):
    """Options of the math family (data files: GSM8K rows)."""

    min_level: int = Field(1, ge=1, le=3)
    max_level: int = Field(3, ge=1, le=3)
    max_number: int = Field(20, ge=2)  # largest operand in generated problems
    system_prompt: bool = True

    @model_validator(mode="after")
    def _levels_ordered(self) -> MathOptions:
        if self.min_level > self.max_level:
            raise ValueError(f"min_level ({self.min_level}) must be <= max_level ({self.max_level})")
        return self


def extract_answer(completion: str) -> str | None:
    """verl's strict extraction: last ``#### N`` in the last 300 chars, "," and "$" removed."""
    tail = completion[-CLIP_CHARS:]
    found = _ANSWER.findall(tail)
    if not found:
        return None
    return found[-1].replace(",", "").replace("$", "")


def reward(completion: str, target: str) -> float:
    """1.0 when the extracted answer equals ``target`` exactly, else 0.0."""
    return 1.0 if extract_answer(completion) == target else 0.0


def gsm8k_target(answer: str) -> str | None:
    """The target string of a GSM8K ``answer`` field (its ``#### N``, commas removed)."""
    found = _ANSWER.findall(answer)
    return found[-1].replace(",", "").replace("$", "") if found else None


class MathFamily(EnvFamily):
    """Arithmetic word problems; see the module docstring for the reward."""

    name = NAME
    options_model = MathOptions

    def __init__(self, **options: object) -> None:
        self.options = parse_options(MathOptions, NAME, options)

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        return family_tasks(
            NAME, split, count, seed, data_path=self.options.data_path, eval_data_path=self.options.eval_data_path,
            generator=lambda: self._draw, columns=("question", "answer"), rows=_rows, key=lambda r: r["question"],
        )

    def make_env(self, task: Task) -> Env:
        target = task.data["target"]
        messages = prompt_messages(INSTRUCTION, task.data["question"], self.options.system_prompt)

        def score(completion: str) -> Score:
            found = extract_answer(completion) is not None
            return Score(reward=reward(completion, target), metrics={"format_ok": float(found)})

        return SingleTurnEnv(messages, score)

    def _draw(self, rng: random.Random) -> tuple[str, dict]:
        level = rng.randint(self.options.min_level, self.options.max_level)
        question, answer = _LEVELS[level](rng, self.options.max_number)
        return question, {"question": question, "target": str(answer), "level": level}


def _level1(rng: random.Random, top: int) -> tuple[str, int]:
    who, item = rng.choice(_PEOPLE), rng.choice(_ITEMS)
    a, b = rng.randint(1, top), rng.randint(1, top)
    if rng.random() < 0.5:
        return f"{who} has {a} {item} and gets {b} more. How many {item} does {who} have?", a + b
    a, b = max(a, b), min(a, b)
    return f"{who} has {a} {item} and gives away {b}. How many {item} are left?", a - b


def _level2(rng: random.Random, top: int) -> tuple[str, int]:
    who, item = rng.choice(_PEOPLE), rng.choice(_ITEMS)
    if rng.random() < 0.5:
        a, b = rng.randint(1, top), rng.randint(1, top)
        c = rng.randint(0, a + b)
        text = f"{who} has {a} {item}, gets {b} more, then gives away {c}. How many {item} are left?"
        return text, a + b - c
    bags, each = rng.randint(2, min(top, 9)), rng.randint(2, top)
    return f"{who} buys {bags} bags with {each} {item} in each. How many {item} is that?", bags * each


def _level3(rng: random.Random, top: int) -> tuple[str, int]:
    who, item = rng.choice(_PEOPLE), rng.choice(_ITEMS)
    if rng.random() < 0.5:
        boxes, each, extra = rng.randint(2, min(top, 9)), rng.randint(2, top), rng.randint(1, top)
        used = rng.randint(0, boxes * each + extra)
        text = (
            f"{who} buys {boxes} boxes of {each} {item}, finds {extra} more and uses {used}. "
            f"How many {item} are left?"
        )
        return text, boxes * each + extra - used
    friends, share, extra = rng.randint(2, min(top, 9)), rng.randint(1, top), rng.randint(1, top)
    text = (
        f"{who} shares {friends * share} {item} equally among {friends} friends. Then each friend "
        f"gets {extra} more. How many {item} does each friend have?"
    )
    return text, share + extra


_LEVELS = {1: _level1, 2: _level2, 3: _level3}


def _rows(rows: list[dict], option: str) -> list[dict]:
    out = []
    for index, row in enumerate(rows):
        target = gsm8k_target(str(row["answer"]))
        if target is None:
            raise ValueError(f"{option}: row {index} `answer` has no '#### N' final answer")
        out.append({"question": str(row["question"]), "target": target})
    return out
