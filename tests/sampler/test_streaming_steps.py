"""The engines' step callback (floe.sampler.engine: `on_step`): the tokens reported step by step
reassemble exactly to the returned samples (ids, log-probs, top log-probs), with n > 1, stop
strings, several chunks; raising StopGeneration stops the engine; `replay_steps` reports the
same steps after the fact. Parametrised over the engines (vLLM's cases run in its own env)."""

from __future__ import annotations

import pytest

import floe
from floe.backend.sampler import prompt_seeds
from floe.config import TorchEngineConfig
from floe.models import load_model, load_tokenizer
from floe.sampler import EngineSource, build_engine
from floe.sampler.engine import StepToken, StopGeneration, replay_steps
from floe.types import SampleResult
from tests.conftest import backend_of


def _collect(client: floe.Client, prompts: list[list[int]], n: int,
             params: floe.SamplingParams) -> tuple[SampleResult, list[list[StepToken]]]:
    steps: list[list[StepToken]] = []
    result = backend_of(client).sample_streaming(prompts, n, params, steps.append)
    return result, steps


def _rows(result: SampleResult) -> list[floe.SampledSequence]:
    return [s for g in result.groups for s in g.samples]


def _reassembled(steps: list[list[StepToken]], rows: int) -> list[list[StepToken]]:
    per: list[list[StepToken]] = [[] for _ in range(rows)]
    for step in steps:
        assert [st.row for st in step] == sorted({st.row for st in step}), "at most one token per row, rows ascending"
        for st in step:
            per[st.row].append(st)
    return per


@pytest.mark.parametrize(("top", "temperature"), [(0, 1.0), (3, 1.0), (2, 0.0)])
def test_step_tokens_reassemble_to_the_samples(engine_client: floe.Client, top: int, temperature: float) -> None:
    """Sampled and greedy (vLLM answers one greedy sample per prompt, reported for all n rows)."""
    tok = engine_client.tokenizer()
    prompts = [tok.encode("stream me"), tok.encode("a"), tok.encode("another prompt here")]
    params = floe.SamplingParams(max_tokens=12, temperature=temperature, seed=5, stop=["e"], top_logprobs=top)
    result, steps = _collect(engine_client, prompts, 3, params)
    rows = _rows(result)
    per = _reassembled(steps, len(rows))
    for seq, got in zip(rows, per, strict=True):
        assert [st.token for st in got] == seq.tokens
        assert [st.logprob for st in got] == seq.logprobs
        if top:
            assert [list(st.top_logprobs or ()) for st in got] == [list(t) for t in seq.top_logprobs or []]
        else:
            assert all(st.top_logprobs is None for st in got)
    # The same call without a callback gives the same samples.
    plain = engine_client.sample(prompts, n=3, params=params)
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in _rows(plain)] == \
        [(s.tokens, s.logprobs, s.stop_reason) for s in rows]


def test_replay_steps_reports_what_a_live_engine_reports(engine_client: floe.Client) -> None:
    params = floe.SamplingParams(max_tokens=10, seed=9, stop_at_eos=False)
    result, live = _collect(engine_client, [[1, 2, 3], [4, 5]], 2, params)
    replayed: list[list[StepToken]] = []
    replay_steps(result.groups, replayed.append)
    assert replayed == live


def test_raising_stop_generation_stops_the_engine(engine_client: floe.Client) -> None:
    calls = 0

    def on_step(step: list[StepToken]) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise StopGeneration("gone")

    params = floe.SamplingParams(max_tokens=200, seed=1, stop_at_eos=False)
    with pytest.raises(StopGeneration):
        backend_of(engine_client).sample_streaming([[1, 2, 3]], 2, params, on_step)
    assert calls == 3  # no step after the one that raised
    assert backend_of(engine_client).streams_tokens
    assert engine_client.info().capabilities["sampler_streams_tokens"] is True
    # The engine is usable afterwards.
    assert len(engine_client.sample([[1, 2]], n=1, params=floe.SamplingParams(max_tokens=3)).groups) == 1


def test_torch_engine_chunks_keep_call_row_numbers(tiny_model) -> None:
    """max_batch_sequences smaller than the call: rows of later chunks keep the call's numbers."""
    engine = build_engine(TorchEngineConfig(max_batch_sequences=4), EngineSource(
        load_model(str(tiny_model)), str(tiny_model), load_tokenizer(str(tiny_model))))
    steps: list[list[StepToken]] = []
    params = floe.SamplingParams(max_tokens=6, seed=3, stop_at_eos=False)
    groups = engine.generate([[1, 2], [3], [4, 5, 6]], 2, params, prompt_seeds(3, 3), 0, steps.append)
    per = _reassembled(steps, 6)
    assert [[st.token for st in r] for r in per] == [s.tokens for g in groups for s in g.samples]
