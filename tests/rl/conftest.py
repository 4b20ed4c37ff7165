"""A tiny, fast recipe for loop tests: small model, no warm start, a few short steps."""

from __future__ import annotations

import pytest

TINY_RECIPE = """
[model.tiny]
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1
max_position_embeddings = 256

[env]
name = "reverse_text"
options = {{ min_length = 2, max_length = 4, system_prompt = false, instruction = "Reverse:" }}

[backend]
optimizer = {{ lr = 1e-3 }}

[train]
steps = {steps}
groups_per_step = 3
samples_per_group = 4
max_tokens = 12
max_off_policy_steps = {async_k}
advantage = {{ drop_constant_groups = false }}

[eval]
every = 2
size = 4

[output]
run_dir = "{run_dir}"
checkpoint_every = 2
progress = false
"""


@pytest.fixture
def recipe_file(tmp_path, monkeypatch):
    """Write a recipe TOML and return its path; FLOE_CACHE points into tmp_path."""
    monkeypatch.setenv("FLOE_CACHE", str(tmp_path / "cache"))

    def write(steps: int = 4, async_k: int = 0, name: str = "run") -> str:
        path = tmp_path / f"{name}.toml"
        path.write_text(TINY_RECIPE.format(steps=steps, async_k=async_k, run_dir=tmp_path / name))
        return str(path)

    return write
