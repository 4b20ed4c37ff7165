"""floe.envs: RL environments (prompts, rewards, generated data) behind a small typed API.

Use ``make_family(name, **options)`` to get an ``EnvFamily``, ``family.tasks(split, count, seed)``
for data and ``family.make_env(task)`` for a single-use episode. ``FAMILIES`` lists the built-in
names; ``name`` may also be ``"pkg.module:Class"`` or a ``floe.envs`` entry point (see
``floe.envs.registry``). The building blocks a custom family needs are exported here too
(docs/environments.md has a complete example).
"""

from floe.envs.base import Env, EnvFamily, Message, StepResult, Task
from floe.envs.datafile import read_rows
from floe.envs.options import DataFileOptions, FamilyOptions, parse_options
from floe.envs.registry import FAMILIES, family_class, make_family, options_model, validate_options
from floe.envs.single_turn import Score, SingleTurnEnv, prompt_messages
from floe.envs.splits import family_tasks, generate_tasks, select_rows

__all__ = [
    "FAMILIES", "DataFileOptions", "Env", "EnvFamily", "FamilyOptions", "Message", "Score", "SingleTurnEnv",
    "StepResult", "Task", "family_class", "family_tasks", "generate_tasks", "make_family", "options_model",
    "parse_options", "prompt_messages", "read_rows", "select_rows", "validate_options",
]
