"""floe's FLOPs formula (compute/flops.py) against torch's own count of a real forward + backward.

torch.utils.flop_counter.FlopCounterMode counts every matrix multiply torch runs (mm, addmm,
bmm, and attention when it is written as matmuls: eager attention). On the tiny Qwen3 it must
equal 6·P·s + 12·L·H·d_h·s² exactly (tolerance: float rounding only, rel 1e-12); under SDPA on
CPU torch's fused attention kernel is not counted by FlopCounterMode, so eager is the reference.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, GPT2Config, Qwen3Config, Qwen3MoeConfig

from floe.compute.flops import PEAK_BF16_TFLOPS, TransformerShape, forward_flops, mfu, peak_flops, training_flops
from floe.models import make_tiny


def _counted(model: torch.nn.Module, seqlen: int, backward: bool) -> int:
    ids = torch.randint(0, model.config.vocab_size, (1, seqlen), generator=torch.Generator().manual_seed(seqlen))
    with FlopCounterMode(display=False) as counter:
        if backward:
            model(ids).logits.float().sum().backward()
        else:
            with torch.no_grad():
                model(ids)
    return counter.get_total_flops()


@pytest.mark.parametrize("tied", [False, True])
def test_formula_equals_torchs_count_of_a_real_forward_backward(tmp_path, tied):
    path = make_tiny(tmp_path / "tiny", head_dim=24, tie_word_embeddings=tied)  # head_dim != hidden / heads
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    shape = TransformerShape.from_config(model.config)
    assert shape == TransformerShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=24, intermediate=128,
                                     vocab=model.config.vocab_size)
    seqlens = [7, 37, 90]
    counted = sum(_counted(model, s, backward=True) for s in seqlens)
    assert training_flops(shape, seqlens) == pytest.approx(counted, rel=1e-12)
    counted_forward = sum(_counted(model, s, backward=False) for s in seqlens)
    assert forward_flops(shape, seqlens) == pytest.approx(counted_forward, rel=1e-12)
    # The attention term is what makes sequences of the same total differ.
    assert training_flops(shape, [67, 67]) < training_flops(shape, [124, 10])


def test_shapes_the_formula_does_not_cover_are_refused():
    moe = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)
    assert TransformerShape.from_config(moe) is None
    assert TransformerShape.from_config(GPT2Config()) is None
    dense = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=4, head_dim=16, vocab_size=100)
    shape = TransformerShape.from_config(dense)
    assert shape is not None and shape.layers == 3 and shape.kv_heads == 4 and shape.head_dim == 16
    # P by hand: per layer q,k,v,o = 4·64·64, MLP 3·64·128; LM head 100·64.
    assert shape.matmul_params == 3 * (4 * 64 * 64 + 3 * 64 * 128) + 100 * 64


def test_peak_flops_from_config_table_or_unknown():
    assert peak_flops("cpu", "float32") is None
    assert peak_flops("cpu", "bfloat16") is None
    assert peak_flops("cpu", "float32", configured_tflops=0.25) == 0.25e12  # the setting wins
    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12  # longest key wins
    assert peak_flops("NVIDIA A100-SXM4-80GB", "bfloat16") == PEAK_BF16_TFLOPS["A100"] * 1e12
    assert peak_flops("NVIDIA H200", "float32") is None  # the table holds bf16 peaks only
    assert peak_flops("NVIDIA GeForce RTX 4090", "bfloat16") is None


def test_mfu():
    assert mfu(2e12, 4.0, 1e12, 1) == pytest.approx(0.5)
    assert mfu(2e12, 4.0, 1e12, 2) == pytest.approx(0.25)
    assert mfu(2e12, 4.0, None, 1) is None
    assert mfu(2e12, 0.0, 1e12, 1) is None
