"""floe's SkyRL inference client on an embedded backend: SkyRL's generate() contract, request
gathering (same prompt -> one sample call with n), and requests that arrive while a call runs."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest

import floe
from floe.errors import InvalidInput
from floe.models import make_tiny

pytestmark = pytest.mark.skyrl

PARAMS = {"min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True, "max_tokens": 6,
          "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "logprobs": 1, "stop": None}


@pytest.fixture
def client_and_calls(tmp_path: Path):
    from floe.integrations.skyrl.inference import FloeInferenceClient  # noqa: PLC0415 - needs SkyRL (marker skyrl)

    model = make_tiny(tmp_path / "tiny", hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    backend = floe.connect(floe.BackendConfig(model=str(model), state_dir=str(tmp_path / "states")))
    calls: Counter[str] = Counter()
    yield FloeInferenceClient(backend, backend.tokenizer(), "tiny", calls), calls
    backend.close()


def test_concurrent_requests_for_one_prompt_become_one_call(client_and_calls) -> None:
    client, calls = client_and_calls
    prompt = [10, 11, 12]

    async def main():
        return await asyncio.gather(*[client.generate({"prompt_token_ids": [prompt], "sampling_params": PARAMS}) for _ in range(4)])

    outs = asyncio.run(main())
    assert calls["sample"] == 1  # 4 trajectories of one prompt: one floe call with n=4
    for out in outs:
        assert len(out["response_ids"]) == len(out["response_logprobs"]) == 1
        assert 1 <= len(out["response_ids"][0]) <= 6
        assert len(out["response_logprobs"][0]) == len(out["response_ids"][0])
        assert out["stop_reasons"][0] in ("stop", "length")
    assert client.weight_version == 0


def test_a_request_arriving_during_a_call_is_served(client_and_calls) -> None:
    client, calls = client_and_calls

    big = {**PARAMS, "max_tokens": 48}
    prompts = [[10 + i % 40, 11, 12 + i // 40] for i in range(48)]  # one long call: 48 prompts x up to 48 tokens
    seen_running = []

    async def late():
        await asyncio.sleep(0.01)
        seen_running.append(calls["sample"] == 1)  # the first call has started and not returned
        return await client.generate({"prompt_token_ids": [[20, 21]], "sampling_params": PARAMS})

    async def main():
        first = asyncio.create_task(client.generate({"prompt_token_ids": prompts, "sampling_params": big}))
        return await asyncio.wait_for(asyncio.gather(first, late()), timeout=120)

    a, b = asyncio.run(main())
    assert len(a["response_ids"]) == 48 and len(b["response_ids"]) == 1
    assert seen_running == [True] and calls["sample"] == 2


def test_unsupported_requests_are_refused_by_name(client_and_calls) -> None:
    client, _ = client_and_calls
    with pytest.raises(InvalidInput) as err:
        asyncio.run(client.generate({"prompt_token_ids": [[1, 2]], "sampling_params": {**PARAMS, "min_p": 0.2}}))
    assert err.value.field == "sampling_params.min_p"
    with pytest.raises(InvalidInput) as err:
        asyncio.run(client.generate({"prompts": [[{"role": "user", "content": "hi"}]], "sampling_params": PARAMS}))
    assert err.value.field == "prompts"
