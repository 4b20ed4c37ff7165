"""Loop building blocks: advantages, multi-turn rollouts, recipes and CLI parsing, warm start."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import floe
from floe.cli import load_recipe, main
from floe.config import split_recipe_args
from floe.envs import make_family
from floe.rl.advantages import build_training_batch, group_advantages
from floe.rl.config import AdvantageConfig, Recipe
from floe.rl.rollouts import Episode, Renderer, Turn, run_episodes
from floe.rl.warmstart import prepare_model


def test_group_advantages():
    cfg = AdvantageConfig()
    assert group_advantages([1.0, 0.0, 0.5, 0.5], cfg) == [0.5, -0.5, 0.0, 0.0]
    assert group_advantages([0.3, 0.3], cfg) is None
    assert group_advantages([0.3, 0.3], AdvantageConfig(drop_constant_groups=False)) == [0.0, 0.0]
    scaled = group_advantages([1.0, 0.0], AdvantageConfig(scale_std=True))
    assert all(math.isclose(abs(a), 1.0, rel_tol=1e-5) for a in scaled)


def _episode(group: int, prompt: list[int], rewards: list[float], reward: float) -> Episode:
    turns = [Turn(prompt + [k], [5, 6], [-1.0, -1.0], 0, "x", r) for k, r in enumerate(rewards)]
    turns[0].prompt = prompt
    return Episode(task=None, group=group, turns=turns, reward=reward)  # type: ignore[arg-type]


def test_training_batch_shares_first_turn_prompt_and_splits_later_turns():
    groups = [[_episode(0, [1, 2], [1.0, 0.0], 1.0), _episode(0, [1, 2], [0.0, 0.0], 0.0)],
              [_episode(1, [3], [0.5], 0.5), _episode(1, [3], [0.5], 0.5)]]
    batch, dropped = build_training_batch(groups, AdvantageConfig())
    assert dropped == 1
    assert [g.prompt for g in batch.groups] == [[1, 2], [1, 2, 1], [1, 2, 1]]
    assert [len(g.samples) for g in batch.groups] == [2, 1, 1]
    assert [s.advantage for g in batch.groups for s in g.samples] == [0.5, -0.5, 0.5, -0.5]


def test_multi_turn_rollouts_extend_prompts_with_tokens(make_client):
    client = make_client()
    family = make_family("alphabet_sort", min_turns=2, max_turns=2, max_names_per_turn=2)
    tasks = family.tasks("train", 2, seed=0)
    renderer = Renderer(client.tokenizer())
    with ThreadPoolExecutor(2) as pool:
        out = run_episodes(client, family, tasks, 3, floe.SamplingParams(max_tokens=10, seed=0), renderer, pool)
    assert len(out.episodes) == 6 and out.num_groups == 2
    for ep in out.episodes:
        assert len(ep.turns) == 2
        first, second = ep.turns
        # The second prompt continues the first prompt and completion token for token.
        assert second.prompt[: len(first.prompt)] == first.prompt
        assert second.prompt[len(first.prompt) : len(first.prompt) + len(first.tokens)] == first.tokens
        text = client.tokenizer().decode(second.prompt)
        assert text.endswith("<|assistant|>") and "Add these names" in text
        assert ep.reward == pytest.approx((first.reward + second.reward) / 2)


def test_recipe_errors_name_the_key(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('[model]\npath = "m"\n[train]\nstepz = 3\n')
    with pytest.raises(floe.InvalidInput) as e:
        load_recipe([str(path)])
    assert e.value.field == "recipe.train.stepz"
    path.write_text('[model]\npath = "m"\n[backend]\noptimizer = { lrr = 1 }\n')
    with pytest.raises(floe.InvalidInput, match="lrr"):
        load_recipe([str(path)])
    path.write_text('[model]\npath = "m"\n[model.tiny]\nhidden_size = 8\n')
    with pytest.raises(floe.InvalidInput, match="exactly one"):
        load_recipe([str(path)])
    assert main(["train", str(path)]) == 2  # the CLI reports it and exits non-zero


def test_cli_layers_and_overrides(tmp_path):
    base = tmp_path / "base.toml"
    base.write_text('[model]\npath = "m"\n[train]\nsteps = 3\n')
    over = tmp_path / "over.toml"
    over.write_text('[train]\nmax_off_policy_steps = 1\n')
    files, overrides, rest = split_recipe_args([str(base), "@", str(over), "--train.steps", "9",
                                                "--train.loss.clip_high=0.3", "--resume"])
    assert files == [str(base), str(over)] and rest == ["--resume"]
    assert overrides == {"train.steps": 9, "train.loss.clip_high": 0.3}
    recipe, _ = load_recipe([str(base), "@", str(over), "--train.steps", "9"])
    assert isinstance(recipe, Recipe) and recipe.train.steps == 9 and recipe.train.max_off_policy_steps == 1


def test_help_documents_options(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--resume" in out and "@ OVERLAY.toml" in out and "--section.key" in out


def test_warm_start_is_cached_and_rebuilt_when_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOE_CACHE", str(tmp_path / "cache"))
    recipe = Recipe.model_validate({
        "model": {"tiny": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "num_key_value_heads": 1}},
        "warm_start": {"steps": 3, "batch_size": 4},
        "env": {"name": "reverse_text", "options": {"instruction": "Reverse:"}},
    })
    calls = []
    path = prepare_model(recipe, lambda step, total, loss: calls.append(step))
    assert calls == [1, 2, 3]
    marker = (tmp_path / "cache").rglob("floe_model_spec.json")
    assert len(list(marker)) == 1
    assert prepare_model(recipe, lambda *a: calls.append("again")) == path and calls == [1, 2, 3]
    import shutil

    shutil.rmtree(path)
    assert prepare_model(recipe) == path
    # The cached model is an ordinary HF directory that a backend loads.
    client = floe.connect(floe.BackendConfig(model=path, state_dir=str(tmp_path / "s")))
    assert client.info().vocab_size == 105


def test_truncate_on_resume_keeps_checkpointed_steps_and_drops_a_torn_line(tmp_path):
    from floe.rl.metrics import read_jsonl, truncate_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "r": 0.5}\n{"step": 2}\n{"step": 3, "r": 0.')  # killed mid-append
    truncate_jsonl(path, 1)
    assert read_jsonl(path) == [{"step": 0}, {"step": 1, "r": 0.5}]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left


def test_the_warm_start_cache_key_holds_the_code_that_built_it(tmp_path, monkeypatch):
    """Issue 23 item 6: a cache entry built by other code (another floe source, another torch)
    is never reused, so an empty cache and a cached entry always mean the same model."""
    import torch

    from floe.rl import warmstart

    monkeypatch.setenv("FLOE_CACHE", str(tmp_path / "cache"))
    recipe = Recipe.model_validate({"model": {"tiny": {"hidden_size": 16, "intermediate_size": 32,
                                                       "num_hidden_layers": 1, "num_attention_heads": 2,
                                                       "num_key_value_heads": 1}},
                                    "env": {"name": "reverse_text"}})
    spec = warmstart.model_spec(recipe)
    assert spec["built_by"] == {"floe_source": warmstart.source_digest(), "torch": torch.__version__}
    other_code = {**spec, "built_by": {**spec["built_by"], "floe_source": "0" * 16}}
    other_torch = {**spec, "built_by": {**spec["built_by"], "torch": "2.0.0"}}
    assert len({warmstart.cache_entry(s) for s in (spec, other_code, other_torch)}) == 3
    path = warmstart.prepare_model(recipe)
    assert Path(path) == warmstart.cache_entry(spec)
    assert json.loads((Path(path) / "floe_model_spec.json").read_text()) == spec
