"""Chunked log-probs / entropies equal the naive full-logits computation, values and gradients."""

from __future__ import annotations

import pytest
import torch

from floe.compute.logprobs import token_logprobs


def naive(hidden, weight, bias, targets, temperature):
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    logsm = torch.log_softmax(logits, dim=-1)
    return logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logsm.exp() * logsm).sum(-1)


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("use_entropy", [True, False])
def test_values_and_gradients_match_naive(chunk: int, temperature: float, use_entropy: bool) -> None:
    g = torch.Generator().manual_seed(chunk)
    n, d, v = 23, 16, 50
    inputs = [torch.randn(n, d, generator=g), torch.randn(v, d, generator=g), torch.randn(v, generator=g)]
    targets = torch.randint(0, v, (n,), generator=g)
    w_lp, w_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    grads = []
    for fn in (naive, lambda *a: token_logprobs(*a, with_entropy=True, chunk_tokens=chunk)):
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        logp, ent = fn(*leaves[:2], leaves[2], targets, temperature)
        loss = (w_lp * logp).sum() + ((w_ent * ent).sum() if use_entropy else 0.0)
        loss.backward()
        grads.append((logp.detach(), ent.detach(), [x.grad for x in leaves]))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = grads
    torch.testing.assert_close(lp_b, lp_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_b, ent_a, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_no_grad_and_empty() -> None:
    h, w, t = torch.randn(5, 4), torch.randn(9, 4), torch.randint(0, 9, (5,))
    with torch.no_grad():
        lp, ent = token_logprobs(h, w, None, t, 1.0, False, 2)
    assert ent is None and torch.allclose(lp, naive(h, w, None, t, 1.0)[0], atol=1e-6)
    lp, ent = token_logprobs(h[:0], w, None, t[:0], 1.0, True, 2)
    assert lp.shape == (0,) and ent is not None and ent.shape == (0,)
