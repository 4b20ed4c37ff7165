"""The environment abstractions every floe env implements.

This module owns the contract between the RL loop and an environment:

* a ``Task`` is one dataset row (plain, JSON-serialisable data);
* an ``EnvFamily`` is a named environment that produces tasks and builds an ``Env`` for a task;
* an ``Env`` runs one episode: it hands out the opening messages, scores each assistant turn
  (``step``) and reports the episode reward.

The loop owns tokenisation, sampling and chat templates; envs only see and return text.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}

SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Task:
    """One dataset row: what the env needs to run one episode."""

    id: str
    data: dict  # env-specific, JSON-serialisable (e.g. {"text": ..., "target": ...})


@dataclass
class StepResult:
    """What the env says about one assistant turn."""

    reward: float  # reward for this turn
    done: bool
    # Messages to append (after the assistant's reply) for the next turn; [] when done.
    next_messages: list[Message]
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. {"format_ok": 1.0}


class Env(ABC):
    """One episode (single- or multi-turn). Single use.

    Subclasses implement ``initial_messages`` and ``_step``; the public ``step`` wraps ``_step``
    so that every env records its turn rewards and refuses to be stepped after it is done.
    """

    def __init__(self) -> None:
        self.turn_rewards: list[float] = []
        self.done = False

    @abstractmethod
    def initial_messages(self) -> list[Message]:
        """The conversation before the assistant's first turn."""

    @abstractmethod
    def _step(self, completion: str) -> StepResult:
        """Score one assistant turn; called by ``step``."""

    def step(self, completion: str) -> StepResult:
        """Score ``completion`` (the assistant's decoded text for this turn)."""
        if self.done:
            raise RuntimeError(f"{type(self).__name__}.step called after the episode is done")
        if not isinstance(completion, str):
            raise TypeError(f"completion must be str, got {type(completion).__name__}")
        result = self._step(completion)
        self.turn_rewards.append(float(result.reward))
        self.done = result.done
        return result

    def episode_reward(self) -> float:
        """The episode's reward once done; default: the sum of turn rewards."""
        self._require_done()
        return float(sum(self.turn_rewards))

    def _require_done(self) -> None:
        if not self.done:
            raise RuntimeError(f"{type(self).__name__}.episode_reward called before the episode is done")


class EnvFamily(ABC):
    """A named environment: its data and how to build an Env for a Task.

    Construction must stay cheap (no data generation, no I/O beyond validating options): the
    loop may build a family just to read its name or options.
    """

    name: str

    @abstractmethod
    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        """``count`` tasks of ``split`` ("train" or "eval").

        Generated deterministically from ``seed``; eval tasks never equal train tasks.
        """

    @abstractmethod
    def make_env(self, task: Task) -> Env:
        """A fresh, single-use Env for ``task``."""
