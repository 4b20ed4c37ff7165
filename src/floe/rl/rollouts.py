"""Rollouts: run environment episodes with the backend's sampler, token ids all the way.

Text exists only where the environment needs it: the opening messages are rendered once with
the tokenizer's chat template, the env reads each completion as decoded text, and a later
turn's prompt continues the previous prompt and completion token for token
(`floe.chat.Renderer.next_prompt`), so no completion is ever re-tokenised.

An `Episode` keeps every turn (prompt tokens, completion tokens, sampler log-probs, the weights
version that produced it and the sampler's stop reason), the env's rewards and why it ended:

* ``"done"``: the env ended it;
* ``"env_error"``: the env raised while scoring a model output (any ``Exception`` from ``step``
  or ``episode_reward``); the episode gets ``Env.failure_reward``, its metrics count the error
  (``env_error`` = 1) and each exception type is logged once per env family;
* ``"context_limit"``: the next turn's prompt leaves no room to sample in the model's context;
  the episode gets ``Env.failure_reward`` and ``truncated`` = 1 in its metrics. A turn whose
  prompt leaves fewer than ``max_tokens`` tokens samples at most what is left.

A reward that is not a finite real number is a bug in the env, not the model's fault:
``InvalidReward`` names the env family and the task and ends the rollout.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from floe.chat import Renderer
from floe.client import Client
from floe.envs import Env, EnvFamily, StepResult, Task
from floe.envs.base import InvalidReward, checked_reward
from floe.errors import InvalidInput
from floe.types import SampledSequence, SamplingParams

log = logging.getLogger(__name__)

EpisodeStop = Literal["done", "env_error", "context_limit"]

# Per-episode metric keys the rollout sets on every episode (0.0 or 1.0); the loop averages
# them over a step's episodes like any env metric (env/env_error, env/truncated).
ENV_ERROR_METRIC = "env_error"
TRUNCATED_METRIC = "truncated"


@dataclass
class Turn:
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    weights_version: int
    text: str
    reward: float
    stop_reason: str = ""  # the sampler's: "stop_token" | "stop_string" | "length"


@dataclass
class Episode:
    task: Task
    group: int  # index of the group (task) in its batch
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    stop_reason: EpisodeStop | None = None  # why it ended (module docstring); None while running
    error: str | None = None  # the exception type when stop_reason == "env_error"


@dataclass
class RolloutBatch:
    """The episodes of one step, grouped by task (n episodes per task)."""

    episodes: list[Episode]
    num_groups: int
    sample_seconds: float
    score_seconds: float

    def by_group(self) -> list[list[Episode]]:
        groups: list[list[Episode]] = [[] for _ in range(self.num_groups)]
        for ep in self.episodes:
            groups[ep.group].append(ep)
        return groups


def run_episodes(
    client: Client,
    family: EnvFamily,
    tasks: list[Task],
    n: int,
    params: SamplingParams,
    renderer: Renderer,
    scorer: ThreadPoolExecutor,
    max_context: int | None = None,
) -> RolloutBatch:
    """n episodes per task, all turns. Each turn is one `sample` call for every live episode
    (one per distinct token budget when some prompt leaves less than ``params.max_tokens``).

    ``max_context`` (tokens) defaults to ``client.info().max_context``. Raises InvalidInput
    naming ``tasks[i]`` when a task's opening prompt leaves no room to sample (before any
    sampling), and ``InvalidReward`` when the env returns a reward that is not a finite number.
    Exceptions the env raises on a model output end that episode only (module docstring).
    """
    if max_context is None:
        max_context = client.info().max_context
    envs: list[Env] = []
    episodes: list[Episode] = []
    for g, task in enumerate(tasks):
        for _ in range(n):
            envs.append(family.make_env(task))
            episodes.append(Episode(task, g))
    histories = [env.initial_messages() for env in envs]
    first_prompts = [renderer.render(histories[g * n]) for g in range(len(tasks))]
    for g, p in enumerate(first_prompts):
        if len(p) >= max_context:
            raise InvalidInput(
                f"tasks[{g}]",
                f"environment {family.name!r}, task {tasks[g].id!r}: the opening prompt is {len(p)} tokens, "
                f"which leaves no room to sample in the model's context of {max_context} tokens; use a model "
                "with a longer context or tasks with shorter prompts",
            )
    prompts = [first_prompts[i // n] for i in range(len(envs))]
    live = list(range(len(envs)))
    sample_s = score_s = 0.0
    first_turn = True
    while live:
        t0 = time.perf_counter()
        if first_turn:  # one prompt per task, n samples each: the prompt is prefilled once
            seqs = [s for group in _sample(client, first_prompts, n, params, max_context) for s in group]
        else:
            seqs = [group[0] for group in _sample(client, [prompts[i] for i in live], 1, params, max_context)]
        t1 = time.perf_counter()
        texts = [renderer.decode(s.tokens) for s in seqs]
        outcomes = list(scorer.map(lambda it: _score(envs[it[0]], it[1]), zip(live, texts)))
        score_s += time.perf_counter() - t1
        sample_s += t1 - t0
        still = []
        for i, seq, text, outcome in zip(live, seqs, texts, outcomes):
            ep, env = episodes[i], envs[i]
            if isinstance(outcome, Exception):
                _raise_if_invalid_reward(outcome, family, ep.task)
                ep.turns.append(_turn(prompts[i], seq, text, _failure_reward(env, family, ep.task)))
                _env_error(ep, env, family, outcome)
                continue
            reward = checked_reward(outcome.reward, family.name, "step", ep.task.id)
            ep.turns.append(_turn(prompts[i], seq, text, reward))
            for k, v in outcome.metrics.items():
                ep.metrics[k] = v
            if outcome.done:
                try:
                    final = env.episode_reward()
                except Exception as e:  # noqa: BLE001 - env code failing on the model's output
                    _raise_if_invalid_reward(e, family, ep.task)
                    _env_error(ep, env, family, e)
                    continue
                _end(ep, checked_reward(final, family.name, "episode_reward", ep.task.id), "done")
                continue
            history = histories[i]
            prompts[i] = renderer.next_prompt(prompts[i], seq, history, outcome.next_messages)
            histories[i] = history + [{"role": "assistant", "content": text}] + outcome.next_messages
            if len(prompts[i]) >= max_context:
                _end(ep, _failure_reward(env, family, ep.task), "context_limit")
                continue
            still.append(i)
        live = still
        first_turn = False
    return RolloutBatch(episodes, len(tasks), sample_s, score_s)


def _sample(
    client: Client, prompts: list[list[int]], n: int, params: SamplingParams, max_context: int
) -> list[list[SampledSequence]]:
    """n samples per prompt (callers guarantee each prompt is shorter than ``max_context``),
    each prompt's ``max_tokens`` capped to what its context leaves: one `sample` call per
    distinct cap, in order of first appearance; one call with ``params`` as given when no
    prompt needs a cap."""
    caps = [min(params.max_tokens, max_context - len(p)) for p in prompts]
    out: list[list[SampledSequence]] = [[] for _ in prompts]
    for cap in dict.fromkeys(caps):
        idx = [k for k, c in enumerate(caps) if c == cap]
        call_params = params if cap == params.max_tokens else dataclasses.replace(params, max_tokens=cap)
        result = client.sample([prompts[k] for k in idx], n=n, params=call_params)
        for k, group in zip(idx, result.groups):
            out[k] = group.samples
    return out


def _score(env: Env, text: str) -> StepResult | Exception:
    """``env.step(text)``, or the exception it raised (sorted out on the caller's thread)."""
    try:
        return env.step(text)
    except Exception as e:  # noqa: BLE001 - no model output may take the batch down
        return e


def _raise_if_invalid_reward(error: Exception, family: EnvFamily, task: Task) -> None:
    if isinstance(error, InvalidReward):
        raise error.naming(family.name, task.id) from error


def _failure_reward(env: Env, family: EnvFamily, task: Task) -> float:
    return checked_reward(env.failure_reward, family.name, "failure_reward", task.id)


def _end(ep: Episode, reward: float, stop: EpisodeStop) -> None:
    ep.reward = reward
    ep.stop_reason = stop
    ep.metrics[ENV_ERROR_METRIC] = float(stop == "env_error")
    ep.metrics[TRUNCATED_METRIC] = float(stop == "context_limit")


def _env_error(ep: Episode, env: Env, family: EnvFamily, error: Exception) -> None:
    """End ``ep`` with the env's failure reward after ``error``, logging its type once."""
    reward = _failure_reward(env, family, ep.task)
    _end(ep, reward, "env_error")
    ep.error = f"{type(error).__module__}.{type(error).__qualname__}"
    if _first_time(family, ep.error):
        log.warning(
            "environment %r raised %s on a model output (task %r): the episode gets the failure reward %s "
            "and counts in the env_error metric; further %s errors of this environment are not logged",
            family.name, ep.error, ep.task.id, reward, type(error).__name__, exc_info=error,
        )


_logged_lock = threading.Lock()
_logged: weakref.WeakKeyDictionary[EnvFamily, set[str]] = weakref.WeakKeyDictionary()


def _first_time(family: EnvFamily, kind: str) -> bool:
    """True the first time ``kind`` is reported for this family object (one per run)."""
    with _logged_lock:
        try:
            seen = _logged.setdefault(family, set())
        except TypeError:  # a family that cannot be weakly referenced: log every time
            return True
        first = kind not in seen
        seen.add(kind)
        return first


def _turn(prompt: list[int], seq: SampledSequence, text: str, reward: float) -> Turn:
    return Turn(prompt, seq.tokens, seq.logprobs, seq.weights_version, text, reward, seq.stop_reason)
