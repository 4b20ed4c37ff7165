"""Shared-prefix decoding for the torch engine: a prompt's KV cache is stored once, not n times.

A chunk's prompts are prefilled once (left-padded, batch = prompts). Their keys/values stay in
one `[prompts, kv_heads, width, head_dim]` tensor per layer; each of the `prompts * n` rows
has its own small buffer for the keys/values of its generated tokens. A decode step calls the
model's decoder layers directly and attends over [shared prefix ; row's own tokens] with two
matmuls whose partial softmaxes are joined exactly (running max and sum, as flash attention
does), so the prefix is read once per prompt, not once per row.

Supported: Llama, Qwen2 and Qwen3 causal LMs with full attention only (`supports_prefix_decode`);
every other model keeps the engine's padded path.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

_FAMILIES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


def supports_prefix_decode(model: object) -> bool:
    """True when `model` is a Llama/Qwen2/Qwen3 causal LM with only full-attention layers
    (no sliding window), whose layers this module can run step by step."""
    if type(model).__name__ not in _FAMILIES:
        return False
    config = model.config  # type: ignore[attr-defined]
    if getattr(config, "use_sliding_window", False) or getattr(config, "pretraining_tp", 1) not in (None, 1):
        return False
    layer_types = getattr(config, "layer_types", None)
    return not layer_types or all(t == "full_attention" for t in layer_types)


def _filled(layer: object, name: str) -> torch.Tensor:
    """A full-attention cache layer's `keys` or `values` after prefill."""
    t = getattr(layer, name, None)
    assert isinstance(t, torch.Tensor), f"cache layer without {name}"
    return t


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PrefixDecoder:
    """One chunk's decode state: prompts' KV once, per-row KV for generated tokens.

    `prefill()` returns the logits [prompts * n, vocab] float32 of each row's first token;
    `step(chosen, keep)` keeps rows `keep` (indices into the current rows), feeds each its
    token `chosen[keep]` and returns their next logits [len(keep), vocab] float32."""

    def __init__(self, model, prompts: list[list[int]], n: int, max_tokens: int, pad_id: int, cache_kw: str = "past_key_values"):
        self.model, self.n, self.cache_kw = model, n, cache_kw
        self.inner = model.model
        cfg = model.config
        dev = next(model.parameters()).device
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.prompts, self.pad_id, self.dev, self.max_tokens = prompts, pad_id, dev, max_tokens

    def prefill(self) -> torch.Tensor:
        prompts, dev, n = self.prompts, self.dev, self.n
        width = max(len(p) for p in prompts)
        g = len(prompts)
        ids = torch.full((g, width), self.pad_id, dtype=torch.long, device=dev)
        mask = torch.zeros((g, width), dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, device=dev)
            mask[i, width - len(p):] = 1
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **{self.cache_kw: cache})
        self.pk = [_filled(layer, "keys") for layer in cache.layers]  # [g, kv_heads, width, head_dim]
        self.pv = [_filled(layer, "values") for layer in cache.layers]
        # Additive mask of the left padding: [g, 1, 1, width].
        self.bias = torch.zeros((g, 1, 1, width), dtype=self.pk[0].dtype, device=dev)
        self.bias.masked_fill_(mask[:, None, None, :] == 0, float("-inf"))
        rows = g * n
        self.group = torch.arange(g, device=dev).repeat_interleave(n)  # prompt of each row
        self.pos = torch.tensor([len(p) for p in prompts], device=dev).repeat_interleave(n)  # next position
        shape = (rows, self.kv_heads, self.max_tokens, self.head_dim)
        self.rk = [torch.empty(shape, dtype=k.dtype, device=dev) for k in self.pk]
        self.rv = [torch.empty(shape, dtype=k.dtype, device=dev) for k in self.pk]
        self.t = 0  # generated tokens in the row buffers
        self._layout()
        return out.logits[:, -1, :].float().repeat_interleave(n, dim=0)

    def _layout(self) -> None:
        """Slots of the live rows in the per-prompt layout [live prompts, M rows] used by the
        prefix matmul (M = most live rows of any prompt; missing rows are zero padding)."""
        groups, counts = torch.unique_consecutive(self.group, return_counts=True)
        self.m = int(counts.max())
        self.dense = groups.numel() * self.m == self.group.numel()
        starts = torch.cumsum(counts, 0) - counts
        within = torch.arange(self.group.numel(), device=self.dev) - starts.repeat_interleave(counts)
        self.slot = torch.arange(groups.numel(), device=self.dev).repeat_interleave(counts) * self.m + within
        self.live_groups = groups
        self.gk = [k[groups] for k in self.pk] if groups.numel() < self.pk[0].shape[0] else self.pk
        self.gv = [v[groups] for v in self.pv] if groups.numel() < self.pv[0].shape[0] else self.pv
        self.gbias = self.bias[groups] if groups.numel() < self.bias.shape[0] else self.bias

    def _attend(self, q: torch.Tensor, li: int, scale: float) -> torch.Tensor:
        """q [rows, kv_heads, rep, d] -> attention output [rows, kv_heads, rep, d]."""
        _, kvh, rep, d = q.shape
        ng = self.live_groups.numel()
        if self.dense:
            qp = q
        else:
            qp = q.new_zeros(ng * self.m, kvh, rep, d)
            qp[self.slot] = q
        qp = qp.view(ng, self.m, kvh, rep, d).permute(0, 2, 1, 3, 4).reshape(ng, kvh, self.m * rep, d)
        s = torch.matmul(qp, self.gk[li].transpose(-1, -2)).mul_(scale).add_(self.gbias)
        mp = s.amax(-1, keepdim=True)
        e = torch.exp_(s.sub_(mp))
        lp = e.sum(-1, keepdim=True)
        op = torch.matmul(e, self.gv[li])  # [ng, kvh, m*rep, d]

        def rows_of(x: torch.Tensor) -> torch.Tensor:
            w = x.shape[-1]
            x = x.view(ng, kvh, self.m, rep, w).permute(0, 2, 1, 3, 4).reshape(ng * self.m, kvh, rep, w)
            return x if self.dense else x[self.slot]

        op, mp, lp = rows_of(op), rows_of(mp), rows_of(lp)
        k = self.rk[li][:, :, : self.t + 1]
        v = self.rv[li][:, :, : self.t + 1]
        sr = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # [rows, kvh, rep, t+1]
        mr = sr.amax(-1, keepdim=True)
        er = torch.exp_(sr.sub_(mr))
        m = torch.maximum(mp, mr)
        ap, ar = torch.exp(mp - m), torch.exp(mr - m)
        num = op * ap + torch.matmul(er, v) * ar
        return num / (lp * ap + er.sum(-1, keepdim=True) * ar)

    def step(self, chosen: torch.Tensor, keep: list[int]) -> torch.Tensor:
        if len(keep) < self.group.numel():
            index = torch.tensor(keep, device=self.dev)
            chosen, self.group, self.pos = chosen[index], self.group[index], self.pos[index]
            for buf in (self.rk, self.rv):
                for i, b in enumerate(buf):
                    buf[i] = b.index_select(0, index)
            self._layout()
        rows, t = chosen.numel(), self.t
        x = self.inner.embed_tokens(chosen.view(rows, 1))  # [rows, 1, hidden]
        cos, sin = self.inner.rotary_emb(x, self.pos.view(rows, 1))  # [rows, 1, d]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        for li, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            y = layer.input_layernorm(x)
            q = attn.q_proj(y).view(rows, 1, h, d)
            k = attn.k_proj(y).view(rows, 1, kvh, d)
            v = attn.v_proj(y).view(rows, 1, kvh, d)
            if hasattr(attn, "q_norm"):  # Qwen3
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [rows, heads, 1, d]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.rk[li][:, :, t] = k[:, :, 0]
            self.rv[li][:, :, t] = v[:, 0]
            o = self._attend(q.reshape(rows, kvh, h // kvh, d), li, attn.scaling)
            x = x + attn.o_proj(o.reshape(rows, 1, h * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.t += 1
        self.pos = self.pos + 1
        return self.model.lm_head(self.inner.norm(x))[:, 0].float()
