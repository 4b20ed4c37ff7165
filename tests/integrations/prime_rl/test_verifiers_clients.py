"""verifiers 0.4.0's real clients against a `floe serve` on loopback (marker `verifiers`; run by
scripts/ci/verifiers.sh): the training client (renders chat locally, POSTs token ids to
/inference/v1/generate) and the evaluation client (relays to /v1/chat/completions) play a
multi-turn guessing game built here; every turn's per-token log-probs equal floe's policy
forward on the same tokens within 1e-4."""

from __future__ import annotations

import asyncio
import os

import pytest

import floe
from tests.integrations.prime_rl.conftest import TOKEN

pytestmark = [pytest.mark.verifiers, pytest.mark.timeout(600)]

TEMPERATURE = 0.9


class CountingGame:
    """A tiny multi-turn environment: the user asks, the env replies to every answer with
    feedback, three assistant turns in all; the reward counts digits in the answers."""

    turns = 3

    def __init__(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": "Count."},
                                     {"role": "user", "content": "Say a number between 1 and 9."}]

    def step(self, reply: str) -> None:
        self.messages.append({"role": "assistant", "content": reply})
        self.messages.append({"role": "user", "content": f"You said {len(reply)} characters; again."})

    def reward(self) -> float:
        return float(sum(ch.isdigit() for m in self.messages if m["role"] == "assistant" for ch in m["content"]))


def check_logprobs(client: floe.Client, prompt: list[int], tokens: list[int], logprobs: list[float]) -> None:
    assert tokens and len(tokens) == len(logprobs)
    fwd = client.forward(floe.Batch([floe.Group(prompt, [floe.Sample(tokens=tokens)])]), temperature=TEMPERATURE)
    for got, want in zip(logprobs, fwd.logprobs[0][0]):
        assert got == pytest.approx(want, abs=1e-4)


def test_train_and_eval_clients_play_multi_turn(prime_server) -> None:
    import verifiers.v1 as vf  # noqa: PLC0415 - only in the verifiers environment
    from verifiers.v1.dialects.chat import ChatDialect  # noqa: PLC0415

    os.environ["FLOE_TEST_KEY"] = TOKEN
    base = prime_server.url + "/v1"
    model = str(prime_server.model_path)
    floe_client = prime_server.client()
    train = vf.resolve_client(vf.TrainClientConfig(base_url=base, api_key_var="FLOE_TEST_KEY", renderer_model_name=model))
    evaluate = vf.resolve_client(vf.EvalClientConfig(base_url=base, api_key_var="FLOE_TEST_KEY"))
    sampling = vf.SamplingConfig(max_tokens=6, temperature=TEMPERATURE)

    async def play(client, trained: bool) -> CountingGame:
        game = CountingGame()
        for _turn in range(game.turns):
            body = {"model": model, "messages": list(game.messages), "max_tokens": 6, "temperature": TEMPERATURE}
            if not trained:
                body["logprobs"] = True
            response = await client.get_response(ChatDialect(), body, sampling)
            if trained:
                tok = response.tokens
                check_logprobs(floe_client, list(tok.prompt_ids), list(tok.completion_ids), list(tok.completion_logprobs))
            else:
                choice = response.raw["choices"][0]
                lps = [c["logprob"] for c in choice["logprobs"]["content"]]
                check_logprobs(floe_client, choice["prompt_token_ids"], choice["token_ids"], lps)
            game.step(response.message.content or "")
        return game

    async def main() -> tuple[CountingGame, CountingGame]:
        try:
            return await play(train, True), await play(evaluate, False)
        finally:
            await train.close()
            await evaluate.close()

    trained, evaluated = asyncio.run(main())
    for game in (trained, evaluated):
        assert sum(m["role"] == "assistant" for m in game.messages) == 3
        assert game.reward() >= 0
    floe_client.close()
