"""A full verifiers 0.4.0 environment (floe_count_env: taskset, rubric, multi-turn `Env`,
in-process harness) run through verifiers' own entry points (`load_environment`,
`Env.serving`, `Env.run_slot`, the same calls its eval runner and env server make) with the
real training client and the real evaluation client against a `floe serve` on loopback (marker
`verifiers`; scripts/ci/verifiers.sh). Each rollout must complete three assistant turns with
the environment's feedback in the later prompts, be scored by the taskset's rubric, and carry
per-token log-probs equal to floe's policy forward on the same tokens within 1e-4."""

from __future__ import annotations

import asyncio
import importlib
import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import floe
from tests.integrations.prime_rl.conftest import TOKEN

pytestmark = [pytest.mark.verifiers, pytest.mark.timeout(900)]

TEMPERATURE = 0.9
MAX_TOKENS = 6
TOLERANCE = 1e-4


def forward_logprobs(client: floe.Client, prompt: list[int], tokens: list[int]) -> list[float]:
    """floe's policy forward on `prompt` + `tokens`: the log-prob of each of `tokens`."""
    batch = floe.Batch([floe.Group(prompt, [floe.Sample(tokens=tokens)])])
    return list(client.forward(batch, temperature=TEMPERATURE).logprobs[0][0])


def sampled_turns(trace) -> list[tuple[list[int], list[int], list[float], str]]:
    """Each model-sampled assistant node of a training-client trace, in order, as (prompt ids,
    completion ids, sampling log-probs, reply text): the prompt is every token before the
    node's first sampled token along its branch (earlier turns, env responses, scaffold)."""
    turns, seen = [], set()
    for branch in trace.branches:
        before: list[int] = []
        for node in branch.nodes:
            if node.sampled and id(node) not in seen:
                seen.add(id(node))
                first = node.mask.index(True)
                completion = [t for t, m in zip(node.token_ids, node.mask) if m]
                assert len(completion) == len(node.logprobs)
                turns.append((before + node.token_ids[:first], completion, list(node.logprobs), node.message.content or ""))
            before = before + node.token_ids
    return turns


def check_rollout(episode, env_module, tokenizer, replies_prompts_logprobs, floe_client) -> None:
    """The checks shared by both clients: turns, env feedback in later prompts, rubric reward,
    log-probs against floe's forward."""
    assert episode.ok, episode.errors
    (trace,) = episode.traces
    assert trace.ok, trace.errors
    turns = replies_prompts_logprobs(trace)
    assert len(turns) == env_module.TURNS == trace.num_turns == len(trace.calls)
    for k, (prompt, completion, logprobs, _reply) in enumerate(turns):
        assert completion and len(completion) <= MAX_TOKENS
        if k:
            # The environment's response to the previous reply is in this turn's prompt.
            assert env_module.feedback(turns[k - 1][3].strip()) in tokenizer.decode(prompt)
        want = forward_logprobs(floe_client, prompt, completion)
        assert len(logprobs) == len(want)
        for got, ref in zip(logprobs, want):
            assert got == pytest.approx(ref, abs=TOLERANCE)
    # The conversation the trace recorded: system, prompt, then reply / feedback alternating.
    messages = trace.branches[-1].messages
    roles = [m.role for m in messages]
    assert roles == ["system", "user"] + ["assistant", "user"] * (env_module.TURNS - 1) + ["assistant"]
    for k, reply in enumerate(turns[:-1]):
        assert messages[3 + 2 * k].content == env_module.feedback(reply[3].strip())
    # The rubric's reward, recomputed from the replies.
    replies = [t[3] for t in turns]
    digits = sum(any(ch.isdigit() for ch in r) for r in replies) / len(replies)
    assert (trace.rewards["digits"].score, trace.rewards["digits"].weight) == (pytest.approx(digits), 1.0)
    assert trace.reward == pytest.approx(digits)
    assert trace.metrics["assistant_turns"] == env_module.TURNS


def test_environment_multi_turn_rollouts_train_and_eval(prime_server, monkeypatch: pytest.MonkeyPatch) -> None:
    import verifiers.v1 as vf  # noqa: PLC0415 - only in the verifiers environment

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # verifiers imports a taskset by module name
    env_module = importlib.import_module("floe_count_env")
    monkeypatch.setenv("FLOE_TEST_KEY", TOKEN)
    base = prime_server.url + "/v1"
    model = str(prime_server.model_path)
    tokenizer = AutoTokenizer.from_pretrained(model)
    floe_client = prime_server.client()

    env = vf.load_environment(vf.resolve_env_config({"taskset": {"id": "floe_count_env", "num_tasks": 2}}))
    assert type(env) is env_module.CountEnv
    tasks = list(env.taskset)
    assert len(tasks) == 2
    sampling = vf.SamplingConfig(max_tokens=MAX_TOKENS, temperature=TEMPERATURE)
    clients = {
        "train": vf.TrainClientConfig(base_url=base, api_key_var="FLOE_TEST_KEY", renderer_model_name=model),
        "eval": vf.EvalClientConfig(base_url=base, api_key_var="FLOE_TEST_KEY"),
    }

    async def rollouts(client: vf.ClientConfig) -> list:
        ctx = vf.ModelContext(model=model, client=client, sampling=sampling)
        async with env.serving():
            return [await env.run_slot(slot, ctx) for task in tasks for slot in env.slots(task)]

    def eval_turns(trace) -> list[tuple[list[int], list[int], list[float], str]]:
        """What the evaluation client relayed back to the harness, per turn."""
        out = []
        for body in env_module.RESPONSES[trace.id]:
            choice = body["choices"][0]
            lps = [c["logprob"] for c in choice["logprobs"]["content"]]
            out.append((choice["prompt_token_ids"], choice["token_ids"], lps, choice["message"]["content"] or ""))
        return out

    try:
        for name, client in clients.items():
            episodes = asyncio.run(rollouts(client))
            assert len(episodes) == len(tasks)
            for episode in episodes:
                check_rollout(episode, env_module, tokenizer, sampled_turns if name == "train" else eval_turns, floe_client)
    finally:
        floe_client.close()
        os.environ.pop("FLOE_TEST_KEY", None)
