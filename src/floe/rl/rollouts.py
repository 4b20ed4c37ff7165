"""Rollouts: run environment episodes with the backend's sampler, token ids all the way.

Text exists only where the environment needs it: the opening messages are rendered once with
the tokenizer's chat template, the env reads each completion as decoded text, and a later
turn's prompt is the previous prompt tokens + the completion tokens + the rendered new
messages, so no completion is ever re-tokenised.

An `Episode` keeps every turn (prompt tokens, completion tokens, sampler log-probs and the
weights version that produced it) and the env's rewards.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from floe.client import Client
from floe.envs import Env, EnvFamily, Message, Task
from floe.types import SampledSequence, SamplingParams


@dataclass
class Turn:
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    weights_version: int
    text: str
    reward: float


@dataclass
class Episode:
    task: Task
    group: int  # index of the group (task) in its batch
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


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


class Renderer:
    """Chat messages -> prompt token ids with the tokenizer's chat template."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def render(self, messages: list[Message]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def continuation(self, history: list[Message], new: list[Message]) -> list[int]:
        """Tokens that follow an assistant turn to open the next one: render(history + new)
        minus render(history), where history ends with the assistant's message."""
        before = self.tokenizer.apply_chat_template(history, tokenize=False)
        after = self.tokenizer.apply_chat_template(history + new, add_generation_prompt=True, tokenize=False)
        if not after.startswith(before):
            raise ValueError("the chat template does not render conversations prefix-consistently")
        return self.tokenizer.encode(after[len(before) :], add_special_tokens=False)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


def run_episodes(
    client: Client,
    family: EnvFamily,
    tasks: list[Task],
    n: int,
    params: SamplingParams,
    renderer: Renderer,
    scorer: ThreadPoolExecutor,
) -> RolloutBatch:
    """n episodes per task, all turns. Each turn is one `sample` call for every live episode."""
    envs: list[Env] = []
    episodes: list[Episode] = []
    for g, task in enumerate(tasks):
        for _ in range(n):
            envs.append(family.make_env(task))
            episodes.append(Episode(task, g))
    histories = [env.initial_messages() for env in envs]
    first_prompts = [renderer.render(histories[g * n]) for g in range(len(tasks))]
    prompts = [first_prompts[i // n] for i in range(len(envs))]
    live = list(range(len(envs)))
    sample_s = score_s = 0.0
    first_turn = True
    eos = renderer.tokenizer.eos_token_id
    while live:
        t0 = time.perf_counter()
        if first_turn:  # one prompt per task, n samples each: the prompt is prefilled once
            out = client.sample(first_prompts, n=n, params=params)
            seqs = [s for g in out.groups for s in g.samples]
        else:
            out = client.sample([prompts[i] for i in live], n=1, params=params)
            seqs = [g.samples[0] for g in out.groups]
        t1 = time.perf_counter()
        texts = [renderer.decode(s.tokens) for s in seqs]
        results = list(scorer.map(lambda it: envs[it[0]].step(it[1]), zip(live, texts)))
        score_s += time.perf_counter() - t1
        sample_s += t1 - t0
        still = []
        for i, seq, text, res in zip(live, seqs, texts, results):
            episodes[i].turns.append(_turn(prompts[i], seq, text, res.reward))
            for k, v in res.metrics.items():
                episodes[i].metrics[k] = v
            if res.done:
                episodes[i].reward = envs[i].episode_reward()
                continue
            history = histories[i] + [{"role": "assistant", "content": text}]
            ended = seq.tokens if seq.tokens and seq.tokens[-1] == eos else seq.tokens + [eos]
            prompts[i] = prompts[i] + ended + renderer.continuation(history, res.next_messages)
            histories[i] = history + res.next_messages
            still.append(i)
        live = still
        first_turn = False
    return RolloutBatch(episodes, len(tasks), sample_s, score_s)


def _turn(prompt: list[int], seq: SampledSequence, text: str, reward: float) -> Turn:
    return Turn(prompt, seq.tokens, seq.logprobs, seq.weights_version, text, reward)
