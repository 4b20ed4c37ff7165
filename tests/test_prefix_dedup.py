"""Prompt dedup (shared-prefix attention) and micro-batching give the plain path's numbers.

For tiny Qwen3, Qwen2 and Llama models, with and without gradient checkpointing, every loss
aggregation, and a token budget small enough that groups are split across micro-batches:
the gradients of `forward_backward` through the shared-prefix layout equal those of the
padded path in one micro-batch (relative error < 1e-5, fp32), and so do forward log-probs
and entropies. An unsupported architecture (GPT-2) falls back to the padded path and logs it.
"""

from __future__ import annotations

import functools
import logging
import operator
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

import floe
from floe.backend.policy import PolicyZone
from floe.backend.scoring import plan_batch, score_batch, uses_prefix_dedup
from floe.compute.losses import resolve_loss
from floe.config import ComputeConfig, OptimizerConfig
from floe.models import make_tiny
from floe.models.loading import load_model
from floe.models.tiny import make_char_tokenizer

AGGREGATIONS = ["sum", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
ARCHS = ["qwen3", "qwen2", "llama"]
SPLIT_BUDGET = 25  # small enough that every group below is cut into several parts


def _save(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    make_char_tokenizer().save_pretrained(path)
    return path


def build_tiny(arch: str, path: Path) -> Path:
    """A tiny random-init model of the given architecture with floe's char tokenizer."""
    if arch == "qwen3":
        return make_tiny(path, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    tok = make_char_tokenizer()
    common = {
        "vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
    }
    if arch == "qwen2":
        cfg = Qwen2Config(**common, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    elif arch == "llama":
        cfg = LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    else:
        cfg = GPT2Config(
            vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=256,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        )
    torch.manual_seed(0)
    return _save(AutoModelForCausalLM.from_config(cfg), path)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prefix_models")
    return {arch: build_tiny(arch, root / arch) for arch in [*ARCHS, "gpt2"]}


def make_batch(vocab: int, seed: int = 0) -> floe.Batch:
    """Three groups (n = 4, 3, 1) with ragged samples, a 1-token sample, zero-weight tokens,
    per-token and scalar advantages, old and reference log-probs."""
    rng = random.Random(seed)
    groups = []
    for plen, lens in [(12, [5, 9, 1, 7]), (7, [3, 8, 4]), (10, [6])]:
        prompt = [rng.randrange(8, vocab) for _ in range(plen)]
        samples = []
        for i, n in enumerate(lens):
            weights = [0.0 if rng.random() < 0.2 else 1.0 for _ in range(n)]
            weights[0] = 1.0
            samples.append(
                floe.Sample(
                    tokens=[rng.randrange(8, vocab) for _ in range(n)],
                    logprobs=[-4.7 + rng.uniform(-0.5, 0.5) for _ in range(n)],
                    advantage=rng.uniform(-2, 2) if i % 2 else [rng.uniform(-2, 2) for _ in range(n)],
                    weights=weights,
                    ref_logprobs=[-4.7 + rng.uniform(-0.5, 0.5) for _ in range(n)],
                )
            )
        groups.append(floe.Group(prompt, samples))
    return floe.Batch(groups)


def _grads(zone: PolicyZone) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in zone.params])


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad_ckpt"])
@pytest.mark.parametrize("arch", ARCHS)
def test_dedup_gradients_equal_plain(model_dirs: dict[str, Path], arch: str, checkpointing: bool) -> None:
    model = load_model(str(model_dirs[arch]))
    batch = make_batch(model.config.vocab_size)
    plain = ComputeConfig(prefix_dedup="off", gradient_checkpointing=checkpointing)
    dedup = ComputeConfig(
        prefix_dedup="on", gradient_checkpointing=checkpointing, max_tokens_per_microbatch=SPLIT_BUDGET
    )
    zone = PolicyZone(model, OptimizerConfig(), plain)
    plan = plan_batch(batch, dedup, uses_prefix_dedup(model, dedup))
    assert len(plan) > 1 and all(mb.layout == "shared_prefix" for mb in plan)
    assert any(sum(p.group == g for mb in plan for p in mb.parts) > 1 for g in range(len(batch.groups)))
    for loss, extra in [("ppo", {"dual_clip": 3.0}), ("gspo", {})]:
        for aggregation in AGGREGATIONS if loss == "ppo" else ["token_mean"]:
            spec = resolve_loss(
                loss, {"aggregation": aggregation, "kl": {"coef": 0.1}, "entropy": {"coef": 0.01}, **extra}
            )
            zone.compute = plain
            ref = zone.forward_backward(batch, spec, temperature=0.9)
            g_ref = _grads(zone)
            zone.optimizer.zero_grad(set_to_none=True)
            zone.compute = dedup
            out = zone.forward_backward(batch, spec, temperature=0.9)
            g_dedup = _grads(zone)
            zone.optimizer.zero_grad(set_to_none=True)
            assert _rel_err(g_dedup, g_ref) < 1e-5, (loss, aggregation)
            assert out.metrics["loss"] == pytest.approx(ref.metrics["loss"], rel=1e-5, abs=1e-7)
            for lp_a, lp_b in zip(functools.reduce(operator.iadd, out.logprobs, []), functools.reduce(operator.iadd, ref.logprobs, [])):
                assert lp_a == pytest.approx(lp_b, abs=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_dedup_forward_equals_plain(model_dirs: dict[str, Path], arch: str) -> None:
    model = load_model(str(model_dirs[arch]))
    batch = make_batch(model.config.vocab_size, seed=1)
    with torch.no_grad():
        ref = score_batch(model, batch, 0.7, True, ComputeConfig(prefix_dedup="off"))
        out = score_batch(model, batch, 0.7, True, ComputeConfig(prefix_dedup="on", max_tokens_per_microbatch=30))
    assert out.entropy is not None and ref.entropy is not None
    for a, b in zip(functools.reduce(operator.iadd, out.logprobs, []) + functools.reduce(operator.iadd, out.entropy, []), functools.reduce(operator.iadd, ref.logprobs, []) + functools.reduce(operator.iadd, ref.entropy, [])):
        assert a == pytest.approx(b, abs=1e-5)


def test_unsupported_arch_falls_back_and_logs(
    model_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    model = load_model(str(model_dirs["gpt2"]))
    batch = make_batch(model.config.vocab_size, seed=2)
    with caplog.at_level(logging.INFO, logger="floe"):
        assert not uses_prefix_dedup(model, ComputeConfig(prefix_dedup="on"))
    assert any("padded path" in r.message and "gpt2" in r.message for r in caplog.records)
    compute = ComputeConfig(prefix_dedup="on", max_tokens_per_microbatch=SPLIT_BUDGET)
    assert not any(mb.layout == "shared_prefix" for mb in plan_batch(batch, compute, uses_prefix_dedup(model, compute)))
    with torch.no_grad():
        out = score_batch(model, batch, 1.0, False, compute)
    assert [len(lp) for lp in functools.reduce(operator.iadd, out.logprobs, [])] == [len(s.tokens) for g in batch.groups for s in g.samples]


def test_auto_takes_dedup_only_where_it_pays(model_dirs: dict[str, Path]) -> None:
    model = load_model(str(model_dirs["qwen3"]))
    auto = ComputeConfig(prefix_dedup="auto")
    allowed = uses_prefix_dedup(model, auto)
    assert allowed

    def batch(prompt_len: int, n: int, sample_len: int) -> floe.Batch:
        return floe.Batch([floe.Group([9] * prompt_len, [floe.Sample([10] * sample_len) for _ in range(n)])])

    assert all(mb.layout == "shared_prefix" for mb in plan_batch(batch(200, 8, 20), auto, allowed, model))
    assert not any(mb.layout == "shared_prefix" for mb in plan_batch(batch(200, 1, 20), auto, allowed, model))
    assert not any(mb.layout == "shared_prefix" for mb in plan_batch(batch(4, 2, 200), auto, allowed, model))
    assert not any(mb.layout == "shared_prefix" for mb in plan_batch(batch(200, 8, 20), ComputeConfig(prefix_dedup="off"), False))
