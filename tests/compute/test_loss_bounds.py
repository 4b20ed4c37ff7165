"""Field faults: exponentials of log-prob gaps stay finite, and every reported KL is the
divergence its name states, estimated on the distribution the tokens were drawn from.

The loss math is pure (floe.compute.losses), so these tests drive `compute_loss` directly with
hand-made per-token tensors; the last test goes through a real backend's forward_backward and
optim_step with the issue's numbers.
"""

from __future__ import annotations

import math

import pytest
import torch

import floe
from floe.compute.losses import EXP_BOUND, LOSSES, TokenInputs, bounded_exp, compute_loss, resolve_loss


def _inputs(logp: torch.Tensor, old: torch.Tensor | None, ref: torch.Tensor | None, adv: float) -> TokenInputs:
    n = logp.numel()
    return TokenInputs(
        logp=logp, weights=torch.ones(n), scale=torch.full((n,), 1.0 / n), sample_index=torch.zeros(n, dtype=torch.long),
        num_samples=1, old_logp=old, advantages=torch.full((n,), adv), ref_logp=ref, entropy=torch.zeros(n),
    )


def test_bounded_exp_is_exp_below_the_bound_and_its_tangent_above() -> None:
    x = torch.tensor([-50.0, 0.0, 3.0, EXP_BOUND, EXP_BOUND + 1.0, 95.3, 1e6], requires_grad=True)
    y, bit = bounded_exp(x)
    y.sum().backward()
    e = math.exp(EXP_BOUND)
    assert torch.equal(y[:4].detach(), torch.exp(x[:4].detach()))
    assert y[4].item() == pytest.approx(2 * e, rel=1e-6) and y[5].item() == pytest.approx(e * (1 + 95.3 - EXP_BOUND), rel=1e-6)
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert x.grad[5].item() == pytest.approx(e, rel=1e-6)  # slope stays exp(B): the gradient still points up
    assert bit.tolist() == [False, False, False, False, True, True, True]


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_any_log_prob_gap_gives_a_finite_loss_and_gradient(loss: str, estimator: str) -> None:
    # The issue's numbers: policy log-probs near -100 where the reference (and the sampler) had -4.7.
    logp = torch.tensor([-100.0, -98.0, -4.7, -0.1], requires_grad=True)
    far = torch.tensor([-4.7, -4.7, -4.7, -0.1])
    spec = resolve_loss(loss, {"kl": {"coef": 0.05, "estimator": estimator}})
    for old, adv in ((far, 1.0), (far, -1.0), (torch.tensor([-1e4, -1e4, -4.7, -0.1]), -1.0)):
        logp.grad = None
        value, sums = compute_loss(spec, _inputs(logp, None if loss == "cross_entropy" else old, far, adv))
        value.backward()
        assert math.isfinite(value.item()) and torch.isfinite(logp.grad).all(), (loss, estimator, old, adv)
        assert all(math.isfinite(v) for v in sums.values()), sums
    if estimator == "k3":
        assert sums["exp_bounded_tokens"] >= 2  # the bound bit and the metrics say so


def test_the_bound_changes_nothing_in_range() -> None:
    logp = torch.tensor([-2.0, -1.0, -0.5])
    old = torch.tensor([-1.5, -1.2, -0.4])
    spec = resolve_loss("ppo", {"kl": {"coef": 0.1, "estimator": "k3"}})
    value, sums = compute_loss(spec, _inputs(logp, old, old, 1.0))
    r = torch.exp(logp - old)
    k3 = torch.exp(old - logp) - (old - logp) - 1
    expected = (-torch.minimum(r, r.clamp(0.8, 1.2)) + 0.1 * k3).mean()
    assert value.item() == pytest.approx(expected.item(), rel=1e-6)
    assert "exp_bounded_tokens" not in sums or sums["exp_bounded_tokens"] == 0


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p * (p / q).log()).sum())


def test_each_reported_kl_is_its_named_divergence_on_its_sampling_distribution() -> None:
    """KL(sampler ‖ policy) with tokens from the sampler, KL(policy ‖ reference) with tokens from
    the policy, against the exact sums over a 5-token vocabulary (Monte Carlo, 400k draws; the
    tolerance is 5 standard errors of each estimator)."""
    g = torch.Generator().manual_seed(0)
    sampler = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    policy = torch.tensor([0.2, 0.3, 0.1, 0.3, 0.1])
    reference = torch.tensor([0.1, 0.1, 0.4, 0.2, 0.2])
    spec = resolve_loss("importance_sampling", {})

    draws = torch.multinomial(sampler, 400_000, replacement=True, generator=g)
    x = _inputs(policy.log()[draws], sampler.log()[draws], None, 0.0)
    _, sums = compute_loss(spec, x)
    n = draws.numel()
    log_r = (policy.log() - sampler.log())[draws]
    for key, per_token in (("kl_sampler_k1_sum", -log_r), ("kl_sampler_k3_sum", log_r.exp() - 1 - log_r)):
        tol = 5 * float(per_token.std()) / math.sqrt(n)
        assert sums[key] / n == pytest.approx(_kl(sampler, policy), abs=tol), key
    # The old metric, exp(old - new) + (new - old) - 1, estimates something else entirely here.
    assert abs(float(((-log_r).exp() + log_r - 1).mean()) - _kl(sampler, policy)) > 10 * tol

    draws = torch.multinomial(policy, 400_000, replacement=True, generator=g)
    x = _inputs(policy.log()[draws], policy.log()[draws], reference.log()[draws], 0.0)
    _, sums = compute_loss(spec, x)
    d = (reference.log() - policy.log())[draws]
    tol = 5 * float((d.exp() - 1 - d).std()) / math.sqrt(n)
    assert sums["kl_ref_k3_sum"] / n == pytest.approx(_kl(policy, reference), abs=tol)
    assert sums["kl_sampler_k3_sum"] == pytest.approx(0.0, abs=1e-9)  # on-policy: no sampler drift


def test_issue_case_trains_through_the_backend(make_client) -> None:
    """forward_backward with k3 at coef 0.05 where the policy's log-probs are far below the
    reference's -4.7 (at temperature 0.01 the tiny model gives its non-argmax tokens log-probs of
    about -100 or less): finite loss, and optim_step applies (before the fix: loss inf, then a
    NaN-norm refusal on every step)."""
    client = make_client(num_threads=1, optimizer={"lr": 1e-3})
    prompt, tokens, temperature = [5, 6, 7], [8, 9, 10, 11], 0.01
    lp = client.forward([floe.Group(prompt, [floe.Sample(tokens)])], temperature=temperature).logprobs[0][0]
    far = [x for x in lp if -4.7 - x > EXP_BOUND]
    assert len(far) >= 2, lp  # the issue's situation: gaps beyond the bound
    sample = floe.Sample(tokens, logprobs=lp, advantage=1.0, ref_logprobs=[-4.7] * len(tokens))
    for _ in range(2):
        res = client.forward_backward([floe.Group(prompt, [sample])], "ppo", {"kl": {"coef": 0.05, "estimator": "k3"}},
                                      temperature=temperature)
        assert math.isfinite(res.metrics["loss"]) and res.metrics["exp_bounded_tokens"] >= len(far)
        step = client.optim_step()
        assert math.isfinite(step.grad_norm)
