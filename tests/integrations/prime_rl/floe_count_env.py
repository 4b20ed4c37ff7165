"""A multi-turn verifiers 0.4.0 environment, written against the real `verifiers.v1` API, that
the `verifiers` suite and the prime-rl orchestrator run (scripts/prime_rl/) play against a
`floe serve` on loopback. Imports only verifiers (it also loads in prime-rl's own Python 3.12
environment), and resolves by the top-level id `floe_count_env` (verifiers imports a taskset by
module name: put this directory on `sys.path` / PYTHONPATH).

verifiers 0.4.0 has no `MultiTurnEnv`: an environment is a `vf.Env` whose `run(task, agents)`
drives an agent's `interaction`, one `turn(user_message)` per environment response (the old
`env_response`), a `vf.Taskset` (the dataset) yielding `vf.Task`s whose `@vf.reward` methods are
the rubric, and a `vf.Harness` — the program whose model calls go through verifiers'
interception server to the run's client (training: token-in/token-out `/inference/v1/generate`;
eval: relayed `/v1/chat/completions`). The harness here runs its loop in-process, which the
Harness contract allows ("the interception is the contract, not the process"), so no sandbox,
`uv` or network is needed.

The game: the task asks for a number; after every answer the environment replies with feedback
that quotes the answer's length, `turns` assistant turns in all. Reward `digits`: the fraction
of assistant turns that contain a digit; metric `assistant_turns`.
"""

from __future__ import annotations

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

__all__ = ["CountEnv", "CountHarness", "CountTaskset"]

TURNS = 3
FEEDBACK = "You said {n} characters; again."
RESPONSES: dict[str, list[dict]] = {}
"""Every raw chat-completions body the harness received, by trace id (what the evaluation
client relayed back through the interception server: choices, logprobs, token ids)."""


def feedback(reply: str) -> str:
    """The environment's response to one assistant reply (the old `env_response`)."""
    return FEEDBACK.format(n=len(reply))


class CountData(vf.TaskData):
    turns: int = TURNS
    """Assistant turns per rollout."""


class CountTask(vf.Task[CountData]):
    @vf.reward(weight=1.0)
    async def digits(self, trace: vf.Trace) -> float:
        """The rubric: fraction of assistant turns whose text contains a digit."""
        replies = [m.content or "" for m in trace.assistant_messages]
        return sum(any(ch.isdigit() for ch in r) for r in replies) / max(len(replies), 1)

    @vf.metric
    async def assistant_turns(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))


class CountTasksetConfig(vf.TasksetConfig):
    num_tasks: int = 4


class CountTaskset(vf.Taskset[CountTask, CountTasksetConfig]):
    """The dataset: `num_tasks` prompts, each asking for a number in a different range."""

    def load(self) -> list[CountTask]:
        return [
            CountTask(
                CountData(
                    system_prompt="Count.",
                    prompt=f"Say a number between 1 and {9 + i}.",
                    name=f"count-{i}",
                ),
                self.config.task,
            )
            for i in range(self.config.num_tasks)
        ]


class CountHarnessConfig(vf.HarnessConfig):
    pass


class CountHarness(vf.Harness[CountHarnessConfig]):
    """One chat call per segment, in-process, through the rollout's interception endpoint;
    resumed segments relaunch on the whole conversation (the base `resume`)."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
    ) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages.extend(message_to_wire(m) for m in prompt or [])
        body = {"model": ctx.model, "messages": messages, "logprobs": True}
        async with httpx.AsyncClient(timeout=300) as http:
            reply = await http.post(f"{endpoint}/chat/completions", json=body, headers={"Authorization": f"Bearer {secret}"})
        if reply.status_code != 200:
            return vf.ProgramResult(exit_code=1, stdout="", stderr=f"{reply.status_code}: {reply.text}")
        RESPONSES.setdefault(trace.id, []).append(reply.json())
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


class CountEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(runtime={"type": "subprocess"})


class CountEnv(vf.Env[CountEnvConfig]):
    """The multi-turn loop: the task's prompt opens, then the environment answers every reply
    with `feedback(reply)` until the task's `turns` assistant turns are in."""

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(task.data.turns - 1):
                if segment.terminated:
                    return
                segment = await chat.turn(feedback(segment.last_reply))
