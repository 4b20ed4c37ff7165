"""Held-out evaluation (mean reward, pass@k, maj@k) and the readable record of an episode.

`evaluate` runs `eval.samples_per_task` episodes per held-out task. Besides the mean reward and
the env's metrics it reports, when a task gets k > 1 episodes:

* ``eval/pass@k``: the fraction of tasks where at least one of the k episodes passes
  (reward >= `eval.pass_reward`, default 1.0);
* ``eval/maj@k``: the fraction of tasks whose majority answer passes. An episode's answer is
  its completions' text, stripped of surrounding whitespace; the most frequent answer wins (a
  tie goes to the one seen first) and counts with the reward of its first episode.

`rollout_record` is one line of rollouts.jsonl: the task, its prompt and target, every turn's
completion, reward and stop reason, and why the episode ended.
"""

from __future__ import annotations

import statistics
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from floe.client import Client
from floe.envs import EnvFamily, Task
from floe.envs.demonstrations import DEMONSTRATIONS, demonstration
from floe.rl.config import Recipe
from floe.rl.rollouts import Episode, Renderer, run_episodes
from floe.types import SamplingParams


def evaluate(client: Client, family: EnvFamily, tasks: list[Task], recipe: Recipe, renderer: Renderer,
             scorer: ThreadPoolExecutor) -> dict[str, float]:
    """Held-out metrics: ``eval/reward_mean``, ``eval/reward_std``, ``eval/<env metric>`` and,
    with ``samples_per_task`` = k > 1, ``eval/pass@k`` and ``eval/maj@k`` (module docstring)."""
    ev = recipe.eval
    params = SamplingParams(
        max_tokens=ev.max_tokens or recipe.train.max_tokens,
        temperature=ev.temperature,
        top_k=1 if ev.greedy else 0,
        seed=ev.seed,
    )
    rollouts = run_episodes(client, family, tasks, ev.samples_per_task, params, renderer, scorer)
    rewards = [e.reward for e in rollouts.episodes]
    out = {"eval/reward_mean": statistics.fmean(rewards), "eval/reward_std": statistics.pstdev(rewards)}
    for key in sorted({k for e in rollouts.episodes for k in e.metrics}):
        out[f"eval/{key}"] = statistics.fmean(e.metrics.get(key, 0.0) for e in rollouts.episodes)
    k = ev.samples_per_task
    if k > 1:
        out.update(pass_and_majority(rollouts.by_group(), ev.pass_reward))
    return out


def pass_and_majority(groups: list[list[Episode]], pass_reward: float) -> dict[str, float]:
    """{"eval/pass@k": ..., "eval/maj@k": ...} over groups of k episodes each (one group per task)."""
    k = len(groups[0])
    passed = [any(e.reward >= pass_reward for e in g) for g in groups]
    majority = []
    for group in groups:
        answers = [answer_text(e) for e in group]
        top, _ = Counter(answers).most_common(1)[0]  # Counter keeps first-seen order among ties
        majority.append(group[answers.index(top)].reward >= pass_reward)
    return {f"eval/pass@{k}": statistics.fmean(passed), f"eval/maj@{k}": statistics.fmean(majority)}


def answer_text(episode: Episode) -> str:
    """An episode's answer for majority voting: its completions, stripped, joined by newlines."""
    return "\n".join(t.text.strip() for t in episode.turns)


def task_target(family_name: str, task: Task) -> Any:
    """What a task expects, for people reading rollouts: its data's ``target`` (or ``gold_sql``),
    else the env's demonstration, else None."""
    for key in ("target", "gold_sql"):
        if key in task.data:
            return task.data[key]
    if family_name in DEMONSTRATIONS:
        return demonstration(family_name, task)
    return None


def rollout_record(step: int, episode: Episode, renderer: Renderer, family_name: str) -> dict[str, Any]:
    """One rollouts.jsonl line: step, task id, prompt (the first turn's prompt as text, special
    tokens kept), target, reward, stop_reason and error of the episode, and its turns."""
    first = episode.turns[0].prompt if episode.turns else []
    return {
        "step": step,
        "task": episode.task.id,
        "prompt": renderer.tokenizer.decode(first, skip_special_tokens=False),
        "target": task_target(family_name, episode.task),
        "reward": episode.reward,
        "stop_reason": episode.stop_reason,
        "error": episode.error,
        "turns": [{"completion": t.text, "reward": t.reward, "stop_reason": t.stop_reason} for t in episode.turns],
    }
