"""The remote Client's surface beyond the training ops: tokenizer(), AsyncClient, /info."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

import floe
from floe.models import load_tokenizer

from .conftest import ServerProcess


def test_tokenizer_is_rebuilt_from_the_server(shared_client: floe.Client, server_model: Path) -> None:
    remote, local = shared_client.tokenizer(), load_tokenizer(str(server_model))
    text = "Hello, floe!"
    assert remote.encode(text) == local.encode(text)
    assert remote.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True) == \
        local.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert shared_client.tokenizer() is remote  # fetched once


def test_async_client_over_http(shared_server: ServerProcess) -> None:
    async def main() -> tuple[floe.Info, floe.SampleResult]:
        client = floe.connect_async(shared_server.url, token=shared_server.token)
        info, sampled = await asyncio.gather(client.info(), client.sample([[1, 2]], n=2, params=floe.SamplingParams(max_tokens=3)))
        await client.close()
        return info, sampled

    info, sampled = asyncio.run(main())
    assert info.zones == ["policy", "sampler", "reference"]
    assert [len(s.tokens) <= 3 for s in sampled.groups[0].samples] == [True, True]


def test_info_endpoint_matches_client_info(shared_server: ServerProcess, shared_client: floe.Client) -> None:
    data = httpx.get(f"{shared_server.url}/info", headers=shared_server.headers()).json()
    info = shared_client.info()
    assert (data["model"], data["step"], data["sampler_version"]) == (info.model, info.step, info.sampler_version)
