"""A seeded GRPO step on the Backend's operations, for comparing placements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

import floe
from floe.grpo import batch_from_samples
from floe.types import THROUGHPUT_METRICS, Batch, Group, Sample

PROMPTS = [[8 + (3 * i + j) % 40 for j in range(3 + i % 4)] for i in range(6)]
LOSS = {"clip_low": 0.2, "clip_high": 0.28, "kl": {"coef": 0.05, "estimator": "k3"}, "aggregation": "token_mean"}


def reward(tokens: list[int]) -> float:
    """A simple deterministic reward: the share of even token ids."""
    return sum(1 for t in tokens if t % 2 == 0) / max(len(tokens), 1)


@dataclass
class Record:
    tokens: list[list[list[int]]] = field(default_factory=list)  # [step][sample] tokens
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    # per step: (forward's, forward_backward's) throughput keys and counts (floe.types.THROUGHPUT_METRICS)
    measured: list[tuple[Any, ...]] = field(default_factory=list)


def grpo_step(backend: Any, step: int, record: Record) -> None:
    """sample (seeded) → rewards → advantages → reference forward → forward_backward (ppo + kl)
    → optim_step → sync_weights."""
    params = floe.SamplingParams(max_tokens=6, temperature=1.0, seed=1000 + step)
    out = backend.sample(PROMPTS, 4, params)
    record.tokens.append([list(s.tokens) for g in out.groups for s in g.samples])
    record.versions.append(out.weights_version)
    rewards = [[reward(s.tokens) for s in g.samples] for g in out.groups]
    batch = batch_from_samples(out, rewards)
    ref = backend.forward(batch, zone="reference")
    batch = Batch([
        Group(g.prompt, [Sample(s.tokens, s.logprobs, s.advantage, s.weights, lp, s.temperature)
                         for s, lp in zip(g.samples, ref_g)])
        for g, ref_g in zip(batch.groups, ref.logprobs)
    ])
    fb = backend.forward_backward(batch, "ppo", LOSS)
    st = backend.optim_step()
    backend.sync_weights()
    record.losses.append(fb.metrics["loss"])
    record.grad_norms.append(st.grad_norm)
    record.steps.append(st.step)
    counted = [(sorted(k for k in m if k in THROUGHPUT_METRICS), m["sequence_tokens"], m["model_flops"])
               for m in (ref.metrics, fb.metrics)]
    assert all(m["seconds"] > 0 for m in (ref.metrics, fb.metrics))
    record.measured.append(tuple(counted))


def weights(backend: Any) -> dict[str, torch.Tensor]:
    """The policy's full weights by state-dict name."""
    return {k: v.detach().float().cpu() for k, v in backend.policy.publish().tensors.items()}


def assert_close_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        diff = (value - b[name]).abs().max().item()
        assert diff <= tol, f"{name}: max |diff| {diff} > {tol}"
