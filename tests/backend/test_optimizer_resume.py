"""Resuming with a changed optimizer config: the configured hyper-parameters win, every one.

A saved state carries AdamW's moments and step counts and the policy's step; the loading
backend's OptimizerConfig supplies lr (through the schedule at the restored step), betas,
eps and weight_decay. The check is exact: one step after the load equals torch's AdamW with
the new hyper-parameters applied to the loaded weights and moments.
"""

from __future__ import annotations

import pytest
import torch

import floe
from floe.backend.policy import lr_at
from floe.config import OptimizerConfig
from tests.conftest import backend_of

SAVED = {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0, "eps": 1e-8, "grad_clip": None}
# The numbers: lr 5e-3, weight_decay 0.1, betas (0.5, 0.6); eps changes too.
NEW = {"lr": 5e-3, "betas": (0.5, 0.6), "weight_decay": 0.1, "eps": 1e-6, "grad_clip": None}


def _batch(tok, text: str) -> floe.Batch:
    return floe.Batch([floe.Group(tok.encode("q:"), [floe.Sample(tok.encode(text)), floe.Sample(tok.encode(text[::-1]))])])


def _saved_client(make_client, dtype: str = "float32") -> floe.Client:
    a = make_client(optimizer=SAVED, dtype=dtype)
    tok = a.tokenizer()
    for text in ("first", "second"):
        a.forward_backward(_batch(tok, text), "cross_entropy")
        a.optim_step()
    a.save_state("ckpt")
    return a


def _reference_step(policy, grads: list[torch.Tensor], start: list[torch.Tensor], moments: dict, cfg: dict) -> list[torch.Tensor]:
    """torch.optim.AdamW with `cfg` on clones of the loaded weights and moments."""
    ref = [s.clone().requires_grad_(True) for s in start]
    opt = torch.optim.AdamW(ref, lr=cfg["lr"], betas=cfg["betas"], eps=cfg["eps"], weight_decay=cfg["weight_decay"])
    for r, g, i in zip(ref, grads, range(len(ref))):
        r.grad = g.clone()
        opt.state[r] = {k: v.clone() for k, v in moments[i].items()}
    opt.step()
    return [r.detach() for r in ref]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_configured_hyper_parameters_win_on_resume(make_client, dtype):
    _saved_client(make_client, dtype)
    b = make_client(optimizer=NEW, dtype=dtype)
    tok = b.tokenizer()
    assert b.load_state("ckpt").step == 2
    policy = backend_of(b).policy
    for group in policy.optimizer.param_groups:
        assert (group["betas"], group["eps"], group["weight_decay"]) == (NEW["betas"], NEW["eps"], NEW["weight_decay"])
    start = [t.detach().clone() for t in policy.trained]
    moments = {i: {k: v.clone() for k, v in policy.optimizer.state[t].items()} for i, t in enumerate(policy.trained)}
    assert all(float(m["step"]) == 2.0 for m in moments.values())  # the saved step counts came back
    b.forward_backward(_batch(tok, "third"), "cross_entropy")
    grads = [t.grad.clone() for t in policy.trained]
    res = b.optim_step()
    assert (res.step, res.lr) == (3, NEW["lr"])
    expected = _reference_step(policy, grads, start, moments, NEW)
    for want, got in zip(expected, policy.trained):
        assert torch.equal(want, got.detach())
    # The saved hyper-parameters would have given other weights (the test can fail).
    stale = _reference_step(policy, grads, start, moments, {**SAVED, "lr": NEW["lr"]})
    assert not all(torch.equal(s, g.detach()) for s, g in zip(stale, policy.trained))


def test_the_schedule_follows_the_configured_one_at_the_restored_step(make_client):
    _saved_client(make_client)
    cosine = {**NEW, "schedule": "cosine", "warmup_steps": 1, "total_steps": 6, "min_lr_ratio": 0.1}
    b = make_client(optimizer=cosine)
    tok = b.tokenizer()
    b.load_state("ckpt")
    lrs = []
    for text in ("third", "fourth"):
        b.forward_backward(_batch(tok, text), "cross_entropy")
        lrs.append(b.optim_step().lr)
    assert lrs == [lr_at(2, OptimizerConfig(**cosine)), lr_at(3, OptimizerConfig(**cosine))]
    assert lrs[0] < NEW["lr"] and lrs[1] < lrs[0]


def test_an_unchanged_config_still_resumes_exactly(make_client):
    a = _saved_client(make_client)
    tok = a.tokenizer()
    b = make_client(optimizer=SAVED)
    b.load_state("ckpt")
    for c in (a, b):
        c.forward_backward(_batch(tok, "third"), "cross_entropy")
        c.optim_step()
    for pa, pb in zip(backend_of(a).policy.trained, backend_of(b).policy.trained):
        assert torch.equal(pa, pb)
