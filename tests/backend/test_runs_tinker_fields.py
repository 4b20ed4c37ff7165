"""Tinker fields served by floe.backend.runs, without any SDK: a zero learning rate is a step
that moves no weight, a refused AdamParams changes nothing, and the prompt distributions
(top-k, target ids, alternative draws) are those of the sampler's weights, checked against a
naive peft forward."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import floe
from floe.backend.runs import AdamStep, RunManager
from floe.errors import InvalidInput
from floe.models import load_tokenizer
from floe.models.lora import LoraSpec


@pytest.fixture
def runs(tiny_model: Path, tmp_path: Path) -> RunManager:
    cfg = floe.BackendConfig(model=str(tiny_model), state_dir=str(tmp_path / "states"), seed=0)
    return RunManager(cfg, load_tokenizer(str(tiny_model)), tmp_path / "states" / "tinker")


def _batch() -> floe.Batch:
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (7, 5)]
    return floe.Batch([floe.Group(s[:1], [floe.Sample(tokens=s[1:], weights=[1.0] * (len(s) - 1))]) for s in seqs])


def _moments(run) -> list[torch.Tensor]:
    return [run.zone.optimizer.state[p]["exp_avg"].clone() for p in run.zone.optimizer.param_groups[0]["params"]]


def test_a_zero_learning_rate_is_a_step_that_moves_no_weight(runs: RunManager) -> None:
    run = runs.create_run("a", LoraSpec(rank=4, seed=1))
    runs.forward_backward("a", _batch(), "cross_entropy", {"aggregation": "sum"})
    runs.optim_step("a", AdamStep(learning_rate=1e-2))  # B != 0 from here: a step would move every weight
    before, moments = [p.detach().clone() for p in run.zone.params], _moments(run)
    runs.forward_backward("a", _batch(), "cross_entropy", {"aggregation": "sum"})
    result = runs.optim_step("a", AdamStep(learning_rate=0.0, weight_decay=0.1))
    assert (result.lr, result.step, run.version) == (0.0, 2, 2)
    assert all(torch.equal(a, p) for a, p in zip(before, run.zone.params))  # bit for bit
    assert not all(torch.equal(a, b) for a, b in zip(moments, _moments(run)))  # the moments advanced
    runs.forward_backward("a", _batch(), "cross_entropy", {"aggregation": "sum"})
    runs.optim_step("a", AdamStep(learning_rate=1e-2))
    assert not all(torch.equal(a, p) for a, p in zip(before, run.zone.params))


@pytest.mark.parametrize("lr", [math.inf, -math.inf, math.nan, 1e308, 2.0, -1e-4])
def test_a_refused_learning_rate_changes_nothing(runs: RunManager, lr: float) -> None:
    run = runs.create_run("a", LoraSpec(rank=4, seed=2))
    runs.forward_backward("a", _batch(), "cross_entropy", {"aggregation": "sum"})
    before = [p.detach().clone() for p in run.zone.params]
    grads = [p.grad.clone() for p in run.zone.params]
    with pytest.raises(InvalidInput) as err:
        runs.optim_step("a", AdamStep(learning_rate=lr))
    assert err.value.field == "adam_params.learning_rate"
    assert all(torch.equal(a, p) for a, p in zip(before, run.zone.params)) and run.version == 0
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, run.zone.params))  # the gradients still wait
    assert runs.optim_step("a", AdamStep()).step == 1


PROMPT = [7, 12, 3, 44, 9, 21, 30, 5, 17, 40, 2, 33]


@pytest.fixture
def trained(runs: RunManager, tiny_model: Path, tmp_path: Path):
    """A run trained one step, its sampler snapshot, and a plain peft model with the same adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    runs.create_run("a", LoraSpec(rank=4, seed=3))
    runs.forward_backward("a", _batch(), "cross_entropy", {"aggregation": "sum"})
    runs.optim_step("a", AdamStep(learning_rate=5e-2))
    runs.save_sampler_weights("a", tmp_path / "adapter")
    naive = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model)), str(tmp_path / "adapter"))
    with torch.no_grad():
        logits = naive.eval()(input_ids=torch.tensor([PROMPT])).logits[0, :-1].float()  # rows predict PROMPT[1:]
    return runs.snapshot("a"), logits


def test_topk_and_target_logprobs_are_the_samplers_distribution(runs: RunManager, trained) -> None:
    sampler, logits = trained
    logp = torch.log_softmax(logits, -1)
    rows = len(PROMPT) - 1
    targets = np.full((rows, 3), -1, dtype=np.int64)
    targets[:, 0] = PROMPT[1:]  # the prompt's own tokens: equal prompt_logprobs
    targets[2, 1], targets[5, 2], targets[rows - 1, 1] = 8, 50, 0
    scores = runs.prompt_scores(sampler, PROMPT, topk=20, target_ids=targets)
    want_lp, want_ids = torch.topk(logp, 20, dim=-1)
    assert scores.topk_ids is not None and scores.topk_logprobs is not None and scores.target_logprobs is not None
    assert scores.topk_ids.shape == (rows, 20)
    np.testing.assert_allclose(scores.topk_logprobs, want_lp.numpy(), atol=1e-5)  # the 20 largest, in order
    # each id's log-prob is its own (the tiny model's near-ties may order equal values either way)
    np.testing.assert_allclose(logp.gather(-1, torch.as_tensor(scores.topk_ids)).numpy(), scores.topk_logprobs, atol=1e-5)
    assert (scores.topk_ids[:, 0] == want_ids[:, 0].numpy()).mean() > 0.5
    want_targets = np.where(targets < 0, 0.0, logp.gather(-1, torch.as_tensor(targets).clamp_min(0)).numpy())
    np.testing.assert_allclose(scores.target_logprobs, want_targets, atol=1e-5)
    np.testing.assert_allclose(scores.target_logprobs[:, 0], runs.prompt_logprobs(sampler, PROMPT), atol=1e-6)
    base = runs.prompt_scores(runs.base_sampler(), PROMPT, topk=20)
    assert base.topk_logprobs is not None and not np.allclose(base.topk_logprobs, scores.topk_logprobs, atol=1e-3)


def test_alternative_draws_follow_the_temperature_scaled_distribution(runs: RunManager, trained) -> None:
    sampler, logits = trained
    temperature, k = 0.7, 20
    scaled = torch.log_softmax(logits / temperature, -1)
    first = runs.prompt_scores(sampler, PROMPT, alt_k=k, temperature=temperature, seed=5)
    again = runs.prompt_scores(sampler, PROMPT, alt_k=k, temperature=temperature, seed=5)
    other = runs.prompt_scores(sampler, PROMPT, alt_k=k, temperature=temperature, seed=6)
    assert first.alt_tokens is not None and first.alt_logprobs is not None and other.alt_tokens is not None
    assert first.alt_tokens.shape == (len(PROMPT) - 1, k)
    assert (first.alt_tokens == again.alt_tokens).all() and not (first.alt_tokens == other.alt_tokens).all()
    np.testing.assert_allclose(first.alt_logprobs, scaled.gather(-1, torch.as_tensor(first.alt_tokens)).numpy(), atol=1e-5)
    # E[log p(x)] over draws x ~ p is -H(p): the mean over the 220 draws is within 4 standard errors.
    entropy = -(scaled.exp() * scaled).sum(-1)
    var = (scaled.exp() * (scaled + entropy.unsqueeze(-1)) ** 2).sum(-1)
    stderr = math.sqrt(float(var.sum()) * k) / first.alt_logprobs.size
    assert abs(float(first.alt_logprobs.mean()) + float(entropy.mean())) < 4 * stderr
    greedy = runs.prompt_scores(sampler, PROMPT, alt_k=2, temperature=0.0, seed=5)
    assert greedy.alt_tokens is not None and greedy.alt_logprobs is not None
    assert (greedy.alt_tokens == logits.argmax(-1, keepdim=True).expand(-1, 2).numpy()).all()
    np.testing.assert_allclose(greedy.alt_logprobs[:, 0], torch.log_softmax(logits, -1).max(-1).values.numpy(), atol=1e-5)


def test_a_one_token_prompt_has_no_rows(runs: RunManager) -> None:
    scores = runs.prompt_scores(runs.base_sampler(), [5], topk=3, alt_k=2, seed=1)
    assert scores.topk_ids is not None and scores.topk_ids.shape == (0, 3)
    assert scores.alt_tokens is not None and scores.alt_tokens.shape == (0, 2)
