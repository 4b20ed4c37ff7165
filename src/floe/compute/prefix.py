"""Shared-prefix attention: each group's prompt goes through the model once for all its samples.

A micro-batch becomes one packed **stream** (batch size 1, no padding): for every group part
`[prompt | seg_1 | ... | seg_m]`, where `seg_i` is sample i's tokens except the last (the
tokens whose hidden states predict the next one). Position ids restart at P for every
segment, so each segment sees exactly the positions it would see in its own
`prompt + sample` row. Per-token work (embeddings, norms, projections, MLP) therefore runs
once on the prompt; only attention needs to know the layout:

* the prompt attends causally to itself (one `is_causal` SDPA call per part);
* every segment attends to the prompt's keys/values plus its own earlier tokens and never to
  another segment: the segments are gathered into a padded [m, heads, R_max, dim] batch,
  their keys are `[K_prompt ; K_seg]`, and the mask is causal aligned **bottom-right**
  (`torch.nn.attention.bias.causal_lower_right`). Right padding of segments is harmless:
  under that mask a padded key is only visible to padded queries, whose outputs are dropped.

The prompt keys/values are expanded to the m segments; autograd's backward of the expand sums
the m incoming gradients, so the prompt receives gradient from every sample, exactly as in
the per-sample computation. The layout travels to each layer as a per-call keyword
(`floe_stream=`) of the model's forward; HF passes it down to the attention function, also
when a layer is recomputed under gradient checkpointing. Without that keyword the attention
function is plain SDPA, so a model with it installed behaves as before everywhere else.

Supported: decoder-only models whose attention modules use transformers' attention
interface without extras this module does not implement (sliding windows, soft-capping,
sinks): Llama, Qwen2, Qwen3 and Mistral families, loaded with SDPA attention (the default).
Everything else, and any model loaded with another attention implementation (eager, flex,
flash), takes the padded path, so the chosen kernel is the one that runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTN_IMPLEMENTATION = "floe_prefix"
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


@dataclass(frozen=True)
class StreamPart:
    """One group part inside the stream.

    `prompt_len` is the prompt's length. `seg_index` [m * R_max] holds the positions of the
    m segments within the part's segment tokens, right-padded to R_max (padding repeats a
    valid position); `seg_valid` selects the real entries of the flattened [m, R_max] grid,
    or is None when no segment is padded. `mask` is the bool bottom-right causal mask
    [R_max, prompt_len + R_max]. A part with at most one segment is a single causal run.
    """

    prompt_len: int
    num_segments: int
    seg_len: int
    seg_index: torch.Tensor | None
    seg_valid: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(frozen=True)
class StreamLayout:
    """A packed stream: its position ids [1, T] and the parts attention needs to know about.

    `chunks` cuts the stream, in order, into per-part pieces (prompt, then all segments; or
    one piece for a single-run part). Attention splits q/k/v with one `torch.split`, whose
    backward is one concatenation; slicing the full stream per part instead would make
    every part's backward write a zero-filled stream-sized gradient.
    """

    parts: tuple[StreamPart, ...]
    chunks: tuple[int, ...]
    position_ids: torch.Tensor
    length: int


def lower_right_causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Bool [q_len, kv_len]: query j sees keys 0 .. kv_len - q_len + j (bottom-right aligned)."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)


def build_stream(parts: list[tuple[int, list[int]]], device: torch.device) -> StreamLayout:
    """Layout for parts given as (prompt length, [segment length, ...]).

    The stream holds, per part, the prompt then its non-empty segments in order.
    """
    out: list[StreamPart] = []
    chunks: list[int] = []
    positions: list[torch.Tensor] = []
    for prompt_len, seg_lens in parts:
        segs = [r for r in seg_lens if r > 0]
        positions.append(torch.arange(prompt_len))
        for r in segs:
            positions.append(torch.arange(prompt_len, prompt_len + r))
        if len(segs) <= 1:
            r = sum(segs)
            out.append(StreamPart(prompt_len, len(segs), r, None, None, None))
            chunks.append(prompt_len + r)
            continue
        r_max = max(segs)
        rows, valid = [], []
        seg_start = 0
        for r in segs:
            rows.append(torch.arange(seg_start, seg_start + r_max).clamp_max(seg_start + r - 1))
            valid.append(torch.arange(r_max) < r)
            seg_start += r
        seg_valid = torch.cat(valid)
        out.append(
            StreamPart(
                prompt_len=prompt_len,
                num_segments=len(segs),
                seg_len=r_max,
                seg_index=torch.cat(rows).to(device),
                seg_valid=None if bool(seg_valid.all()) else seg_valid.nonzero().squeeze(-1).to(device),
                mask=lower_right_causal_mask(r_max, prompt_len + r_max, device),
            )
        )
        chunks.extend([prompt_len, seg_start])
    position_ids = torch.cat(positions).to(device).unsqueeze(0)
    return StreamLayout(tuple(out), tuple(chunks), position_ids, sum(chunks))


def _part_attention(
    part: StreamPart, q: list[torch.Tensor], k: list[torch.Tensor], v: list[torch.Tensor], scale: float | None
) -> list[torch.Tensor]:
    """Attention outputs [tokens, heads, dim] of one part, in stream order.

    q, k, v: the part's chunks ([prompt + segment] or [prompt, segments]), each
    [1, heads, tokens, dim], k and v already expanded to the query heads. SDPA gets 4D
    inputs throughout: on CPU, 3D inputs fall back to the slow math path.
    """
    if part.num_segments <= 1:
        o = F.scaled_dot_product_attention(q[0], k[0], v[0], is_causal=True, scale=scale)
        return [o[0].transpose(0, 1)]
    assert part.seg_index is not None and part.mask is not None
    m, r_max = part.num_segments, part.seg_len
    (q_p, q_s), (k_p, k_s), (v_p, v_s) = q, k, v
    heads, dim = q_p.shape[1], q_p.shape[-1]
    o_prompt = F.scaled_dot_product_attention(q_p, k_p, v_p, is_causal=True, scale=scale)

    def segments(x: torch.Tensor) -> torch.Tensor:  # [1, heads, S, dim] -> [m, heads, R_max, dim]
        return x[0].index_select(1, part.seg_index).view(heads, m, r_max, dim).transpose(0, 1)

    k_all = torch.cat([k_p.expand(m, -1, -1, -1), segments(k_s)], dim=2)
    v_all = torch.cat([v_p.expand(m, -1, -1, -1), segments(v_s)], dim=2)
    o_seg = F.scaled_dot_product_attention(segments(q_s), k_all, v_all, attn_mask=part.mask, scale=scale)
    o_seg = o_seg.transpose(1, 2).reshape(m * r_max, heads, dim)
    if part.seg_valid is not None:
        o_seg = o_seg.index_select(0, part.seg_valid)
    return [o_prompt[0].transpose(0, 1), o_seg]


def prefix_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    floe_stream: StreamLayout | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An HF attention function: plain SDPA, or shared-prefix attention when given a stream.

    query [1, heads, T, dim], key/value [1, kv_heads, T, dim] (after RoPE); returns
    [1, T, heads, dim] like every HF attention function.
    """
    if floe_stream is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise ValueError("shared-prefix attention does not implement attention dropout")
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError("shared-prefix attention does not implement sliding windows or soft-capping")
    groups = getattr(module, "num_key_value_groups", 1)
    sizes = list(floe_stream.chunks)
    q_chunks = torch.split(query, sizes, dim=2)
    k_chunks = torch.split(repeat_kv(key, groups), sizes, dim=2)
    v_chunks = torch.split(repeat_kv(value, groups), sizes, dim=2)
    pieces, i = [], 0
    for part in floe_stream.parts:
        j = i + (1 if part.num_segments <= 1 else 2)
        pieces.extend(_part_attention(part, q_chunks[i:j], k_chunks[i:j], v_chunks[i:j], scaling))
        i = j
    return torch.cat(pieces, dim=0).unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, prefix_attention_forward)
# Plain calls (no stream) get exactly SDPA's masks; stream calls pass a ready 4D placeholder
# mask so that no [T, T] mask is ever built for the stream.
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why the shared-prefix path cannot run this model, or None when it can."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {cfg.model_type!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}"
    if cfg._attn_implementation not in ("sdpa", ATTN_IMPLEMENTATION):
        # Installing the prefix function would silently replace the chosen kernel with SDPA.
        return f"attention implementation {cfg._attn_implementation!r} (shared-prefix attention runs on sdpa)"
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "the model has sliding-window or other non-full attention layers"
    if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None) is not None:
        return "sliding-window attention is enabled"
    return None


def install(model: PreTrainedModel) -> None:
    """Route the model's attention through `prefix_attention_forward` (idempotent).

    Permanent on purpose: a layer recomputed under gradient checkpointing during backward
    must use the same attention function as its forward did.
    """
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


def stream_forward(model: PreTrainedModel, input_ids: torch.Tensor, layout: StreamLayout) -> torch.Tensor:
    """Final hidden states [T, d] of the decoder over a packed stream (`install` first)."""
    placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=input_ids.device)  # skips mask building
    out = model.get_decoder()(
        input_ids=input_ids.unsqueeze(0),
        position_ids=layout.position_ids,
        attention_mask=placeholder,
        use_cache=False,
        floe_stream=layout,
    )
    return out.last_hidden_state[0]


@dataclass(frozen=True)
class CostModel:
    """Forward FLOPs of the two layouts, for `prefix_dedup="auto"`.

    Per token the trunk costs 2·(decoder parameters); per attended (query, key) pair
    4·heads·head_dim per layer; per scored token the LM head and log-softmax cost about
    2·d·V + 20·V (exp and friends are far dearer than a multiply-add on CPU). The padded
    path processes B rows of the micro-batch's widest row W with causal attention
    (W²/2 pairs per row); the shared-prefix path processes P + ΣR tokens per part, P²/2
    prompt pairs and m·R_max·(P + R_max) masked segment pairs (the masked kernel does not
    skip blocks), plus a fixed per-part overhead for the extra kernel launches.
    """

    token_flops: float
    pair_flops: float
    head_flops: float
    part_overhead_flops: float

    @classmethod
    def from_model(cls, model: PreTrainedModel) -> CostModel:
        cfg = model.config
        layers = model.get_decoder().layers
        trunk = sum(p.numel() for p in layers.parameters())
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        d, vocab = cfg.hidden_size, cfg.vocab_size
        per_layer_token = 2.0 * trunk / max(1, len(layers))
        return cls(
            token_flops=2.0 * trunk,
            pair_flops=4.0 * cfg.num_attention_heads * head_dim * len(layers),
            head_flops=2.0 * d * vocab + 20.0 * vocab,
            part_overhead_flops=len(layers) * 64 * per_layer_token,  # ~64 tokens' worth per part-layer
        )

    @classmethod
    def generic(cls, d: int = 2048, layers: int = 28, vocab: int = 151_936) -> CostModel:
        """A typical dense decoder (about Qwen3-1.7B) when no model is at hand."""
        per_layer_token = 2.0 * 12 * d * d
        return cls(
            token_flops=layers * per_layer_token,
            pair_flops=4.0 * d * layers,
            head_flops=2.0 * d * vocab + 20.0 * vocab,
            part_overhead_flops=layers * 64 * per_layer_token,
        )

    def padded(self, prompt_lens: list[int], sample_lens: list[list[int]]) -> float:
        """One micro-batch of (prompt, samples) parts through the padded path."""
        widths = [p + r - 1 for p, rs in zip(prompt_lens, sample_lens) for r in rs]
        rows, width = len(widths), max(widths)
        scored = sum(sum(rs) for rs in sample_lens)
        return rows * width * self.token_flops + rows * width * width / 2 * self.pair_flops + scored * self.head_flops

    def shared_prefix(self, prompt_lens: list[int], sample_lens: list[list[int]]) -> float:
        """The same micro-batch through the shared-prefix stream."""
        total = 0.0
        for p, rs in zip(prompt_lens, sample_lens):
            segs = [r - 1 for r in rs if r > 1]
            r_max = max(segs, default=0)
            pairs = p * p / 2 + len(segs) * r_max * (p + r_max)
            total += (p + sum(segs)) * self.token_flops + pairs * self.pair_flops + self.part_overhead_flops
            total += sum(rs) * self.head_flops
        return total
