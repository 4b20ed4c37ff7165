"""The alphabet_sort env: keep a growing list of names sorted over 1-3 turns.

Turn 1 shows a few names (written FirstLast, no space) and asks for them sorted by FIRST (or
LAST) name inside ``<alphabetical_sorted>`` tags. Each later turn adds names and asks for the
whole list sorted inside ``<combined_alphabetical_sorted>`` tags, with every name added in that
turn marked ``// new name!``.

Per-turn reward (our reading of the peer's rule):
  * attempts = every ``<tag>...</tag>`` block of the turn's tag in the reply, in order; none -> 0;
  * each attempt is normalised (lines stripped, empty lines dropped, lower-cased, joined by
    "\\n") and compared to the expected list (same normalisation) with
    ``difflib.SequenceMatcher(None, attempt, expected).ratio()``;
  * with several attempts, each must score strictly higher than the one before it, otherwise
    the turn scores 0; the last attempt is the answer;
  * turn reward = ratio(answer) ** similarity_power (default 4).
Episode reward = mean of the turn rewards.
"""

from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import random
import re
from typing import Literal

from pydantic import Field, model_validator

from floe.envs.base import Env, EnvFamily, Message, StepResult, Task
from floe.envs.options import DataFileOptions, parse_options
from floe.envs.splits import family_tasks

NAME = "alphabet_sort"
NEW_MARK = "// new name!"
FIRST_TAG = "alphabetical_sorted"
LATER_TAG = "combined_alphabetical_sorted"

FIRST_NAMES = (
    "Ada", "Alan", "Alice", "Ben", "Carla", "Chen", "Dana", "Diego", "Elena", "Emil", "Fatima",
    "Felix", "Grace", "Hana", "Ivan", "Jonas", "Kira", "Liam", "Maya", "Nina", "Omar", "Paula",
    "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wes", "Yuki", "Zara",
)
LAST_NAMES = (
    "Abbott", "Baker", "Costa", "Diaz", "Evans", "Fischer", "Garcia", "Hughes", "Ito", "Jensen",
    "Khan", "Lopez", "Moreau", "Nakamura", "Olsen", "Patel", "Quist", "Rossi", "Silva", "Tanaka",
    "Usman", "Varga", "Weber", "Xu", "Yilmaz", "Zhang",
)

ALL_NAMES = tuple(first + last for first in FIRST_NAMES for last in LAST_NAMES)


class AlphabetSortOptions(DataFileOptions):
    """Options of the alphabet_sort family (data files: rows with a `names` list column)."""

    min_turns: int = Field(1, ge=1)
    max_turns: int = Field(3, ge=1)
    min_names_per_turn: int = Field(1, ge=1)
    max_names_per_turn: int = Field(5, ge=1)
    sort_by: Literal["first", "last", "random"] = "first"
    similarity_power: float = Field(4.0, gt=0)

    @model_validator(mode="after")
    def _ranges_ordered(self) -> AlphabetSortOptions:
        if self.min_turns > self.max_turns:
            raise ValueError(f"min_turns ({self.min_turns}) must be <= max_turns ({self.max_turns})")
        if self.min_names_per_turn > self.max_names_per_turn:
            raise ValueError(
                f"min_names_per_turn ({self.min_names_per_turn}) must be <= "
                f"max_names_per_turn ({self.max_names_per_turn})"
            )
        if self.data_path is None and self.max_turns * self.max_names_per_turn > len(ALL_NAMES):
            raise ValueError(
                f"max_turns * max_names_per_turn ({self.max_turns * self.max_names_per_turn}) exceeds "
                f"the {len(ALL_NAMES)} shipped names"
            )
        return self


def sort_key(name: str, by: str) -> tuple[str, str]:
    """(primary, secondary) key of a FirstLast name; the full name breaks ties deterministically."""
    cut = next((i for i in range(1, len(name)) if name[i].isupper()), len(name))
    first, last = name[:cut].lower(), name[cut:].lower()
    return (first, last) if by == "first" else (last, first)


def expected_lines(turns: list[list[str]], turn: int, by: str) -> list[str]:
    """The correct reply lines (before normalisation) for 0-based ``turn``."""
    seen = [n for names in turns[: turn + 1] for n in names]
    new = set(turns[turn]) if turn > 0 else set()
    return [f"{n} {NEW_MARK}" if n in new else n for n in sorted(seen, key=lambda n: sort_key(n, by))]


def normalise(block: str) -> str:
    """Lines stripped, empty lines dropped, lower-cased, joined by newlines."""
    return "\n".join(line.strip().lower() for line in block.splitlines() if line.strip())


def turn_reward(completion: str, tag: str, expected: list[str], power: float) -> tuple[float, int]:
    """(reward, number of attempts) for one reply; see the module docstring for the rule."""
    attempts = re.findall(rf"<{tag}>(.*?)</{tag}>", completion, re.DOTALL)
    if not attempts:
        return 0.0, 0
    target = normalise("\n".join(expected))
    ratios = [difflib.SequenceMatcher(None, normalise(a), target).ratio() for a in attempts]
    if any(later <= earlier for earlier, later in itertools.pairwise(ratios)):
        return 0.0, len(attempts)
    return ratios[-1] ** power, len(attempts)


def turn_prompt(turns: list[list[str]], turn: int, by: str) -> str:
    """The user message that opens 0-based ``turn``."""
    names, key = ", ".join(turns[turn]), by.upper()
    if turn == 0:
        return (
            f"Sort these names alphabetically by {key} name, one per line, "
            f"inside <{FIRST_TAG}></{FIRST_TAG}>:\n{names}"
        )
    return (
        f"Add these names: {names}\nSort ALL names so far by {key} name, one per line, inside "
        f"<{LATER_TAG}></{LATER_TAG}>. End the line of each name added now with {NEW_MARK}"
    )


class AlphabetSortEnv(Env):
    """One multi-turn sorting episode."""

    def __init__(self, turns: list[list[str]], by: str, power: float) -> None:
        super().__init__()
        self.turns, self.by, self.power = turns, by, power

    def initial_messages(self) -> list[Message]:
        return [{"role": "user", "content": turn_prompt(self.turns, 0, self.by)}]

    def _step(self, completion: str) -> StepResult:
        turn = len(self.turn_rewards)
        tag = FIRST_TAG if turn == 0 else LATER_TAG
        expected = expected_lines(self.turns, turn, self.by)
        reward, attempts = turn_reward(completion, tag, expected, self.power)
        done = turn == len(self.turns) - 1
        follow_up = [] if done else [{"role": "user", "content": turn_prompt(self.turns, turn + 1, self.by)}]
        return StepResult(
            reward=reward,
            done=done,
            next_messages=follow_up,
            metrics={"attempts": float(attempts), "tag_found": float(attempts > 0)},
        )

    def episode_reward(self) -> float:
        """Mean of the turn rewards (the peer's per-turn average)."""
        self._require_done()
        return sum(self.turn_rewards) / len(self.turn_rewards)


class AlphabetSortFamily(EnvFamily):
    """Multi-turn name sorting; see the module docstring for the reward."""

    name = NAME
    options_model = AlphabetSortOptions

    def __init__(self, **options: object) -> None:
        self.options = parse_options(AlphabetSortOptions, NAME, options)

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        return family_tasks(
            NAME, split, count, seed, data_path=self.options.data_path, eval_data_path=self.options.eval_data_path,
            generator=lambda: self._draw, columns=("names",), rows=self._rows, key=_key,
        )

    def make_env(self, task: Task) -> Env:
        return AlphabetSortEnv(task.data["turns"], task.data["sort_by"], self.options.similarity_power)

    def _rows(self, rows: list[dict], option: str) -> list[dict]:
        episodes = []
        for row in rows:
            # As the peer: drop spaces inside names and duplicates; each row's episode is drawn
            # from an RNG seeded by the row itself so it does not depend on file order.
            names = list(dict.fromkeys(str(n).replace(" ", "") for n in row["names"]))
            rng = random.Random(hashlib.sha256("\n".join(names).encode()).hexdigest())
            episode = self._episode(rng, names, from_start=True)
            if episode is not None:  # rows with too few names for the drawn turns are skipped
                episodes.append(episode)
        return episodes

    def _draw(self, rng: random.Random) -> tuple[str, dict]:
        data = self._episode(rng, list(ALL_NAMES), from_start=False)
        assert data is not None, "options validation bounds the names an episode needs"
        return _key(data), data

    def _episode(self, rng: random.Random, pool: list[str], from_start: bool) -> dict | None:
        """Turns of names drawn from ``pool`` (its first names when ``from_start``), shuffled."""
        opts = self.options
        counts = [
            rng.randint(opts.min_names_per_turn, opts.max_names_per_turn)
            for _ in range(rng.randint(opts.min_turns, opts.max_turns))
        ]
        total = sum(counts)
        if total > len(pool):
            return None
        chosen = rng.sample(pool[:total] if from_start else pool, total)
        turns, start = [], 0
        for count in counts:
            turns.append(chosen[start : start + count])
            start += count
        by = opts.sort_by if opts.sort_by != "random" else rng.choice(["first", "last"])
        return {"turns": turns, "sort_by": by}


def _key(data: dict) -> str:
    return json.dumps(data, sort_keys=True)
