"""The reverse_text env: reverse a string character by character.

Reward (as the peer environments compute it): ``difflib.SequenceMatcher(None, answer,
target).ratio()`` with difflib's default arguments (autojunk on), where ``answer`` is the
stripped text inside the FIRST ``<reversed_text>...</reversed_text>`` pair ("" when there is
none) and ``target = text[::-1]``.

Data: random lowercase strings (length knob, 3-8 by default, easy enough for a tiny
character-level model), or the public dataset's rows (a ``prompt`` column holding the text).
"""

from __future__ import annotations

import difflib
import random
import re
import string

from pydantic import Field, model_validator

from floe.envs.base import Env, EnvFamily, Task
from floe.envs.options import DataFileOptions, parse_options
from floe.envs.single_turn import Score, SingleTurnEnv, prompt_messages
from floe.envs.splits import family_tasks

NAME = "reverse_text"
INSTRUCTION = "Reverse the text character by character. Answer inside <reversed_text></reversed_text>."
_TAG = re.compile(r"<reversed_text>(.*?)</reversed_text>", re.DOTALL)


class ReverseTextOptions(DataFileOptions):
    """Options of the reverse_text family (data files: rows with a `prompt` column)."""

    min_length: int = Field(3, ge=1)
    max_length: int = Field(8, ge=1)
    system_prompt: bool = True  # False: put the instruction in the user message instead
    # The peers' wording by default; tiny models train faster with a shorter one.
    instruction: str = Field(INSTRUCTION, min_length=1)

    @model_validator(mode="after")
    def _lengths_ordered(self) -> ReverseTextOptions:
        if self.min_length > self.max_length:
            raise ValueError(f"min_length ({self.min_length}) must be <= max_length ({self.max_length})")
        return self


def extract_answer(completion: str) -> str:
    """The stripped text of the first <reversed_text> pair, or "" when there is none."""
    match = _TAG.search(completion)
    return match.group(1).strip() if match else ""


def reward(completion: str, target: str) -> float:
    """SequenceMatcher ratio (default args, autojunk on, as the peers) of answer vs target."""
    return difflib.SequenceMatcher(None, extract_answer(completion), target).ratio()


class ReverseTextFamily(EnvFamily):
    """Reverse a string; see the module docstring for the reward."""

    name = NAME
    options_model = ReverseTextOptions

    def __init__(self, **options: object) -> None:
        self.options = parse_options(ReverseTextOptions, NAME, options)

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        return family_tasks(
            NAME, split, count, seed, data_path=self.options.data_path, eval_data_path=self.options.eval_data_path,
            generator=lambda: self._draw, columns=("prompt",), rows=_rows, key=lambda r: r["text"],
        )

    def make_env(self, task: Task) -> Env:
        text, target = task.data["text"], task.data["target"]
        messages = prompt_messages(self.options.instruction, text, self.options.system_prompt)

        def score(completion: str) -> Score:
            answer = extract_answer(completion)
            return Score(
                reward=reward(completion, target),
                metrics={"tag_found": float(_TAG.search(completion) is not None), "exact": float(answer == target)},
            )

        return SingleTurnEnv(messages, score)

    def _draw(self, rng: random.Random) -> tuple[str, dict]:
        length = rng.randint(self.options.min_length, self.options.max_length)
        text = "".join(rng.choice(string.ascii_lowercase) for _ in range(length))
        return text, {"text": text, "target": text[::-1]}


def _rows(rows: list[dict], option: str) -> list[dict]:
    out = []
    for index, row in enumerate(rows):
        text = row["prompt"]
        if not isinstance(text, str) or not text:
            raise ValueError(f"{option}: row {index} has an empty or non-string `prompt`")
        out.append({"text": text, "target": text[::-1]})
    return out
