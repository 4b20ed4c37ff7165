"""The engine's sampling math: the block-sum draw picks what the full inverse-CDF draw picks
with the same uniforms; log-probs equal log_softmax; top-k/top-p semantics are unchanged."""

from __future__ import annotations

import torch

import floe
from floe.sampler.noise import derive_tensor, sample_categorical, sample_from_weights
from floe.sampler.torch_engine import draw_tokens, filter_logits


def test_block_draw_equals_inverse_cdf_with_the_same_uniforms():
    torch.manual_seed(0)
    logits = torch.randn(64, 5000) * 3
    logits[:, ::7] = float("-inf")  # excluded entries are never drawn
    keys = derive_tensor(torch.arange(64, dtype=torch.int64), 3)
    for block in (64, 1024, 4999):
        got = sample_from_weights(torch.exp(logits - logits.amax(-1, keepdim=True)), keys, block=block)
        assert torch.equal(got, sample_categorical(logits, keys))
        assert not bool((got % 7 == 0).any())


def test_draw_tokens_logprobs_and_filters():
    torch.manual_seed(1)
    logits = torch.randn(32, 3000) * 2
    keys = derive_tensor(torch.arange(32, dtype=torch.int64), 0)
    for params in (floe.SamplingParams(temperature=0.7), floe.SamplingParams(temperature=1.3, top_k=5),
                   floe.SamplingParams(temperature=1.0, top_p=0.5)):
        chosen, logp = draw_tokens(logits, params, keys)
        scaled = logits / params.temperature
        ref = torch.log_softmax(scaled, -1).gather(-1, chosen[:, None])[:, 0]
        assert torch.allclose(logp, ref, atol=1e-6)
        assert torch.equal(chosen, sample_categorical(filter_logits(scaled, params.top_k, params.top_p), keys))
