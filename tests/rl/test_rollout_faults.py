"""Rollouts survive whatever the model writes: env errors, bad rewards, the context limit and
chat templates that write text after the end-of-turn token."""

from __future__ import annotations

import json
import logging
import math
import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from transformers import Qwen3ForCausalLM

import floe
from floe.envs import Env, EnvFamily, Message, StepResult, Task, make_family
from floe.envs.base import InvalidReward
from floe.envs.sql_extract import extract_sql
from floe.models import make_tiny
from floe.models.tiny import make_char_tokenizer
from floe.rl.advantages import build_training_batch, group_advantages
from floe.rl.config import AdvantageConfig
from floe.rl.rollouts import Renderer, run_episodes
from floe.types import SampledSequence

DEEP_JSON = "```json\n" + "[" * 1000 + "\n```"  # the completion: json.loads recursed too deep

CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# ChatML that drops <think>...</think> from assistant turns before the last user message (as
# Qwen3's template does).
CHATML_STRIP_THINK = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chatml_tokenizer(template: str = CHATML):
    """The tiny char tokenizer with ChatML markers as special tokens and <|im_end|> as eos."""
    tok = make_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = template
    return tok


def decode_kept(tok, tokens: list[int]) -> str:
    return tok.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# -- small envs whose behaviour the tests choose ------------------------------------------------


class ScriptedEnv(Env):
    """Turns of a fixed script: each step calls ``behaviour(completion)`` for the reward."""

    def __init__(self, behaviour, turns: int = 1, failure_reward: float | None = None):
        super().__init__()
        self.behaviour, self.turns = behaviour, turns
        if failure_reward is not None:
            self.failure_reward = failure_reward

    def initial_messages(self) -> list[Message]:
        return [{"role": "user", "content": "Say something."}]

    def _step(self, completion: str) -> StepResult:
        done = len(self.turn_rewards) + 1 == self.turns
        follow = [] if done else [{"role": "user", "content": "Again."}]
        return StepResult(self.behaviour(completion), done, follow, {"chars": float(len(completion))})


class ScriptedFamily(EnvFamily):
    """Task data picks the behaviour: "ok" (reward 1), "flaky" (every second env built runs
    json.loads on nesting deeper than the parser recurses: RecursionError, else reward 1), or
    a fixed returned value under "reward"."""

    name = "scripted"

    def __init__(self, turns: int = 1, failure_reward: float | None = None):
        self.turns, self.failure = turns, failure_reward
        self.built = 0

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        raise NotImplementedError  # the tests build their tasks

    def make_env(self, task: Task) -> Env:
        kind = task.data["kind"]
        self.built += 1
        if kind == "ok" or (kind == "flaky" and self.built % 2):
            behaviour = lambda c: 1.0
        elif kind == "flaky":
            behaviour = lambda c: float(len(json.loads("[" * 100_000)))
        else:
            behaviour = lambda c: task.data["reward"]
        return ScriptedEnv(behaviour, self.turns, self.failure)


def rollout(client, family, tasks, n=2, max_tokens=6, renderer=None, stop_at_eos=True, **kw):
    params = floe.SamplingParams(max_tokens=max_tokens, seed=0, stop_at_eos=stop_at_eos)
    with ThreadPoolExecutor(2) as pool:
        return run_episodes(client, family, tasks, n, params,
                            renderer or Renderer(client.tokenizer()), pool, **kw)


# -- fault 3: an env that raises on a model output ----------------------------------------------


@pytest.fixture(scope="module")
def sql_family(tmp_path_factory):
    fam = make_family("text2sql", db_dir=str(tmp_path_factory.mktemp("dbs")), timeout_s=1.0, row_cap=100)
    yield fam
    fam.close()


def test_text2sql_scores_deeply_nested_json_as_no_sql(sql_family):
    assert extract_sql(DEEP_JSON) is None
    task = sql_family.tasks("train", 1, 0)[0]
    result = sql_family.make_env(task).step(DEEP_JSON)
    assert result.reward == 0.0 and result.done
    assert result.metrics["sql_found"] == 0.0


def test_env_error_gives_failure_reward_counts_and_logs_once(make_client, caplog):
    client = make_client()
    family = ScriptedFamily(failure_reward=-0.5)
    tasks = [Task("fine", {"kind": "ok"}), Task("flaky", {"kind": "flaky"})]
    with caplog.at_level(logging.WARNING, logger="floe.rl.rollouts"):
        first = rollout(client, family, tasks, n=2)
        second = rollout(client, family, tasks, n=2)
    for out in (first, second):
        assert len(out.episodes) == 4  # nothing lost
        fine, (good, failed) = out.by_group()
        for ep in fine + [good]:
            assert ep.stop_reason == "done" and ep.error is None and ep.reward == 1.0
            assert ep.metrics["env_error"] == 0.0 and ep.metrics["truncated"] == 0.0
            assert ep.metrics["chars"] == float(len(ep.turns[0].text))
        assert failed.stop_reason == "env_error" and failed.error == "builtins.RecursionError"
        assert failed.reward == -0.5 and [t.reward for t in failed.turns] == [-0.5]
        assert failed.metrics == {"env_error": 1.0, "truncated": 0.0}
        assert len(failed.turns[0].tokens) > 0  # the sampled turn is kept, to train on
    logged = [r for r in caplog.records if "RecursionError" in r.getMessage()]
    assert len(logged) == 1  # once per exception type, not per episode or per step
    assert "'scripted'" in logged[0].getMessage() and logged[0].exc_info is not None
    # The failed episode trains with its failure reward: the batch builds and is accepted.
    batch, dropped = build_training_batch(first.by_group(), AdvantageConfig(drop_constant_groups=False))
    assert dropped == 0 and batch.num_samples == 4
    assert [s.advantage for g in batch.groups for s in g.samples] == [0.0, 0.0, 0.75, -0.75]
    assert math.isfinite(client.forward_backward(batch, "importance_sampling").metrics["loss"])


def test_failure_reward_must_be_finite(make_client):
    family = ScriptedFamily(failure_reward=float("nan"))
    with pytest.raises(InvalidReward, match="failure_reward"):
        rollout(make_client(), family, [Task("flaky", {"kind": "flaky"})], n=2)


# -- fault 4: rewards that are not finite numbers ------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), None, "1.0", [1.0]])
def test_non_finite_reward_is_rejected_naming_env_and_task(make_client, value):
    tasks = [Task("good", {"kind": "ok"}), Task("task-7", {"kind": "fixed", "reward": value})]
    with pytest.raises(InvalidReward) as e:
        rollout(make_client(), ScriptedFamily(), tasks)
    err = e.value
    assert (err.env, err.task, err.where) == ("scripted", "task-7", "step")
    assert "'scripted'" in str(err) and "'task-7'" in str(err) and repr(value) in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is InvalidReward and str(again) == str(err)
    assert (again.env, again.task, again.where, again.value) == (err.env, err.task, err.where, err.value)


def test_episode_reward_is_checked_too(make_client):
    class NanEpisodeFamily(ScriptedFamily):
        def make_env(self, task: Task) -> Env:
            env = ScriptedEnv(lambda c: 1.0)
            env.episode_reward = lambda: float("nan")  # type: ignore[method-assign]
            return env

    with pytest.raises(InvalidReward) as e:
        rollout(make_client(), NanEpisodeFamily(), [Task("t0", {"kind": "ok"})])
    assert (e.value.env, e.value.task, e.value.where) == ("scripted", "t0", "episode_reward")


def test_finite_reward_types_are_accepted(make_client):
    tasks = [Task(str(v), {"kind": "fixed", "reward": v}) for v in (True, 2, 0.25, np.float32(0.5), np.int64(3))]
    out = rollout(make_client(), ScriptedFamily(), tasks, n=1)
    assert [e.reward for e in out.episodes] == [1.0, 2.0, 0.25, 0.5, 3.0]
    assert all(type(e.reward) is float for e in out.episodes)


@pytest.mark.parametrize("scale_std", [False, True])
def test_group_advantages_reject_non_finite_rewards(scale_std):
    cfg = AdvantageConfig(scale_std=scale_std)
    with pytest.raises(floe.InvalidInput) as e:
        group_advantages([1.0, float("nan"), 0.0, 1.0], cfg)
    assert e.value.field == "rewards[1]" and "finite" in e.value.message
    with pytest.raises(floe.InvalidInput) as e:
        group_advantages([0.0, 1.0, float("-inf")], cfg)
    assert e.value.field == "rewards[2]"
    with pytest.raises(floe.InvalidInput, match="at least one"):
        group_advantages([], cfg)
    # Finite rewards keep their exact values.
    assert group_advantages([1.0, 0.0, 0.5, 0.5], AdvantageConfig()) == [0.5, -0.5, 0.0, 0.0]


# -- fault 5: the context limit ------------------------------------------------------------------


def test_multi_turn_episodes_end_at_the_context_limit_and_training_continues(make_client):
    # The case: tiny Qwen3 with a 1024-token context, 3 turns of 5 names.
    # The random model's end-of-turn token would end some turns early (how many depends on the
    # draws); without it every turn runs its full budget, so both cases happen by design: with
    # 200 tokens the third prompt no longer fits (context_limit after 2 turns), with 150 the
    # third turn gets only the room that is left (capped, the episode completes).
    client = make_client()
    assert client.info().max_context == 1024
    family = make_family("alphabet_sort", min_turns=3, max_turns=3, min_names_per_turn=5, max_names_per_turn=5)
    outs = {m: rollout(client, family, family.tasks("train", 2, 0), n=2, max_tokens=m, stop_at_eos=False)
            for m in (200, 150)}
    assert [e.stop_reason for e in outs[200].episodes] == ["context_limit"] * 4
    assert [e.stop_reason for e in outs[150].episodes] == ["done"] * 4
    capped = 0
    for max_tokens, out in outs.items():
        for ep in out.episodes:
            for turn in ep.turns:
                room = 1024 - len(turn.prompt)
                assert len(turn.tokens) == min(max_tokens, room)
                capped += room < max_tokens  # a turn that got the remaining budget only
            if ep.stop_reason == "context_limit":
                assert len(ep.turns) < 3 and ep.reward == 0.0 and ep.metrics["truncated"] == 1.0
                assert ep.metrics["env_error"] == 0.0
            else:
                assert len(ep.turns) == 3 and ep.metrics["truncated"] == 0.0
                assert ep.reward == pytest.approx(sum(t.reward for t in ep.turns) / 3)
    assert capped == 4
    for out in outs.values():
        batch, _ = build_training_batch(out.by_group(), AdvantageConfig(drop_constant_groups=False))
        res = client.forward_backward(batch, "importance_sampling")
        assert res.metrics["tokens"] == sum(len(t.tokens) for e in out.episodes for t in e.turns)


def test_opening_prompt_that_cannot_fit_names_the_task(make_client):
    family = make_family("alphabet_sort", min_turns=1, max_turns=1, min_names_per_turn=5, max_names_per_turn=5)
    tasks = family.tasks("train", 2, 0)
    with pytest.raises(floe.InvalidInput) as e:
        rollout(make_client(), family, tasks, max_context=100)
    assert e.value.field == "tasks[0]" and "alphabet_sort" in str(e.value) and tasks[0].id in str(e.value)


# -- fault 6: multi-turn prompts follow the chat template -----------------------------------------


def _seq(tokens: list[int], stop_reason: str) -> SampledSequence:
    return SampledSequence(tokens, [-1.0] * len(tokens), stop_reason, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("stopped", [True, False])
def test_next_prompt_equals_the_chatml_rendering(stopped):
    tok = chatml_tokenizer()
    renderer = Renderer(tok)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort: b, a"}]
    new = [{"role": "user", "content": "Add c."}]
    prompt = renderer.render(history)
    reply = "a\nb"
    sampled = encode(tok, reply) + ([tok.eos_token_id] if stopped else [])
    got = renderer.next_prompt(prompt, _seq(sampled, "stop_token" if stopped else "length"), history, new)
    convo = history + [{"role": "assistant", "content": reply}] + new
    expected = encode(tok, tok.apply_chat_template(convo, add_generation_prompt=True, tokenize=False))
    assert got == expected
    assert "<|im_end|>\n<|im_start|>user\nAdd c." in decode_kept(tok, got)
    assert got[: len(prompt) + len(sampled)] == prompt + sampled  # sampled tokens verbatim


def test_next_prompt_equals_the_tiny_template_rendering():
    tok = make_char_tokenizer()
    renderer = Renderer(tok)
    history = [{"role": "user", "content": "Hi"}]
    new = [{"role": "user", "content": "More"}]
    for sampled, stop in ((encode(tok, "yo") + [tok.eos_token_id], "stop_token"), (encode(tok, "yo"), "length")):
        got = renderer.next_prompt(renderer.render(history), _seq(sampled, stop), history, new)
        convo = history + [{"role": "assistant", "content": "yo"}] + new
        assert got == encode(tok, tok.apply_chat_template(convo, add_generation_prompt=True, tokenize=False))


def test_history_rewriting_template_keeps_sampled_tokens_verbatim():
    tok = chatml_tokenizer(CHATML_STRIP_THINK)
    renderer = Renderer(tok)
    history = [{"role": "user", "content": "Q1"}]
    new = [{"role": "user", "content": "Q2"}]
    reply = "<think>hmm</think>A1"
    sampled = encode(tok, reply) + [tok.eos_token_id]
    prompt = renderer.render(history)
    got = renderer.next_prompt(prompt, _seq(sampled, "stop_token"), history, new)
    # The policy sees (and is trained on) exactly what it sampled, reasoning included ...
    assert got == prompt + sampled + encode(tok, "\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n")
    assert "<think>hmm</think>A1<|im_end|>\n<|im_start|>user" in decode_kept(tok, got)
    # ... where the template itself would have dropped the earlier <think> block.
    convo = history + [{"role": "assistant", "content": reply}] + new
    assert "<think>" not in tok.apply_chat_template(convo, add_generation_prompt=True, tokenize=False)


@pytest.fixture(scope="module")
def chatml_model(tmp_path_factory) -> Path:
    """The tiny Qwen3 with the ChatML tokenizer (embeddings grown for its two new tokens)."""
    path = make_tiny(tmp_path_factory.mktemp("models") / "chatml", hidden_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    tok = chatml_tokenizer()
    model = Qwen3ForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(len(tok))
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def test_multi_turn_prompts_match_the_chatml_template_end_to_end(chatml_model, tmp_path):
    client = floe.connect(floe.BackendConfig(model=str(chatml_model), state_dir=str(tmp_path / "s")))
    try:
        tok = client.tokenizer()
        assert tok.eos_token == "<|im_end|>"
        out = rollout(client, ScriptedFamily(turns=3), [Task("t", {"kind": "ok"})], n=4, max_tokens=8)
    finally:
        client.close()
    for ep in out.episodes:
        assert len(ep.turns) == 3
        convo: list[Message] = [{"role": "user", "content": "Say something."}]
        for k, turn in enumerate(ep.turns):
            expected = encode(tok, tok.apply_chat_template(convo, add_generation_prompt=True, tokenize=False))
            assert turn.prompt == expected, f"turn {k + 1}"
            content = turn.tokens[:-1] if turn.tokens[-1] == tok.eos_token_id else turn.tokens
            convo = convo + [{"role": "assistant", "content": decode_kept(tok, content)},
                             {"role": "user", "content": "Again."}]
        assert "<|im_end|>\n<|im_start|>user\nAgain." in decode_kept(tok, ep.turns[2].prompt)
        assert ep.stop_reason == "done"
