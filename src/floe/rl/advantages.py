"""Group-relative advantages and the training batch they become.

A = r - mean(r of the group) (GRPO / Dr. GRPO), optionally divided by the group's std + eps,
computed by the public `floe.grpo.group_advantages` with the recipe's [train.advantages].
Groups whose rewards are all equal carry no signal and can be dropped. Every turn of an
episode gets the episode's advantage; a group's first turns share its prompt, so they form one
`floe.Group` (the prompt is sent and computed once); later turns of multi-turn episodes have
their own prompts and become groups of one.
"""

from __future__ import annotations

from floe import grpo
from floe.rl.config import AdvantageConfig
from floe.rl.rollouts import Episode
from floe.types import Batch, Group, Sample


def group_advantages(rewards: list[float], cfg: AdvantageConfig) -> list[float] | None:
    """Advantages for one group (one per reward, same order), or None when the group should be
    dropped. Raises InvalidInput naming ``rewards[i]`` when the list is empty or a reward is
    not a finite real number (NaN would turn the whole group's advantages into NaN)."""
    return grpo.group_advantages(
        rewards, scale_std=cfg.scale_std, drop_constant_groups=cfg.drop_constant_groups, eps=cfg.eps
    )


def build_training_batch(groups: list[list[Episode]], cfg: AdvantageConfig) -> tuple[Batch, int]:
    """The batch for forward_backward and the number of groups dropped as constant."""
    out: list[Group] = []
    dropped = 0
    for episodes in groups:
        adv = group_advantages([e.reward for e in episodes], cfg)
        if adv is None:
            dropped += 1
            continue
        first = [Sample(e.turns[0].tokens, logprobs=e.turns[0].logprobs, advantage=a) for e, a in zip(episodes, adv)]
        out.append(Group(episodes[0].turns[0].prompt, first))
        for e, a in zip(episodes, adv):
            for turn in e.turns[1:]:
                out.append(Group(turn.prompt, [Sample(turn.tokens, logprobs=turn.logprobs, advantage=a)]))
    return Batch(out), dropped
