"""GRPO helpers on the public API: group-relative advantages and the training batch of a sample call.

A = r - mean(r of the group) (GRPO / Dr. GRPO), optionally divided by the group's population
std + eps. Groups whose rewards are all equal carry no signal and are dropped by default.
floe's own RL loop (`floe.rl.advantages`) computes its advantages with `group_advantages`.

A GRPO step with these helpers (docs/examples/grpo_script.py runs it):

    out = client.sample(prompts, n=8, params=floe.SamplingParams(temperature=0.7))
    rewards = [[reward(g.prompt, s.tokens) for s in g.samples] for g in out.groups]
    batch = floe.grpo.batch_from_samples(out, rewards)
    if batch.groups:
        client.forward_backward(batch, "ppo")   # scored at the samples' temperature, 0.7
        client.optim_step()
        client.sync_weights()
"""

from __future__ import annotations

import math
import numbers
import statistics
from collections.abc import Sequence

from floe.errors import InvalidInput
from floe.types import Batch, Group, Sample, SampleResult


def group_advantages(
    rewards: Sequence[float], *, scale_std: bool = False, drop_constant_groups: bool = True, eps: float = 1e-6
) -> list[float] | None:
    """Advantages of one group, one per reward in the same order, or None when the group is
    dropped (`drop_constant_groups` and every reward equal within 1e-12).

    scale_std: divide by the group's population std + `eps` (skipped for a group of one).
    Defaults are those of the RL recipe's [train.advantages]. Raises InvalidInput naming
    `rewards` when the list is empty and `rewards[i]` when a reward is not a finite real
    number (NaN would turn the whole group's advantages into NaN).
    """
    _check_rewards(rewards, "rewards")
    if drop_constant_groups and max(rewards) - min(rewards) < 1e-12:
        return None
    mean = statistics.fmean(rewards)
    adv = [r - mean for r in rewards]
    if scale_std and len(rewards) > 1:
        std = statistics.pstdev(rewards)
        adv = [a / (std + eps) for a in adv]
    return adv


def _check_rewards(rewards: Sequence[float], field: str) -> None:
    if not rewards:
        raise InvalidInput(field, "a group needs at least one reward")
    for i, r in enumerate(rewards):
        if not isinstance(r, numbers.Real) or not math.isfinite(r):
            raise InvalidInput(f"{field}[{i}]", f"must be a finite real number, got {r!r}")


def batch_from_samples(
    result: SampleResult,
    rewards: Sequence[Sequence[float]],
    *,
    scale_std: bool = False,
    drop_constant_groups: bool = True,
    eps: float = 1e-6,
) -> Batch:
    """The training batch of one `client.sample` result and its rewards.

    rewards[i][j] is the reward of `result.groups[i].samples[j]`. Each group becomes one
    `floe.Group` (its prompt once) whose samples carry their tokens, sampling log-probs,
    temperature and group-relative advantage (`group_advantages` with the same keywords), so
    the batch is ready for `forward_backward` with a ratio loss ("ppo", "cispo",
    "importance_sampling", "gspo"), which then scores at the samples' temperature. Dropped
    groups are left out: the batch may have no groups when every group is constant, so check
    `batch.groups` before training on it. Raises InvalidInput naming `rewards` or
    `rewards[i]` when the shape does not match the result, `rewards[i][j]` for a reward
    that is not a finite number, and `result` for something that is not a SampleResult.
    """
    if not isinstance(result, SampleResult):
        raise InvalidInput("result", f"must be the floe.SampleResult of client.sample, got {type(result).__name__}")
    if isinstance(rewards, (str, bytes)) or not isinstance(rewards, Sequence) or len(rewards) != len(result.groups):
        got = len(rewards) if isinstance(rewards, Sequence) else type(rewards).__name__
        raise InvalidInput("rewards", f"must hold one list of rewards per group ({len(result.groups)}), got {got}")
    groups = []
    for i, (group, group_rewards) in enumerate(zip(result.groups, rewards)):
        if not isinstance(group_rewards, Sequence) or len(group_rewards) != len(group.samples):
            got = len(group_rewards) if isinstance(group_rewards, Sequence) else type(group_rewards).__name__
            raise InvalidInput(f"rewards[{i}]", f"must hold one reward per sample ({len(group.samples)}), got {got}")
        _check_rewards(group_rewards, f"rewards[{i}]")
        adv = group_advantages(group_rewards, scale_std=scale_std, drop_constant_groups=drop_constant_groups, eps=eps)
        if adv is None:
            continue
        samples = [
            Sample(list(s.tokens), logprobs=list(s.logprobs), advantage=a, temperature=s.temperature)
            for s, a in zip(group.samples, adv)
        ]
        groups.append(Group(list(group.prompt), samples))
    return Batch(groups)
