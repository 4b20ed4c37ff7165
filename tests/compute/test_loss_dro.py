"""The `dro` loss (Tinker's direct reward optimisation): value and gradient against the
formula written out token by token, with weights and every aggregation."""

from __future__ import annotations

import pytest
import torch

from floe.compute.losses import LOSSES, TokenInputs, aggregation_scales, compute_loss, resolve_loss


@pytest.mark.parametrize("aggregation", ["sum", "token_mean", "seq_mean_token_mean"])
def test_dro_value_and_gradient_match_the_formula(aggregation: str) -> None:
    g = torch.Generator().manual_seed(0)
    lengths = [3, 5]
    n = sum(lengths)
    logp = (-torch.rand(n, generator=g) * 4).requires_grad_(True)
    old = -torch.rand(n, generator=g) * 4
    adv = torch.randn(n, generator=g)
    weights = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 1.0, 2.0, 1.0])
    index = torch.tensor([0] * 3 + [1] * 5)
    sums = [float(weights[index == i].sum()) for i in range(2)]
    per_sample = aggregation_scales(lengths, sums, aggregation, None)
    scale = torch.tensor([per_sample[i] for i in index.tolist()])
    beta = 0.3
    spec = resolve_loss("dro", {"beta": beta, "aggregation": aggregation})
    loss, metrics = compute_loss(spec, TokenInputs(logp=logp, weights=weights, scale=scale, sample_index=index,
                                                   num_samples=2, old_logp=old, advantages=adv))
    loss.backward()
    expected, grad = 0.0, []
    for t in range(n):
        lp, q, a, w, s = float(logp[t]), float(old[t]), float(adv[t]), float(weights[t]), float(scale[t])
        expected += s * w * -(lp * a - 0.5 * beta * (lp - q) ** 2)
        grad.append(s * w * -(a - beta * (lp - q)))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert logp.grad.tolist() == pytest.approx(grad, rel=1e-5, abs=1e-7)
    assert metrics["loss"] == pytest.approx(expected, rel=1e-6)


def test_dro_is_registered_with_its_inputs_and_default() -> None:
    assert LOSSES["dro"].inputs == ("old_logprobs", "advantages")
    assert resolve_loss("dro", None).resolved()["beta"] == 0.05
    with pytest.raises(Exception, match="beta"):
        resolve_loss("dro", {"beta": -1.0})
