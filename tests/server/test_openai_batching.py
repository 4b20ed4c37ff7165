"""Requests that arrive together are decoded together (floe.server.batching): merged into one
Backend.sample call on a real backend, each answered with exactly its own part; seeded
requests stay reproducible; a bad request fails alone; and a real server batches 16
concurrent OpenAI SDK requests."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest

import floe
from floe.errors import InvalidInput
from floe.server.batching import SampleBatcher, merge_key, split

from ..conftest import backend_of


@pytest.fixture
def backend(make_client):
    return backend_of(make_client())


def batcher(backend, window_s: float = 0.1, **kw) -> SampleBatcher:
    return SampleBatcher(backend.sample_streaming, window_s=window_s, max_sequences=kw.get("max_sequences", 256),
                         max_context=backend.max_context)


def params(max_tokens: int = 8, **kw) -> floe.SamplingParams:
    return floe.SamplingParams(max_tokens=max_tokens, **kw)


def run_together(b: SampleBatcher, requests: list[tuple]) -> list:
    async def main() -> list:
        return await asyncio.gather(*(b.sample(*r) for r in requests), return_exceptions=True)

    return asyncio.run(main())


def test_concurrent_requests_run_as_one_call_and_get_their_own_part(backend) -> None:
    b = batcher(backend)
    requests = [([[1 + i, 2, 3]], 2, params(8 if i % 2 else 12, stop_at_eos=False)) for i in range(8)]
    results = run_together(b, requests)
    assert b.calls == 1
    for (prompts, n, p), result in zip(requests, results):
        assert [g.prompt for g in result.groups] == prompts
        assert all(len(g.samples) == n for g in result.groups)
        lengths = [len(s.tokens) for g in result.groups for s in g.samples]
        assert lengths == [p.max_tokens] * n  # no eos stop: exactly max_tokens, cut to each request's own
        assert all(s.stop_reason == "length" for g in result.groups for s in g.samples)
        assert result.num_tokens == sum(lengths)


def test_cutting_a_longer_sample_is_exactly_the_shorter_call(backend) -> None:
    """Same seed, same prompts: a 12-token call cut to 8 equals the 8-token call, tokens,
    log-probs and stop reasons (the first 8 steps draw the same numbers)."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    long = backend.sample(prompts, 3, params(12, seed=4, top_logprobs=2))
    short = backend.sample(prompts, 3, params(8, seed=4, top_logprobs=2))
    parts = split(long, [(1, 8), (2, 8)])
    assert [g for part in parts for g in part.groups] == short.groups
    assert sum(p.num_tokens for p in parts) == short.num_tokens
    assert any(len(s.tokens) == 12 for g in long.groups for s in g.samples)  # the cut did something


def test_seeded_requests_are_never_merged_and_stay_reproducible(backend) -> None:
    alone = backend.sample([[4, 5, 6]], 2, params(10, seed=9))
    b = batcher(backend)
    requests = [([[4, 5, 6]], 2, params(10, seed=9))] + [([[7, 8]], 2, params(10)) for _ in range(5)]
    results = run_together(b, requests)
    assert results[0].groups == alone.groups
    assert b.calls == 2  # the seeded one alone, the five others together


def test_different_params_are_not_merged(backend) -> None:
    b = batcher(backend)
    results = run_together(b, [([[3, 4]], 1, params(temperature=0.5)), ([[3, 4]], 1, params(temperature=0.9)),
                               ([[3, 4]], 2, params()), ([[3, 4]], 1, params(temperature=0.5))])
    assert b.calls == 3 and all(isinstance(r, floe.SampleResult) for r in results)
    assert merge_key(1, params(5)) == merge_key(1, params(9)) != merge_key(1, params(5, top_p=0.9))


def test_max_tokens_far_apart_or_rows_over_the_cap_split_batches(backend) -> None:
    b = batcher(backend, max_sequences=4)
    run_together(b, [([[3]], 2, params(4)), ([[4]], 2, params(4)), ([[5]], 2, params(4)), ([[6]], 1, params(20))])
    assert b.calls == 3  # rows cap 4: first two together; the third alone; max_tokens 20 > 2 x 4 alone


def test_a_bad_request_fails_alone(backend) -> None:
    b = batcher(backend)
    results = run_together(b, [([[1, 2]], 1, params()), ([[1, 10**6]], 1, params()), ([[3]], 1, params())])
    assert isinstance(results[1], InvalidInput) and results[1].field == "prompts[0]"
    assert isinstance(results[0], floe.SampleResult) and isinstance(results[2], floe.SampleResult)
    assert b.calls == 1 + 3  # the merged call was refused, then each ran alone


def test_a_call_does_not_wait_for_a_running_one(backend) -> None:
    b = batcher(backend, window_s=0.02)

    async def main() -> tuple[float, float]:
        slow = asyncio.ensure_future(b.sample([[1, 2]], 4, params(600, stop_at_eos=False)))
        await asyncio.sleep(0.1)  # the slow call is running now
        t0 = asyncio.get_running_loop().time()
        await b.sample([[3, 4]], 1, params(2))
        quick = asyncio.get_running_loop().time() - t0
        await slow
        return quick, asyncio.get_running_loop().time() - t0

    quick, slow_rest = asyncio.run(main())
    assert b.calls == 2 and quick < slow_rest  # answered while the long call still ran


def test_window_zero_turns_batching_off(backend) -> None:
    b = batcher(backend, window_s=0)
    run_together(b, [([[3]], 1, params()) for _ in range(3)])
    assert b.calls == 3


def test_a_real_server_batches_concurrent_sdk_requests(start_server, tmp_path: Path) -> None:
    server = start_server(server_toml="openai_batch_window_ms = 50")

    async def main() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(
                client.completions.create(model="tiny", prompt=f"ab{i % 4}", max_tokens=8) for i in range(16)
            ))
        finally:
            await client.close()

    outs = asyncio.run(main())
    assert all(len(o.choices) == 1 and o.choices[0].model_extra["prompt_token_ids"] for o in outs)
    records = [json.loads(line) for line in server.log_path.read_text().splitlines() if line.startswith("{")]
    batches = [r for r in records if r.get("msg") == "sample batch"]
    assert sum(r["requests"] for r in batches) == 16
    assert len(batches) < 16 and max(r["requests"] for r in batches) > 1


def test_merged_requests_get_their_own_rows_steps_cut_at_their_own_max_tokens(backend) -> None:
    """Two requests merged into one call (different prompts counts and max_tokens): each one's
    on_step sees only its own rows, numbered from 0, at most its own max_tokens per row, and
    they reassemble exactly to its own result."""
    b = batcher(backend)
    got: list[dict[int, list[int]]] = [{}, {}]

    def collector(i: int):
        def on_step(steps) -> None:
            for st in steps:
                got[i].setdefault(st.row, []).append(st.token)
        return on_step

    async def main() -> list:
        return await asyncio.gather(
            b.sample([[1, 2, 3]], 2, params(5, stop_at_eos=False), collector(0)),
            b.sample([[4, 5], [6, 7, 8]], 2, params(9, stop_at_eos=False), collector(1)))

    results = asyncio.run(main())
    assert b.calls == 1
    for mine, result in zip(got, results):
        rows = [s.tokens for g in result.groups for s in g.samples]
        assert [mine[r] for r in range(len(rows))] == rows


def test_a_call_whose_requests_are_all_cancelled_stops_in_the_engine(backend) -> None:
    """Every member cancelled while its call decodes: the step callback raises StopGeneration,
    so the engine stops (the batcher counts the call as stopped)."""
    b = batcher(backend, window_s=0)
    seen = 0

    async def main() -> None:
        nonlocal seen
        first = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_step(steps) -> None:
            nonlocal seen
            seen += 1
            loop.call_soon_threadsafe(first.set)

        task = asyncio.ensure_future(b.sample([[1, 2, 3]], 4, params(900, stop_at_eos=False), on_step))
        await first.wait()
        task.cancel()
        while not b.stopped and b._tasks:  # the call ends once the engine stopped
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert b.stopped == 1
    assert seen < 900
