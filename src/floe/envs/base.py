"""The environment abstractions every floe env implements.

This module owns the contract between the RL loop and an environment:

* a ``Task`` is one dataset row (plain, JSON-serialisable data);
* an ``EnvFamily`` is a named environment that produces tasks and builds an ``Env`` for a task;
* an ``Env`` runs one episode: it hands out the opening messages, scores each assistant turn
  (``step``) and reports the episode reward.

The loop owns tokenisation, sampling and chat templates; envs only see and return text.

Where the line between the model's fault and the env's is drawn (docs/environments.md):

* an exception raised while an env scores a model output (``step``, ``episode_reward``) is
  blamed on the output: the rollout gives the episode ``Env.failure_reward``, counts the error
  and goes on;
* a reward that is not a finite real number is a bug in the env's reward code:
  ``InvalidReward`` names the env and the task and stops the run.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from floe.envs.options import FamilyOptions
from floe.errors import FloeError

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


class InvalidReward(FloeError, ValueError):
    """An env returned a reward that is not a finite real number (a bug in its reward code).

    ``env`` is the env family's name (or the Env class's name where the family is not known),
    ``task`` the task's id ("" when not known), ``where`` the method that returned it
    (``step`` or ``episode_reward``) and ``value`` the repr of what it returned. Survives
    pickle with the same type, message and attributes.
    """

    def __init__(self, env: str, task: str, where: str, value: str):
        self.env, self.task, self.where, self.value = env, task, where, value
        on_task = f", task {task!r}" if task else ""
        super().__init__(
            f"environment {env!r}{on_task}: {where} returned the reward {value}; a reward must be a finite "
            "real number (bool, int or float, not NaN or infinite): fix the environment's reward code"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.env, self.task, self.where, self.value))

    def naming(self, env: str, task: str) -> InvalidReward:
        """The same error naming the env family ``env`` and the task id ``task``."""
        return InvalidReward(env, task, self.where, self.value)


def checked_reward(value: object, env: str, where: str, task: str = "") -> float:
    """``value`` as a float when it is a finite real number (bool, int, float or a numpy
    integer or float), else ``InvalidReward`` naming ``env``, ``task`` and ``where``."""
    if isinstance(value, numbers.Real):
        reward = float(value)
        if math.isfinite(reward):
            return reward
    shown = repr(value) if isinstance(value, numbers.Real) else f"{value!r} ({type(value).__name__})"
    raise InvalidReward(env, task, where, shown)


class Env(ABC):
    """One episode (single- or multi-turn). Single use.

    Subclasses implement ``initial_messages`` and ``_step``; the public ``step`` wraps ``_step``
    so that every env records its turn rewards and refuses to be stepped after it is done.

    ``failure_reward`` (default 0.0; a subclass may set its own) is the episode reward given
    when the env raises while scoring a model output, or when the episode cannot finish
    because the conversation outgrew the model's context (floe.rl.rollouts).
    """

    failure_reward: float = 0.0

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
        """Score ``completion`` (the assistant's decoded text for this turn).

        Raises ``InvalidReward`` when ``_step`` returns a reward that is not a finite real
        number (the turn is then not recorded)."""
        if self.done:
            raise RuntimeError(f"{type(self).__name__}.step called after the episode is done")
        if not isinstance(completion, str):
            raise TypeError(f"completion must be str, got {type(completion).__name__}")
        result = self._step(completion)
        self.turn_rewards.append(checked_reward(result.reward, type(self).__name__, "step"))
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
    # The family's keyword options (a recipe's `env.options`), validated before it is built.
    options_model: ClassVar[type[FamilyOptions]] = FamilyOptions

    @abstractmethod
    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        """``count`` tasks of ``split`` ("train" or "eval").

        Generated deterministically from ``seed``; eval tasks never equal train tasks.
        """

    @abstractmethod
    def make_env(self, task: Task) -> Env:
        """A fresh, single-use Env for ``task``."""
