"""floe.envs: RL environments (prompts, rewards, generated data) behind a small typed API.

Use ``make_family(name, **options)`` to get an ``EnvFamily``, ``family.tasks(split, count, seed)``
for data and ``family.make_env(task)`` for a single-use episode. ``FAMILIES`` lists the names.
"""

from floe.envs.base import Env, EnvFamily, Message, StepResult, Task
from floe.envs.registry import FAMILIES, make_family

__all__ = ["FAMILIES", "Env", "EnvFamily", "Message", "StepResult", "Task", "make_family"]
