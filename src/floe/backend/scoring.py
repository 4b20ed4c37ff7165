"""Running a causal LM over ragged groups to get per-token log-probs of their samples.

Shared by the policy zone (with autograd) and the reference zone (without). Each group part
becomes rows `prompt + sample[:-1]`; the LM head runs only on scored positions (the last
prompt position and the sample's own positions), through `compute.logprobs`, so the full
logits tensor never exists. Right padding is safe without an attention mask: under causal
attention a position never sees the padding after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from floe.compute.layout import MicroBatch, plan_microbatches
from floe.compute.logprobs import token_logprobs
from floe.config import ComputeConfig
from floe.types import Batch, ForwardResult

# Config attributes of models whose logits are not a plain linear head over the last hidden
# state; those go through the model's own forward instead.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


@dataclass
class ScoredPart:
    """Per-sample log-probs (and entropies) for one group part, in the part's sample order."""

    logprobs: list[torch.Tensor]
    entropy: list[torch.Tensor] | None


def has_plain_lm_head(model: PreTrainedModel) -> bool:
    cfg = model.config
    return all(getattr(cfg, name, None) in (None, 1.0) for name in _LOGIT_TRANSFORMS)


def score_rows(
    model: PreTrainedModel,
    parts: list[tuple[list[int], list[list[int]]]],
    temperature: float,
    with_entropy: bool,
    chunk_tokens: int,
) -> list[ScoredPart]:
    """Plain path: one padded row per sample. `parts` = [(prompt, [sample tokens, ...]), ...]."""
    device = next(model.parameters()).device
    rows: list[list[int]] = []
    spans: list[tuple[int, int]] = []  # (first scored position, number of tokens) per row
    for prompt, samples in parts:
        for tokens in samples:
            rows.append(prompt + tokens[:-1])
            spans.append((len(prompt) - 1, len(tokens)))
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    flat_positions = torch.cat(
        [torch.arange(start, start + n, device=device) + i * width for i, (start, n) in enumerate(spans)]
    )
    targets = torch.tensor([t for _, samples in parts for s in samples for t in s], dtype=torch.long, device=device)

    if has_plain_lm_head(model):
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat_positions)
        head = model.get_output_embeddings()
        logp, ent = token_logprobs(
            hidden, head.weight, head.bias, targets, temperature, with_entropy, chunk_tokens
        )
    else:
        logits = model(input_ids=ids, use_cache=False).logits.float() / temperature
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, flat_positions)
        logsm = torch.log_softmax(logits, dim=-1)
        logp = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ent = -(logsm.exp() * logsm).sum(-1) if with_entropy else None
    return _split_by_part(parts, logp, ent)


def _split_by_part(
    parts: list[tuple[list[int], list[list[int]]]], logp: torch.Tensor, ent: torch.Tensor | None
) -> list[ScoredPart]:
    sizes = [len(s) for _, samples in parts for s in samples]
    lp_list = list(torch.split(logp, sizes))
    ent_list = list(torch.split(ent, sizes)) if ent is not None else None
    out, k = [], 0
    for _, samples in parts:
        m = len(samples)
        out.append(ScoredPart(lp_list[k : k + m], ent_list[k : k + m] if ent_list is not None else None))
        k += m
    return out


def plan_batch(batch: Batch, compute: ComputeConfig, dedup: bool) -> list[MicroBatch]:
    return plan_microbatches(
        [len(g.prompt) for g in batch.groups],
        [[len(s.tokens) for s in g.samples] for g in batch.groups],
        compute.max_tokens_per_microbatch,
        dedup,
    )


def uses_prefix_dedup(model: PreTrainedModel, compute: ComputeConfig) -> bool:
    """Whether the shared-prefix path runs for this model (see compute/prefix.py)."""
    return False


def score_microbatch(
    model: PreTrainedModel,
    batch: Batch,
    mb: MicroBatch,
    temperature: float,
    with_entropy: bool,
    compute: ComputeConfig,
) -> list[ScoredPart]:
    parts = [
        (batch.groups[p.group].prompt, [batch.groups[p.group].samples[i].tokens for i in p.samples])
        for p in mb.parts
    ]
    return score_rows(model, parts, temperature, with_entropy, compute.logprob_chunk_tokens)


def score_batch(
    model: PreTrainedModel, batch: Batch, temperature: float, with_entropy: bool, compute: ComputeConfig
) -> ForwardResult:
    """Log-probs (and entropies) of every sample token, without gradients."""
    logprobs: list[list[list[float]]] = [[[] for _ in g.samples] for g in batch.groups]
    entropy = [[[] for _ in g.samples] for g in batch.groups] if with_entropy else None
    for mb in plan_batch(batch, compute, uses_prefix_dedup(model, compute)):
        scored = score_microbatch(model, batch, mb, temperature, with_entropy, compute)
        for part, result in zip(mb.parts, scored):
            for k, i in enumerate(part.samples):
                logprobs[part.group][i] = result.logprobs[k].tolist()
                if entropy is not None and result.entropy is not None:
                    entropy[part.group][i] = result.entropy[k].tolist()
    return ForwardResult(logprobs, entropy)
