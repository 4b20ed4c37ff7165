"""Running a causal LM over ragged groups to get per-token log-probs of their samples.

Shared by the policy zone (with autograd) and the reference zone (without). A micro-batch of
group parts runs in one of two layouts, giving the same numbers:

* `shared_prefix`: one packed stream per micro-batch in which each part's prompt appears
  once and its samples attend to it (compute/prefix.py). The default where supported and
  where the cost model says it pays (`ComputeConfig.prefix_dedup`).
* `padded`: one right-padded row `prompt + sample[:-1]` per sample. Right padding is safe
  without an attention mask: under causal attention a position never sees the padding after
  it. Works for every causal LM; the fallback.

In every layout the LM head runs only on scored positions (the last prompt position, which
predicts each sample's first token, and the sample's own positions) through
`compute.logprobs`, so full [tokens x vocab] logits never exist.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from floe.compute import prefix
from floe.compute.layout import Layout, MicroBatch, plan_microbatches
from floe.compute.logprobs import token_logprobs
from floe.config import ComputeConfig
from floe.types import Batch, ForwardResult

logger = logging.getLogger("floe")

Parts = list[tuple[list[int], list[list[int]]]]  # [(prompt, [sample tokens, ...]), ...]

# Config attributes of models whose logits are not a plain linear head over the last hidden
# state; those go through the model's own forward instead.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
# Auto mode takes the shared-prefix layout only when the cost model predicts at least this
# speedup, so that model error never makes it slower than the padded path.
_AUTO_MIN_SPEEDUP = 1.1


@dataclass
class ScoredPart:
    """Per-sample log-probs (and entropies) for one group part, in the part's sample order."""

    logprobs: list[torch.Tensor]
    entropy: list[torch.Tensor] | None


def has_plain_lm_head(model: PreTrainedModel) -> bool:
    cfg = model.config
    return all(getattr(cfg, name, None) in (None, 1.0) for name in _LOGIT_TRANSFORMS)


def _targets(parts: Parts, device: torch.device) -> torch.Tensor:
    return torch.tensor([t for _, samples in parts for s in samples for t in s], dtype=torch.long, device=device)


def _padded_inputs(parts: Parts, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows [B, W] and the flat indices of their scored positions."""
    rows = [prompt + tokens[:-1] for prompt, samples in parts for tokens in samples]
    spans = [(len(prompt) - 1, len(tokens)) for prompt, samples in parts for tokens in samples]
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    positions = [i * width + start + k for i, (start, n) in enumerate(spans) for k in range(n)]
    return ids.to(device), torch.tensor(positions, dtype=torch.long, device=device)


def _stream_inputs(parts: Parts, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, prefix.StreamLayout]:
    """Shared-prefix stream token ids [T], flat indices of scored positions, and the stream layout."""
    ids: list[int] = []
    scored: list[int] = []
    for prompt, samples in parts:
        last_prompt = len(ids) + len(prompt) - 1
        ids.extend(prompt)
        for tokens in samples:
            scored.append(last_prompt)
            scored.extend(range(len(ids), len(ids) + len(tokens) - 1))
            ids.extend(tokens[:-1])
    layout = prefix.build_stream([(len(p), [len(s) - 1 for s in ss]) for p, ss in parts], device)
    return (
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(scored, dtype=torch.long, device=device),
        layout,
    )


def score_parts(
    model: PreTrainedModel,
    parts: Parts,
    temperature: float,
    with_entropy: bool,
    chunk_tokens: int,
    layout: Layout = "padded",
) -> list[ScoredPart]:
    """Log-probs (and entropies) of every sample of `parts`, run in the given layout.

    `shared_prefix` needs `prefix.install(model)` and a supported model
    (`uses_prefix_dedup`); `padded` works for every causal LM.
    """
    device = next(model.parameters()).device
    targets = _targets(parts, device)
    if layout == "padded" and not has_plain_lm_head(model):
        ids, positions = _padded_inputs(parts, device)
        logits = model(input_ids=ids, use_cache=False).logits.float() / temperature
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, positions)
        logsm = torch.log_softmax(logits, dim=-1)
        logp = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ent = -(logsm.exp() * logsm).sum(-1) if with_entropy else None
        return _split_by_part(parts, logp, ent)
    if layout == "padded":
        ids, positions = _padded_inputs(parts, device)
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1])
    else:
        ids, positions, stream = _stream_inputs(parts, device)
        hidden = prefix.stream_forward(model, ids, stream)
    head = model.get_output_embeddings()
    logp, ent = token_logprobs(
        hidden.index_select(0, positions), head.weight, head.bias, targets, temperature, with_entropy, chunk_tokens
    )
    return _split_by_part(parts, logp, ent)


def _split_by_part(parts: Parts, logp: torch.Tensor, ent: torch.Tensor | None) -> list[ScoredPart]:
    sizes = [len(s) for _, samples in parts for s in samples]
    lp_list = list(torch.split(logp, sizes))
    ent_list = list(torch.split(ent, sizes)) if ent is not None else None
    out, k = [], 0
    for _, samples in parts:
        m = len(samples)
        out.append(ScoredPart(lp_list[k : k + m], ent_list[k : k + m] if ent_list is not None else None))
        k += m
    return out


def uses_prefix_dedup(model: PreTrainedModel, compute: ComputeConfig) -> bool:
    """Whether the shared-prefix layout may run for this model (installing it if so).

    False when `prefix_dedup="off"`, or when the model is not supported; the latter is
    logged once per model (a warning when dedup was asked for with "on").
    """
    if compute.prefix_dedup == "off":
        return False
    reason = prefix.unsupported_reason(model)
    if reason is None and not has_plain_lm_head(model):
        reason = "its logits are not a plain linear head"
    if reason is not None:
        if not getattr(model, "_floe_prefix_fallback_logged", False):
            level = logging.WARNING if compute.prefix_dedup == "on" else logging.INFO
            logger.log(level, "prompt dedup off for this model, using the padded path: %s", reason)
            model._floe_prefix_fallback_logged = True  # type: ignore[attr-defined]
        return False
    prefix.install(model)
    return True


def _cost_model(model: PreTrainedModel | None) -> prefix.CostModel:
    if model is None:
        return prefix.CostModel.generic()
    cached = getattr(model, "_floe_cost_model", None)
    if cached is None:
        cached = prefix.CostModel.from_model(model)
        model._floe_cost_model = cached  # type: ignore[attr-defined]
    return cached


def _plan_cost(batch: Batch, plan: list[MicroBatch], costs: prefix.CostModel) -> float:
    total = 0.0
    for mb in plan:
        prompts = [len(batch.groups[p.group].prompt) for p in mb.parts]
        samples = [[len(batch.groups[p.group].samples[i].tokens) for i in p.samples] for p in mb.parts]
        estimate = costs.shared_prefix if mb.layout == "shared_prefix" else costs.padded
        total += estimate(prompts, samples)
    return total


def plan_batch(
    batch: Batch, compute: ComputeConfig, dedup: bool, model: PreTrainedModel | None = None
) -> list[MicroBatch]:
    """Micro-batches for `batch`; `dedup` = the shared-prefix layout is allowed.

    With `prefix_dedup="auto"` the shared-prefix plan is taken only where the cost model of
    `model` (a generic ~2B-dense one when not given) predicts it pays (`_AUTO_MIN_SPEEDUP`);
    "on" always takes it when allowed.
    """
    prompt_lens = [len(g.prompt) for g in batch.groups]
    sample_lens = [[len(s.tokens) for s in g.samples] for g in batch.groups]
    budget = compute.max_tokens_per_microbatch
    padded = plan_microbatches(prompt_lens, sample_lens, budget, "padded")
    if not dedup:
        return padded
    shared = plan_microbatches(prompt_lens, sample_lens, budget, "shared_prefix")
    if compute.prefix_dedup == "on":
        return shared
    costs = _cost_model(model)
    if _plan_cost(batch, padded, costs) >= _AUTO_MIN_SPEEDUP * _plan_cost(batch, shared, costs):
        return shared
    return padded


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
    return score_parts(model, parts, temperature, with_entropy, compute.logprob_chunk_tokens, mb.layout)


def next_token_logits(model: PreTrainedModel, tokens: list[int], chunk_tokens: int) -> Iterator[tuple[int, torch.Tensor]]:
    """The fp32 logits [C, vocab] of the next-token distribution after tokens[:i + 1], for
    i = 0 .. len(tokens) - 2 (the distributions that predict tokens[1:]), `chunk_tokens` rows at
    a time: yields (i of the chunk's first row, logits). One forward of tokens[:-1], the input
    row `score_batch` scores a one-token prompt with; the LM head runs per chunk, so a long
    prompt never holds its whole [tokens x vocab] logits (models without a plain head do).
    Call under torch.no_grad()."""
    if len(tokens) < 2:
        return
    device = next(model.parameters()).device
    ids = torch.tensor([tokens[:-1]], dtype=torch.long, device=device)
    n = ids.shape[1]
    if not has_plain_lm_head(model):
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
        for start in range(0, n, chunk_tokens):
            yield start, logits[start : start + chunk_tokens]
        return
    hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0]
    head = model.get_output_embeddings()
    for start in range(0, n, chunk_tokens):
        yield start, torch.nn.functional.linear(hidden[start : start + chunk_tokens], head.weight, head.bias).float()


def score_batch(
    model: PreTrainedModel, batch: Batch, temperature: float, with_entropy: bool, compute: ComputeConfig
) -> ForwardResult:
    """Log-probs (and entropies) of every sample token, without gradients."""
    logprobs: list[list[list[float]]] = [[[] for _ in g.samples] for g in batch.groups]
    entropy = [[[] for _ in g.samples] for g in batch.groups] if with_entropy else None
    for mb in plan_batch(batch, compute, uses_prefix_dedup(model, compute), model):
        scored = score_microbatch(model, batch, mb, temperature, with_entropy, compute)
        for part, result in zip(mb.parts, scored):
            for k, i in enumerate(part.samples):
                logprobs[part.group][i] = result.logprobs[k].tolist()
                if entropy is not None and result.entropy is not None:
                    entropy[part.group][i] = result.entropy[k].tolist()
    return ForwardResult(logprobs, entropy)
