"""Training behaviour: SFT memorises strings; optimizer settings and schedules are honoured."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import floe
from floe.backend.policy import lr_at
from floe.config import OptimizerConfig
from tests.conftest import assert_same_state, backend_of, state_snapshot

STRINGS = ["the cat sat", "floe trains", "tokens not text", "groups first"]


def test_sft_memorises_a_handful_of_strings(make_client):
    client = make_client(optimizer={"lr": 1e-2, "betas": (0.9, 0.99)})
    tok = client.tokenizer()
    prompt = tok.encode("say:")
    batch = floe.Batch([floe.Group(prompt, [floe.Sample(tok.encode(s) + [tok.eos_token_id]) for s in STRINGS])])
    losses = []
    for _ in range(60):
        losses.append(client.forward_backward(batch, "cross_entropy").metrics["loss"])
        client.optim_step()
    assert losses[0] > 4.0  # ~ln(vocab) at random init
    assert losses[-1] < 0.5 * losses[0] and losses[-1] < 1.5


def test_per_token_weights_mask_the_loss(make_client):
    client = make_client()
    tok = client.tokenizer()
    toks = tok.encode("abcdef")
    full = floe.Batch([floe.Group(tok.encode(">"), [floe.Sample(toks, weights=[1, 1, 1, 0, 0, 0])])])
    half = floe.Batch([floe.Group(tok.encode(">"), [floe.Sample(toks[:3])])])
    a = client.forward_backward(full, "cross_entropy").metrics
    b = client.forward_backward(half, "cross_entropy").metrics
    assert a["tokens"] == 3 and math.isclose(a["loss"], b["loss"], rel_tol=1e-6)


def test_lr_schedules():
    const = OptimizerConfig(lr=1.0)
    assert [lr_at(s, const) for s in range(3)] == [1.0, 1.0, 1.0]
    warm = OptimizerConfig(lr=1.0, schedule="linear_warmup", warmup_steps=4)
    assert [lr_at(s, warm) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = OptimizerConfig(lr=1.0, schedule="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    lrs = [lr_at(s, cos) for s in range(14)]
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(lrs[2:]))
    assert math.isclose(lrs[12], 0.1) and math.isclose(lrs[7], 0.55)
    with pytest.raises(ValueError, match="total_steps"):
        OptimizerConfig(schedule="cosine")


def test_optim_step_applies_adamw_with_clipping(make_client):
    """One floe step equals torch AdamW on the same gradients after clipping to grad_clip."""
    client = make_client(optimizer={"lr": 0.05, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.1, "grad_clip": 0.01})
    tok = client.tokenizer()
    backend = backend_of(client)
    params = backend.policy.params
    start = [p.detach().clone() for p in params]
    batch = floe.Batch([floe.Group(tok.encode("a"), [floe.Sample(tok.encode("hello"))])])
    client.forward_backward(batch, "cross_entropy")
    grads = [p.grad.clone() for p in params]
    norm = torch.cat([g.reshape(-1) for g in grads]).norm()
    res = client.optim_step()
    assert math.isclose(res.grad_norm, float(norm), rel_tol=1e-5) and res.grad_norm > 0.01
    assert res.step == 1 and res.accumulated_calls == 1 and res.lr == 0.05
    ref = [s.clone().requires_grad_(True) for s in start]
    for r, g in zip(ref, grads):
        r.grad = g * (0.01 / (norm + 1e-6))
    opt = torch.optim.AdamW(ref, lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    opt.step()
    for r, p in zip(ref, params):
        assert torch.allclose(r, p, atol=1e-6, rtol=1e-5)
    assert all(p.grad is None for p in params)


def test_optim_step_at_the_callers_lr(make_client):
    """optim_step(lr=x) is torch AdamW at x whatever the schedule says; lr=0 advances the step
    and the moments but not the weights; a bad lr is InvalidInput("lr") and changes nothing."""
    client = make_client(optimizer={"lr": 0.05, "schedule": "cosine", "warmup_steps": 3, "total_steps": 9,
                                    "grad_clip": None})
    tok = client.tokenizer()
    backend = backend_of(client)
    params = backend.policy.params
    batch = floe.Batch([floe.Group(tok.encode("a"), [floe.Sample(tok.encode("hello"))])])
    ref = [p.detach().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(ref, lr=0.05, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    for step, lr in enumerate((0.0, 0.02, 0.07)):
        client.forward_backward(batch, "cross_entropy")
        for r, p in zip(ref, params):
            r.grad = p.grad.clone()
        before = [p.detach().clone() for p in params]
        bad = state_snapshot(client)
        for wrong in (-1e-3, 1.5, float("nan"), True, "0.1"):
            with pytest.raises(floe.InvalidInput, match="lr"):
                client.optim_step(lr=wrong)
            assert_same_state(bad, state_snapshot(client))
        res = client.optim_step(lr=lr)
        assert (res.step, res.lr) == (step + 1, lr)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        for r, p in zip(ref, params):
            assert torch.allclose(r, p, atol=1e-6, rtol=1e-5)
        if lr == 0.0:
            assert all(torch.equal(b, p) for b, p in zip(before, params))
    assert backend.policy.optimizer.state_dict()["state"][0]["step"] == 3
    client.forward_backward(batch, "cross_entropy")
    assert client.optim_step().lr == lr_at(3, OptimizerConfig(lr=0.05, schedule="cosine", warmup_steps=3, total_steps=9))


def test_optim_step_without_gradients_is_an_error(make_client):
    client = make_client()
    with pytest.raises(floe.StateError, match="no forward_backward"):
        client.optim_step()
    assert client.info().step == 0
