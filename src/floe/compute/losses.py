"""RL and SFT losses on flat per-token tensors, chosen by name with a validated config.

Every loss is written per token (see docs/losses.md for the formulas) and aggregated with an
explicit per-token `scale` that the caller computes once for the whole `forward_backward`
batch (`aggregation_scales`). Because the scale is fixed before any micro-batch runs, summing
micro-batch losses gives exactly the loss (and gradients) of one pass over the whole batch.

Pure tensor math: no model, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from floe.config import StrictModel, parse_config
from floe.errors import InvalidInput

Aggregation = Literal["sum", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


class KLConfig(StrictModel):
    """KL penalty against the reference log-probs: coef * k per token."""

    coef: float = Field(0.0, ge=0)
    estimator: Literal["k1", "k2", "k3"] = "k3"


class EntropyConfig(StrictModel):
    """Entropy bonus: -coef * H per token."""

    coef: float = Field(0.0, ge=0)


class LossConfig(StrictModel):
    """Keys shared by every loss."""

    aggregation: Aggregation = "token_mean"
    norm_length: int | None = Field(
        None, gt=0, description="seq_mean_token_sum_norm only; default: longest sample in batch"
    )
    kl: KLConfig = KLConfig()
    entropy: EntropyConfig = EntropyConfig()

    @model_validator(mode="after")
    def _norm_length_only_for_sum_norm(self) -> "LossConfig":
        if self.norm_length is not None and self.aggregation != "seq_mean_token_sum_norm":
            raise ValueError("norm_length is only used by aggregation='seq_mean_token_sum_norm'")
        return self


class CrossEntropyConfig(LossConfig):
    pass


class ImportanceSamplingConfig(LossConfig):
    pass


class ClippedConfig(LossConfig):
    """Clip keys are epsilons: the ratio is clipped to [1 - clip_low, 1 + clip_high]."""

    clip_low: float = Field(0.2, ge=0, le=1)
    clip_high: float = Field(0.2, ge=0)


class PPOConfig(ClippedConfig):
    dual_clip: float | None = Field(None, gt=1, description="c > 1; for A < 0 caps the loss at -c*A")


class CISPOConfig(ClippedConfig):
    # Ratio clipped to [0, 4]: CISPO only bounds the importance weight, it never drops tokens.
    clip_low: float = Field(1.0, ge=0, le=1)
    clip_high: float = Field(3.0, ge=0)


class GSPOConfig(ClippedConfig):
    # The GSPO paper's sequence-ratio clip range.
    clip_low: float = Field(3e-4, ge=0, le=1)
    clip_high: float = Field(4e-4, ge=0)


LOSS_CONFIGS: dict[str, type[LossConfig]] = {
    "cross_entropy": CrossEntropyConfig,
    "importance_sampling": ImportanceSamplingConfig,
    "ppo": PPOConfig,
    "cispo": CISPOConfig,
    "gspo": GSPOConfig,
}


@dataclass(frozen=True)
class LossSpec:
    """A resolved loss: its name and validated config."""

    name: str
    config: LossConfig

    @property
    def needs_old_logprobs(self) -> bool:
        return self.name != "cross_entropy"

    @property
    def needs_advantages(self) -> bool:
        return self.name != "cross_entropy"

    @property
    def needs_ref_logprobs(self) -> bool:
        return self.config.kl.coef > 0

    @property
    def needs_entropy_grad(self) -> bool:
        return self.config.entropy.coef > 0

    def resolved(self) -> dict[str, Any]:
        return self.config.model_dump()


def resolve_loss(name: str, config: dict[str, Any] | None) -> LossSpec:
    """Validate a loss name and config dict; unknown names and keys are errors."""
    if name not in LOSS_CONFIGS:
        raise InvalidInput("loss", f"unknown loss {name!r}; choose one of {sorted(LOSS_CONFIGS)}")
    if config is not None and not isinstance(config, dict):
        raise InvalidInput("loss_config", "must be a mapping of config keys to values")
    return LossSpec(name, parse_config(LOSS_CONFIGS[name], config or {}, where="loss_config"))


@dataclass
class TokenInputs:
    """Flat per-token tensors for the samples of one micro-batch (concatenated in order).

    `sample_index[t]` says which sample (0..num_samples-1 within this micro-batch) token t
    belongs to; `scale[t]` is the aggregation factor (see `aggregation_scales`).
    """

    logp: torch.Tensor
    weights: torch.Tensor
    scale: torch.Tensor
    sample_index: torch.Tensor
    num_samples: int
    old_logp: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def aggregation_scales(
    lengths: list[int], weight_sums: list[float], aggregation: str, norm_length: int | None
) -> list[float]:
    """Per-sample factor that turns Σ_t w·ℓ into the aggregated loss of the whole batch.

    `lengths` and `weight_sums` cover every sample of the forward_backward call, so the
    denominators are global even when the call is split into micro-batches.
    """
    n = len(lengths)
    if aggregation == "sum":
        return [1.0] * n
    if aggregation == "token_mean":
        total = sum(weight_sums)
        return [1.0 / total if total > 0 else 0.0] * n
    if aggregation == "seq_mean_token_mean":
        return [(1.0 / (n * ws)) if ws > 0 else 0.0 for ws in weight_sums]
    if aggregation == "seq_mean_token_sum_norm":
        norm = norm_length if norm_length is not None else max(lengths)
        return [1.0 / (n * norm)] * n
    raise InvalidInput("loss_config.aggregation", f"unknown aggregation {aggregation!r}")


def _clip_ratio(ratio: torch.Tensor, cfg: ClippedConfig) -> torch.Tensor:
    return ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)


def _kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    diff = logp - ref_logp
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff**2
    return torch.exp(-diff) + diff - 1.0  # k3 = exp(ref - logp) - (ref - logp) - 1


def _segment_sum(values: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, index, values)


def per_token_policy_loss(spec: LossSpec, x: TokenInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The unweighted per-token loss ℓ_t and a bool tensor marking clipped tokens."""
    name, cfg = spec.name, spec.config
    if name == "cross_entropy":
        return -x.logp, torch.zeros_like(x.logp, dtype=torch.bool)
    assert x.old_logp is not None and x.advantages is not None
    adv = x.advantages
    if name == "gspo":
        assert isinstance(cfg, GSPOConfig)
        # s_i = exp(mean over the sample's loss tokens of (logp - old)); gradient flows through it.
        mask = (x.weights != 0).to(x.logp.dtype)
        delta_sum = _segment_sum((x.logp - x.old_logp) * mask, x.sample_index, x.num_samples)
        count = _segment_sum(mask, x.sample_index, x.num_samples).clamp_min(1.0)
        seq_ratio = torch.exp(delta_sum / count)[x.sample_index]
        clipped_ratio = _clip_ratio(seq_ratio, cfg)
        loss = -torch.minimum(seq_ratio * adv, clipped_ratio * adv)
        clipped = (seq_ratio * adv).detach() > (clipped_ratio * adv).detach()
        return loss, clipped
    ratio = torch.exp(x.logp - x.old_logp)
    if name == "importance_sampling":
        return -ratio * adv, torch.zeros_like(ratio, dtype=torch.bool)
    if name == "cispo":
        assert isinstance(cfg, CISPOConfig)
        clipped_ratio = _clip_ratio(ratio, cfg).detach()
        clipped = (ratio.detach() != clipped_ratio)
        return -clipped_ratio * adv * x.logp, clipped
    assert name == "ppo" and isinstance(cfg, PPOConfig)
    clipped_ratio = _clip_ratio(ratio, cfg)
    unclipped_obj, clipped_obj = ratio * adv, clipped_ratio * adv
    loss = -torch.minimum(unclipped_obj, clipped_obj)
    clipped = unclipped_obj.detach() > clipped_obj.detach()
    if cfg.dual_clip is not None:
        cap = -cfg.dual_clip * adv
        dual_active = (adv < 0) & (loss.detach() > cap.detach())
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
        clipped = clipped | dual_active
    return loss, clipped


def compute_loss(spec: LossSpec, x: TokenInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """Aggregated loss of one micro-batch and the raw sums its metrics are built from.

    The returned loss is Σ_t scale_t · w_t · (ℓ_t + kl_coef·k_t − entropy_coef·H_t); the sums
    are combined across micro-batches by `finalize_metrics`.
    """
    cfg = spec.config
    loss_tok, clipped = per_token_policy_loss(spec, x)
    if cfg.kl.coef > 0:
        assert x.ref_logp is not None
        loss_tok = loss_tok + cfg.kl.coef * _kl_estimate(x.logp, x.ref_logp, cfg.kl.estimator)
    if cfg.entropy.coef > 0:
        assert x.entropy is not None
        loss_tok = loss_tok - cfg.entropy.coef * x.entropy
    weighted = loss_tok * x.weights
    loss = (weighted * x.scale).sum()

    with torch.no_grad():
        active = x.weights != 0
        n_active = int(active.sum())
        sums: dict[str, float] = {
            "loss": float(loss),
            "tokens": float(n_active),
            "weight_sum": float(x.weights.sum()),
            "clipped_tokens": float((clipped & active).sum()),
        }
        if x.entropy is not None:
            sums["entropy_sum"] = float(x.entropy[active].sum())
        if x.old_logp is not None and n_active:
            log_ratio = (x.logp - x.old_logp)[active]
            ratio = torch.exp(log_ratio)
            sums["ratio_sum"] = float(ratio.sum())
            sums["ratio_min"] = float(ratio.min())
            sums["ratio_max"] = float(ratio.max())
            sums["kl_sampler_sum"] = float(_kl_estimate(x.logp[active], x.old_logp[active], "k3").sum())
        if x.ref_logp is not None and n_active:
            sums["kl_ref_sum"] = float(_kl_estimate(x.logp[active], x.ref_logp[active], "k3").sum())
    return loss, sums


def finalize_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Combine micro-batch sums into the metrics reported by forward_backward."""
    tokens = sum(p["tokens"] for p in parts)
    out = {
        "loss": sum(p["loss"] for p in parts),
        "tokens": tokens,
        "clip_fraction": sum(p["clipped_tokens"] for p in parts) / tokens if tokens else 0.0,
    }
    denom = max(tokens, 1.0)
    if any("entropy_sum" in p for p in parts):
        out["entropy"] = sum(p.get("entropy_sum", 0.0) for p in parts) / denom
    if any("ratio_sum" in p for p in parts):
        out["ratio_mean"] = sum(p.get("ratio_sum", 0.0) for p in parts) / denom
        out["ratio_min"] = min(p["ratio_min"] for p in parts if "ratio_min" in p)
        out["ratio_max"] = max(p["ratio_max"] for p in parts if "ratio_max" in p)
        out["approx_kl_sampler"] = sum(p.get("kl_sampler_sum", 0.0) for p in parts) / denom
    if any("kl_ref_sum" in p for p in parts):
        out["kl_ref"] = sum(p.get("kl_ref_sum", 0.0) for p in parts) / denom
    return out
