"""Model FLOPs of a decoder-only transformer, device peaks, and MFU: the one formula floe reports.

Training FLOPs (forward + backward) of one sequence of s tokens:

    F_train(s) = 6 · P · s  +  12 · L · H · d_h · s²        F_forward(s) = F_train(s) / 3

* P = the weights of every matrix multiply a token goes through: per decoder layer the
  attention projections d·(H·d_h + 2·K·d_h) (q, k, v) + H·d_h·d (o) and the MLP m·d·d_ff
  (m = 3 for a gated MLP: gate, up, down), times L layers, plus the LM head V·d (tied to the
  embedding or not). The embedding lookup, norms, biases, rotary and softmax are not matrix
  multiplies and are not counted. A matrix multiply costs 2 FLOPs per weight per token
  forward and 4 backward (the input's and the weight's gradient): 6·P per token.
* 12·L·H·d_h·s²: per layer the scores Q·Kᵀ and the weighted values A·V, 2·s²·H·d_h FLOPs each
  forward, ×3 with their backward; the full s×s matrix is counted (no discount for the causal
  mask), as the formula's source does.
* L layers, d hidden size, H query heads, K key/value heads, d_h head dim, d_ff MLP width, V
  vocabulary (`TransformerShape`).

Source: PaLM (Chowdhery et al. 2022), appendix B, "model FLOPs per token = 6N + 12·L·H·Q·T"
(N the matmul parameters, Q the head dim, T the sequence length), summed over a sequence's
tokens. MFU (same appendix) = the model FLOPs of the work / seconds / the peak FLOP/s of the
devices that did it. A sequence is counted whole (its prompt and its sample tokens) for every
sample, as verl's `global_token_num` and SkyRL's `attention_mask.sum()` count it: floe's prefix
dedup computes a group's prompt once, so the FLOPs floe actually spends are fewer than counted.

verl's `verl.utils.flops_counter.FlopsCounter` (what verl's workers log as `perf/mfu/actor`)
counts differently: the embedding as a second V·d matrix and the attention term at 6 (half,
for the causal mask); floe's verl plugin logs verl's number (docs/integrations.md).

`tests/compute/test_flops.py` checks `training_flops` against `torch.utils.flop_counter.
FlopCounterMode` on a real forward + backward of the tiny Qwen3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PEAK_BF16_TFLOPS",
    "TransformerShape",
    "forward_flops",
    "mfu",
    "peak_flops",
    "throughput_metrics",
    "training_flops",
]

# Model types whose decoder layers are exactly: q/k/v/o projections, full attention, a gated
# 3-matrix MLP (`from_config` refuses the others rather than guess).
_GATED_DENSE = frozenset({"llama", "qwen2", "qwen3", "mistral"})

# Dense (no sparsity) BF16 tensor-core peak of one GPU, TFLOP/s, from NVIDIA's datasheets. Keys
# are matched against torch.cuda.get_device_name() (the longest key found in the name wins, so
# "NVIDIA H100 PCIe" is not taken for an SXM H100). Only bfloat16 compute has a peak here.
PEAK_BF16_TFLOPS: dict[str, float] = {
    "A100": 312.0,  # A100 SXM4 and PCIe
    "H100": 989.0,  # H100 SXM5
    "H100 PCIe": 756.0,
    "H200": 989.0,  # H200 SXM (and GH200's GPU)
    "L40S": 362.0,
}


@dataclass(frozen=True)
class TransformerShape:
    """The sizes `training_flops` needs (module docstring): L `layers`, d `hidden`, H `heads`,
    K `kv_heads`, d_h `head_dim`, d_ff `intermediate`, V `vocab`."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: Any) -> TransformerShape | None:
        """The shape of a Hugging Face config of a dense gated-MLP decoder (model_type llama,
        qwen2, qwen3, mistral; a multimodal config's text part); None for any other (mixture
        of experts, other MLPs or attention), whose FLOPs this formula would get wrong."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text, "model_type", None) not in _GATED_DENSE:
            return None
        heads = int(text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(
            layers=int(text.num_hidden_layers), hidden=int(text.hidden_size), heads=heads,
            kv_heads=int(getattr(text, "num_key_value_heads", None) or heads), head_dim=int(head_dim),
            intermediate=int(text.intermediate_size), vocab=int(text.vocab_size),
        )

    @property
    def matmul_params(self) -> int:
        """P: weights of the matrix multiplies per token (decoder layers + LM head)."""
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = d * (q + 2 * kv) + q * d + 3 * d * self.intermediate
        return self.layers * per_layer + self.vocab * d


def training_flops(shape: TransformerShape, seqlens: Sequence[int]) -> float:
    """Σ over sequences of F_train(s) = 6·P·s + 12·L·H·d_h·s² (module docstring; PaLM appendix B);
    `seqlens[i]` = tokens of sequence i (prompt + sample)."""
    tokens = sum(seqlens)
    squares = sum(s * s for s in seqlens)
    return float(6 * shape.matmul_params * tokens + 12 * shape.layers * shape.heads * shape.head_dim * squares)


def forward_flops(shape: TransformerShape, seqlens: Sequence[int]) -> float:
    """The forward pass alone: `training_flops` / 3 (2·P·s + 4·L·H·d_h·s² per sequence)."""
    return training_flops(shape, seqlens) / 3.0


def peak_flops(device_name: str, dtype: str, configured_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device: `configured_tflops` × 1e12 when given (BackendConfig
    `compute.peak_tflops`); else, for bfloat16 compute on a GPU named in `PEAK_BF16_TFLOPS`,
    its datasheet peak; else None (unknown: a CPU, another GPU, float32 compute)."""
    if configured_tflops is not None:
        return float(configured_tflops) * 1e12
    if dtype != "bfloat16":
        return None
    found = [key for key in PEAK_BF16_TFLOPS if key in device_name]
    return PEAK_BF16_TFLOPS[max(found, key=len)] * 1e12 if found else None


def mfu(flops: float, seconds: float, peak: float | None, devices: int) -> float | None:
    """Model FLOPs utilisation, a fraction: `flops` / `seconds` / (`peak` FLOP/s × `devices`);
    None when the peak is unknown or no time was measured."""
    if peak is None or peak <= 0 or seconds <= 0 or devices < 1:
        return None
    return flops / seconds / (peak * devices)


def throughput_metrics(
    shape: TransformerShape | None, seqlens: Sequence[int], seconds: float, peak: float | None, devices: int,
    backward: bool,
) -> dict[str, float]:
    """What a `forward` (`backward` False) or `forward_backward` call reports about itself
    (floe.types.THROUGHPUT_METRICS): `seconds`, `sequence_tokens` = Σ `seqlens`,
    `tokens_per_second`, and, when `shape` is known, `model_flops` (training or forward FLOPs)
    and, when `peak` is known too, `mfu`."""
    tokens = float(sum(seqlens))
    out = {"seconds": seconds, "sequence_tokens": tokens, "tokens_per_second": tokens / seconds if seconds > 0 else 0.0}
    if shape is not None:
        flops = training_flops(shape, seqlens) if backward else forward_flops(shape, seqlens)
        out["model_flops"] = flops
        utilisation = mfu(flops, seconds, peak, devices)
        if utilisation is not None:
            out["mfu"] = utilisation
    return out
