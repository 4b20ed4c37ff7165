"""Token log-probs and entropies from hidden states, a chunk of tokens at a time.

The full [tokens x vocab] logits are never materialised for a whole batch: the LM head and the
log-softmax run on `chunk_tokens` rows at a time. Each chunk is one autograd function whose
backward recomputes that chunk's logits and forms d(loss)/d(logits) in place, in closed form:

    d logp_t / dz = onehot(t) - p          d H / dz = -p * (log p + H)

so no softmax graph is kept: extra peak memory is about two [chunk_tokens x vocab] fp32
buffers in forward and in backward (the naive pass keeps five or more of the whole batch).

Temperature scales the logits (logits / T), so these are the log-probs of the
temperature-scaled distribution, the same one the sampler draws from.
"""

from __future__ import annotations

from typing import Any

import torch


def _scaled_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    return logits.div_(temperature) if temperature != 1.0 else logits


class _ChunkLogprobs(torch.autograd.Function):
    """(hidden [C, d], weight [V, d], bias) -> (log p(target) [C], entropy [C] or empty)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logp_all = _scaled_logits(hidden, weight, bias, temperature)
        lse = torch.logsumexp(logp_all, dim=-1)
        logp_all.sub_(lse.unsqueeze(-1))
        logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        if with_entropy:
            entropy = -logp_all.exp().mul_(logp_all).sum(-1)
        else:
            entropy = logp.new_zeros((0,))
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.with_entropy = temperature, with_entropy
        ctx.set_materialize_grads(False)  # an output without gradient arrives as None
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None):  # type: ignore[override]
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        logp_all = _scaled_logits(hidden, weight, bias, ctx.temperature).sub_(lse.unsqueeze(-1))
        probs = logp_all.exp()
        if ctx.with_entropy and g_ent is not None:
            # -g_H * p * (log p + H), built in logp_all's buffer
            grad = logp_all.add_(entropy.unsqueeze(-1)).mul_(probs).mul_(-g_ent.unsqueeze(-1))
            if g_logp is not None:
                grad.sub_(probs.mul_(g_logp.unsqueeze(-1)))
        else:
            del logp_all
            grad = probs.mul_(-g_logp.unsqueeze(-1)) if g_logp is not None else probs.zero_()
        if g_logp is not None:
            grad.scatter_add_(-1, targets.unsqueeze(-1), g_logp.unsqueeze(-1).to(grad.dtype))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        grad = grad.to(weight.dtype)
        g_hidden = grad @ weight if ctx.needs_input_grad[0] else None
        g_weight = grad.t() @ hidden if ctx.needs_input_grad[1] else None
        g_bias = grad.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return g_hidden, g_weight, g_bias, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log p(target) for each row of `hidden` [N, d]; entropy [N] too when asked.

    Gradients flow to `hidden`, `weight` and `bias` when they require them.
    """
    n = hidden.shape[0]
    if n == 0:
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    logps, ents = [], []
    # One split (its backward is one concatenation), not per-chunk slices of the whole tensor.
    for h, t in zip(torch.split(hidden, chunk_tokens), torch.split(targets, chunk_tokens)):
        lp, ent = _ChunkLogprobs.apply(h, weight, bias, t, temperature, with_entropy)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)
