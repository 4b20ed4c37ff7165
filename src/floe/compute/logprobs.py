"""Token log-probs and entropies from hidden states, a chunk of tokens at a time.

The full [tokens x vocab] logits are never materialised for a whole batch: the LM head and the
log-softmax run on `chunk_tokens` rows at a time, and under autograd each chunk is
checkpointed, so its logits are recomputed in backward instead of being kept. Extra peak
memory is therefore about `chunk_tokens * vocab * 4` bytes (twice that in backward).

Temperature scales the logits (logits / T), so these are the log-probs of the
temperature-scaled distribution, the same one the sampler draws from.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = lse - (probs * logits).sum(-1)
    else:
        entropy = logp.new_zeros(())
    return logp, entropy


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
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logps, ents = [], []
    for start in range(0, n, chunk_tokens):
        args = (hidden[start : start + chunk_tokens], weight, bias, targets[start : start + chunk_tokens])
        if needs_grad:
            lp, ent = checkpoint(_chunk_logprobs, *args, temperature, with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(*args, temperature, with_entropy)
        logps.append(lp)
        ents.append(ent)
    if n == 0:
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    logp = torch.cat(logps)
    return logp, (torch.cat(ents) if with_entropy else None)
