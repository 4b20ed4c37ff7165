"""Steps on the Ray placement: the sampler replicas answer whole samples, so `sample_streaming`
replays them as steps (`replay_steps`) after the call; they reassemble exactly to the result,
which equals the local placement's, and the backend says it does not stream live."""

from __future__ import annotations

import floe
from floe.sampler.engine import StepToken
from tests.ray.conftest import RAY_PLACEMENT


def test_ray_sampler_replays_steps_that_reassemble_to_the_samples(ray_cluster, make_backend) -> None:
    local = make_backend()
    remote = make_backend(placement=RAY_PLACEMENT)
    params = floe.SamplingParams(max_tokens=8, seed=4, stop_at_eos=False, top_logprobs=2)
    prompts = [[1, 2, 3], [4, 5], [6]]
    steps: list[list[StepToken]] = []
    result = remote.sample_streaming(prompts, 2, params, steps.append)
    rows = [s for g in result.groups for s in g.samples]
    per: list[list[StepToken]] = [[] for _ in rows]
    for step in steps:
        for st in step:
            per[st.row].append(st)
    assert [[st.token for st in r] for r in per] == [s.tokens for s in rows]
    assert [[st.logprob for st in r] for r in per] == [s.logprobs for s in rows]
    assert [s.tokens for g in local.sample(prompts, 2, params).groups for s in g.samples] == [s.tokens for s in rows]
    assert remote.streams_tokens is False and local.streams_tokens is True
    assert remote.info().capabilities["sampler_streams_tokens"] is False
