"""A GSM8K environment with a shaped reward, for the SkyRL plugin's end-to-end runs.

A random tiny model never writes the right "#### <answer>", so the stock gsm8k reward is 0 for
every sample and GRPO's advantages would all be 0. This env scores skyrl-gym's own GSM8K
reward plus 0.5 x the fraction of the response's characters that are digits: a reward that
depends on what the model wrote. Importing this module registers it as "gsm8k_shaped"
(the run passes it through the plugin's ``floe.import_modules``).
"""

from __future__ import annotations

from skyrl_gym.envs.gsm8k.env import GSM8kEnv
from skyrl_gym.envs.registration import register, registry


class ShapedGSM8kEnv(GSM8kEnv):
    def _get_reward(self, action: str) -> float:
        digits = sum(c.isdigit() for c in action) / max(1, len(action))
        return super()._get_reward(action) + 0.5 * digits


if "gsm8k_shaped" not in registry:
    register(id="gsm8k_shaped", entry_point="tests.integrations.skyrl.shaped_env:ShapedGSM8kEnv")
