"""A reusable Env for one-question-one-answer episodes.

reverse_text, math and text2sql all show a fixed prompt, score exactly one completion and end;
this module owns that shape so each family only supplies its prompt and its scoring function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from floe.envs.base import Env, Message, StepResult


@dataclass(frozen=True)
class Score:
    """A scoring function's verdict on one completion."""

    reward: float
    metrics: dict[str, float]


class SingleTurnEnv(Env):
    """Shows ``messages``, scores one completion with ``score``, then is done."""

    def __init__(self, messages: list[Message], score: Callable[[str], Score]) -> None:
        super().__init__()
        self._messages = messages
        self._score = score

    def initial_messages(self) -> list[Message]:
        # Copies, so a caller appending to the conversation cannot change the env's prompt.
        return [dict(m) for m in self._messages]

    def _step(self, completion: str) -> StepResult:
        verdict = self._score(completion)
        return StepResult(reward=verdict.reward, done=True, next_messages=[], metrics=dict(verdict.metrics))


def prompt_messages(instruction: str, content: str, system_prompt: bool) -> list[Message]:
    """The instruction as a system message (or prefixed to the user message) plus the content."""
    if system_prompt:
        return [{"role": "system", "content": instruction}, {"role": "user", "content": content}]
    return [{"role": "user", "content": f"{instruction}\n{content}"}]
