"""Shared-prefix attention against plain per-sample causal attention, values and gradients."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from floe.compute.prefix import build_stream, lower_right_causal_mask, prefix_attention_forward


def test_lower_right_mask() -> None:
    assert lower_right_causal_mask(2, 4, torch.device("cpu")).tolist() == [
        [True, True, True, False],
        [True, True, True, True],
    ]


def test_stream_layout_positions_and_chunks() -> None:
    layout = build_stream([(3, [2, 0, 1]), (2, [4])], torch.device("cpu"))
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2, 3, 4, 5]]
    assert layout.chunks == (3, 3, 6) and layout.length == 12
    assert [p.num_segments for p in layout.parts] == [2, 1]


def test_attention_matches_per_sample_causal() -> None:
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    parts = [(5, [3, 6, 1]), (4, [2]), (3, [4, 4])]
    layout = build_stream(parts, torch.device("cpu"))
    T = layout.length
    q = torch.randn(1, heads, T, dim, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, T, dim, generator=g, requires_grad=True)
    v = torch.randn(1, kv_heads, T, dim, generator=g, requires_grad=True)
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads)
    out, _ = prefix_attention_forward(module, q, k, v, None, scaling=0.3, floe_stream=layout)
    w = torch.randn(out.shape, generator=g)
    (out * w).sum().backward()
    got = [out.detach(), q.grad, k.grad, v.grad]

    # Reference: each sample as its own causal row [prompt | segment], prompt grads summed.
    q2, k2, v2 = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    ref = torch.zeros_like(out)
    loss = 0.0
    offset = 0
    for p, segs in parts:
        seg_start = offset + p
        for j, r in enumerate(segs):
            idx = torch.cat([torch.arange(offset, offset + p), torch.arange(seg_start, seg_start + r)])
            rk = k2[:, :, idx].repeat_interleave(heads // kv_heads, dim=1)
            rv = v2[:, :, idx].repeat_interleave(heads // kv_heads, dim=1)
            o = F.scaled_dot_product_attention(q2[:, :, idx], rk, rv, is_causal=True, scale=0.3).transpose(1, 2)
            ref[:, idx] = o.detach()  # prompt rows are identical for every sample
            # Count the prompt's output once (as the stream does), each segment's once.
            sel = torch.arange(p + r) if j == 0 else torch.arange(p, p + r)
            loss = loss + (o[:, sel] * w[:, idx[sel]]).sum()
            seg_start += r
        offset = seg_start
    loss.backward()
    torch.testing.assert_close(got[0], ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1:], [q2.grad, k2.grad, v2.grad]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
