"""The loss registry and the per-token loss math, chosen by name with a validated config.

`LOSSES` holds one `LossDef` per loss: its name, its config class, its per-token function and
the inputs it needs (old log-probs, advantages, reference log-probs). Everything else is
derived from it: `resolve_loss` (name + config dict -> `LossSpec`), the `LossSpec.needs_*`
checks the backend validates batches with, `loss_capabilities()` (what `info()` reports) and
the recipe's `[train.loss]` union (floe.rl.config). Adding a loss is one `LossDef`.

Every loss is written per token (see docs/losses.md for the formulas) and aggregated with an
explicit per-token `scale` that the caller computes once for the whole `forward_backward`
batch (`aggregation_scales`). Because the scale is fixed before any micro-batch runs, summing
micro-batch losses gives exactly the loss (and gradients) of one pass over the whole batch.

Pure tensor math: no model, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import Field, model_validator

from floe.config import StrictModel, parse_config
from floe.errors import InvalidInput

# torch is imported inside the functions that compute, not here: recipes validate their
# [train.loss] table against this registry, and `floe train` must report a typo in well under
# a second, before torch (1-5 s to import) loads.
if TYPE_CHECKING:
    import torch

Aggregation = Literal["sum", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]
LossInput = Literal["old_logprobs", "advantages", "ref_logprobs"]


class KLConfig(StrictModel):
    """KL penalty against the reference log-probs: coef * k per token, aggregated by
    `aggregation` (None: the loss's own `aggregation`)."""

    coef: float = Field(0.0, ge=0)
    estimator: KLEstimator = "k3"
    aggregation: Aggregation | None = Field(
        None, description="how the KL term is aggregated; None: the loss's aggregation (verl: loss_agg_mode, "
        "SkyRL: seq_mean_token_mean)"
    )


class EntropyConfig(StrictModel):
    """Entropy bonus: -coef * H per token, aggregated by `aggregation` (None: the loss's own)."""

    coef: float = Field(0.0, ge=0)
    aggregation: Aggregation | None = Field(
        None, description="how the entropy term is aggregated; None: the loss's aggregation"
    )


class LossConfig(StrictModel):
    """Keys shared by every loss."""

    aggregation: Aggregation = "token_mean"
    norm_length: int | None = Field(
        None, gt=0, description="seq_mean_token_sum_norm only; default: longest sample in batch"
    )
    kl: KLConfig = KLConfig()
    entropy: EntropyConfig = EntropyConfig()

    @model_validator(mode="after")
    def _norm_length_only_for_sum_norm(self) -> LossConfig:
        if self.norm_length is not None and "seq_mean_token_sum_norm" not in self.term_aggregations():
            raise ValueError("norm_length is only used by aggregation='seq_mean_token_sum_norm' (of the loss, "
                             "kl or entropy)")
        return self

    def term_aggregations(self) -> tuple[str, str, str]:
        """The aggregation of the policy term, the KL term and the entropy term, in that order
        (a term's None is the loss's `aggregation`)."""
        return (self.aggregation, self.kl.aggregation or self.aggregation,
                self.entropy.aggregation or self.aggregation)


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
    out_of_range: Literal["clamp", "zero"] = Field(
        "clamp",
        description="clamp: the weight is clip(r) (CISPO); zero: the weight is r inside "
        "(1 - clip_low, 1 + clip_high) and 0 outside (SkyRL's rollout_is)",
    )


class GSPOConfig(ClippedConfig):
    # The GSPO paper's sequence-ratio clip range.
    clip_low: float = Field(3e-4, ge=0, le=1)
    clip_high: float = Field(4e-4, ge=0)
    ratio_gradient: Literal["sequence", "token"] = Field(
        "sequence",
        description="sequence: every token's ratio is s with the gradient of s (through the mean); "
        "token (GSPO-token, Tinker's gspo): s's value with the gradient of the token's own logp",
    )
    log_ratio_cap: float | None = Field(
        None,
        description="clamp log s_t at this value before the exp (value capped, gradient 0 above it); "
        "verl and SkyRL use 10. None: no cap (bounded_exp only)",
    )


class DROConfig(LossConfig):
    """Direct reward optimisation (Tinker's `dro`): a quadratic penalty on logp − logp_old."""

    beta: float = Field(0.05, ge=0, description="weight of the squared log-ratio penalty")


class SAPOConfig(LossConfig):
    """Soft adaptive policy optimisation: a sigmoid gate on the ratio instead of a hard clip."""

    tau_pos: float = Field(1.0, gt=0, description="gate temperature for tokens with A > 0")
    tau_neg: float = Field(1.05, gt=0, description="gate temperature for tokens with A <= 0")


class DPPOConfig(LossConfig):
    """Divergence PPO: tokens whose probability moved too far (TV or binary KL) are dropped.

    binary_tv / binary_kl look only in the direction the advantage pushes (DPPO); tv drops a token
    whose probability moved beyond [−delta_low, delta_high] either way (prime-rl's `ipo` loss)."""

    divergence: Literal["binary_tv", "binary_kl", "tv"] = "binary_tv"
    delta_low: float = Field(0.2, ge=0, description="divergence threshold for tokens with A <= 0")
    delta_high: float = Field(0.2, ge=0, description="divergence threshold for tokens with A > 0")
    surrogate: Literal["ratio", "log_prob"] = Field(
        "ratio",
        description="ratio: -r*A*valid, gradient through r (SkyRL's dppo); log_prob: "
        "-sg(min(r, ratio_cap))*A*logp*valid (verl's dppo_tv / dppo_kl)",
    )
    ratio_cap: float | None = Field(
        None, gt=0, description="log_prob surrogate only: truncate the stop-gradient weight at this value"
    )

    @model_validator(mode="after")
    def _cap_only_for_log_prob(self) -> DPPOConfig:
        if self.ratio_cap is not None and self.surrogate != "log_prob":
            raise ValueError("ratio_cap is only used by surrogate='log_prob'")
        return self


class GeoMeanConfig(LossConfig):
    """Geometric-mean policy optimisation (GMPO): clip the log-ratio per token, then take the
    sequence's geometric mean. Clip keys are epsilons on the log-ratio: [-clip_low, clip_high]."""

    clip_low: float = Field(0.4, ge=0)
    clip_high: float = Field(0.4, ge=0)


class ClipCovConfig(ClippedConfig):
    """PPO (no dual clip) where a random share of the tokens whose covariance of advantage and
    log-prob lies in (clip_cov_lb, clip_cov_ub) are dropped: Clip-Cov of "The Entropy Mechanism
    of Reinforcement Learning for Reasoning Language Models" (2025; code
    github.com/PRIME-RL/Entropy-Mechanism-of-RL, which verl and SkyRL adapt)."""

    clip_cov_ratio: float = Field(2e-4, gt=0, le=1, description="share of the call's tokens to drop")
    clip_cov_lb: float = Field(1.0, description="covariance lower bound (exclusive)")
    clip_cov_ub: float = Field(5.0, description="covariance upper bound (exclusive)")


class KLCovConfig(LossConfig):
    """-r*A, plus ppo_kl_coef*|logp - old| on the top kl_cov_ratio share of the call's tokens by
    covariance of advantage and log-prob (the same paper's KL-Cov)."""

    kl_cov_ratio: float = Field(2e-4, gt=0, le=1, description="share of the call's tokens that get the KL term")
    ppo_kl_coef: float = Field(1.0, ge=0)


@dataclass
class TokenInputs:
    """Flat per-token tensors for the samples of one micro-batch (concatenated in order).

    `sample_index[t]` says which sample (0..num_samples-1 within this micro-batch) token t
    belongs to; `scale[t]` is the policy term's aggregation factor (see `aggregation_scales`),
    `kl_scale[t]` and `entropy_scale[t]` those of the KL and entropy terms (None: `scale`; they
    differ when `kl.aggregation` / `entropy.aggregation` differ from `aggregation`, see
    `term_scales`); `batch_stat[t]`
    the value of the loss's `batch_statistic` for token t, computed once over the whole call
    (None for losses without one, or when this micro-batch is the whole call: `compute_loss`
    then computes it here).
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
    batch_stat: torch.Tensor | None = None
    kl_scale: torch.Tensor | None = None
    entropy_scale: torch.Tensor | None = None


@dataclass
class TokenLoss:
    """What a per-token loss function returns, each of shape [T] (T = tokens of the micro-batch):
    `loss` the unweighted per-token loss ℓ_t, `clipped` which tokens' clipped branch was
    active, `bounded` which tokens' exponential hit EXP_BOUND (see `bounded_exp`)."""

    loss: torch.Tensor
    clipped: torch.Tensor
    bounded: torch.Tensor


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


@dataclass
class SampleScales:
    """Per-sample aggregation factors of the three terms of a loss, one value per sample of a
    forward_backward call (group, then sample order): `policy` for ℓ, `kl` for the KL term,
    `entropy` for the entropy term. Computed once over the whole call (`term_scales`), then cut
    with the samples (`pick`) into micro-batches and data-parallel shares, so every part's loss
    is a term of the one aggregated loss."""

    policy: list[float]
    kl: list[float]
    entropy: list[float]

    def pick(self, indices: list[int]) -> SampleScales:
        """The scales of the samples at `indices`, in that order."""
        return SampleScales([self.policy[k] for k in indices], [self.kl[k] for k in indices],
                            [self.entropy[k] for k in indices])

    def __len__(self) -> int:
        return len(self.policy)


def term_scales(lengths: list[int], weight_sums: list[float], config: LossConfig) -> SampleScales:
    """`aggregation_scales` of each term under its own aggregation (`LossConfig.term_aggregations`;
    `norm_length` is shared). With the default (KL and entropy aggregated like the policy term)
    the three lists are equal."""
    policy, kl, entropy = config.term_aggregations()
    cache: dict[str, list[float]] = {}

    def scales(aggregation: str) -> list[float]:
        if aggregation not in cache:
            cache[aggregation] = aggregation_scales(lengths, weight_sums, aggregation, config.norm_length)
        return cache[aggregation]

    return SampleScales(scales(policy), scales(kl), scales(entropy))


def _clip_ratio(ratio: torch.Tensor, cfg: ClippedConfig) -> torch.Tensor:
    return ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)


# Every exponential of a log-prob difference goes through `bounded_exp`: exp(x) up to x = EXP_BOUND,
# then the tangent line, exp(B)·(1 + x − B). Value and slope are continuous at B and finite for
# any finite x, so no gap between two log-probs can make a loss or a gradient inf/NaN (a policy
# log-prob of −100 where the reference has −4.7 gives exp(95.3) = inf in float32). exp(20) ≈
# 4.9e8 is far beyond any ratio a clipped loss uses, so the bound changes nothing in normal
# training; `finalize_metrics` reports `exp_bounded_tokens` when it bites. Same idea as verl's
# clamp of the log-ratio to ±20, but the tangent keeps a gradient pointing the right way.
EXP_BOUND = 20.0


def bounded_exp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp(x) with its tail above EXP_BOUND replaced by the tangent line, bool mask of x > EXP_BOUND).

    Shapes follow `x`. The two branches are combined without `torch.where` over an overflowed
    exp, so the backward pass never multiplies 0 by inf.
    """
    import torch  # noqa: PLC0415 - see the note at the top
    head = torch.exp(x.clamp(max=EXP_BOUND))
    tail = (x - EXP_BOUND).clamp(min=0.0) * torch.exp(torch.tensor(EXP_BOUND, dtype=x.dtype, device=x.device))
    return head + tail, (x > EXP_BOUND).detach()


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token estimate of KL(policy ‖ reference) on tokens drawn from the policy, and the
    mask of tokens where `bounded_exp` bit. d = logp − ref_logp:
    k1 = d, k2 = ½d², k3 = exp(−d) + d − 1 (Schulman, "Approximating KL Divergence", 2020)."""
    import torch  # noqa: PLC0415 - see the note at the top
    diff = logp - ref_logp
    none = torch.zeros_like(diff, dtype=torch.bool)
    if estimator == "k1":
        return diff, none
    if estimator == "k2":
        return 0.5 * diff**2, none
    ratio, bounded = bounded_exp(-diff)  # k3 = exp(ref - logp) - (ref - logp) - 1
    return ratio + diff - 1.0, bounded


def _segment_sum(values: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    import torch  # noqa: PLC0415 - see the note at the top
    return torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, index, values)


def _cross_entropy(cfg: LossConfig, x: TokenInputs) -> TokenLoss:
    import torch  # noqa: PLC0415 - see the note at the top
    none = torch.zeros_like(x.logp, dtype=torch.bool)
    return TokenLoss(-x.logp, none, none)


def _importance_sampling(cfg: LossConfig, x: TokenInputs) -> TokenLoss:
    import torch  # noqa: PLC0415 - see the note at the top
    assert x.old_logp is not None and x.advantages is not None
    ratio, bounded = bounded_exp(x.logp - x.old_logp)
    return TokenLoss(-ratio * x.advantages, torch.zeros_like(ratio, dtype=torch.bool), bounded)


def _ppo(cfg: LossConfig, x: TokenInputs) -> TokenLoss:
    import torch  # noqa: PLC0415 - see the note at the top
    assert isinstance(cfg, PPOConfig) and x.old_logp is not None and x.advantages is not None
    adv = x.advantages
    ratio, bounded = bounded_exp(x.logp - x.old_logp)
    clipped_ratio = _clip_ratio(ratio, cfg)
    unclipped_obj, clipped_obj = ratio * adv, clipped_ratio * adv
    loss = -torch.minimum(unclipped_obj, clipped_obj)
    clipped = unclipped_obj.detach() > clipped_obj.detach()
    if cfg.dual_clip is not None:
        cap = -cfg.dual_clip * adv
        dual_active = (adv < 0) & (loss.detach() > cap.detach())
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
        clipped = clipped | dual_active
    return TokenLoss(loss, clipped, bounded)


def _cispo(cfg: LossConfig, x: TokenInputs) -> TokenLoss:
    assert isinstance(cfg, CISPOConfig) and x.old_logp is not None and x.advantages is not None
    ratio, bounded = bounded_exp(x.logp - x.old_logp)
    if cfg.out_of_range == "zero":
        r = ratio.detach()
        inside = (r > 1.0 - cfg.clip_low) & (r < 1.0 + cfg.clip_high)
        return TokenLoss(-(r * inside) * x.advantages * x.logp, ~inside, bounded)
    clipped_ratio = _clip_ratio(ratio, cfg).detach()
    clipped = (ratio.detach() != clipped_ratio)
    return TokenLoss(-clipped_ratio * x.advantages * x.logp, clipped, bounded)


def _gspo(cfg: LossConfig, x: TokenInputs) -> TokenLoss:
    import torch  # noqa: PLC0415 - see the note at the top
    assert isinstance(cfg, GSPOConfig) and x.old_logp is not None and x.advantages is not None
    adv = x.advantages
    # log s_i = mean over the sample's loss tokens (w != 0) of (logp - old).
    mask = (x.weights != 0).to(x.logp.dtype)
    delta_sum = _segment_sum((x.logp - x.old_logp) * mask, x.sample_index, x.num_samples)
    count = _segment_sum(mask, x.sample_index, x.num_samples).clamp_min(1.0)
    log_s = (delta_sum / count)[x.sample_index]
    if cfg.ratio_gradient == "token":
        # GSPO-token: s_t = sg(s) * p_t / sg(p_t): the value of s, the gradient of the token's own logp.
        log_s = log_s.detach() + (x.logp - x.logp.detach())
    if cfg.log_ratio_cap is not None:
        log_s = log_s.clamp(max=cfg.log_ratio_cap)
    seq_ratio, bounded = bounded_exp(log_s)
    clipped_ratio = _clip_ratio(seq_ratio, cfg)
    loss = -torch.minimum(seq_ratio * adv, clipped_ratio * adv)
    clipped = (seq_ratio * adv).detach() > (clipped_ratio * adv).detach()
    return TokenLoss(loss, clipped, bounded)


def _dro(cfg: LossConfig, x: TokenInputs) -> TokenLoss:
    import torch  # noqa: PLC0415 - see the note at the top
    assert isinstance(cfg, DROConfig) and x.old_logp is not None and x.advantages is not None
    none = torch.zeros_like(x.logp, dtype=torch.bool)
    return TokenLoss(-(x.logp * x.advantages - 0.5 * cfg.beta * (x.logp - x.old_logp) ** 2), none, none)


def _sapo(cfg: LossConfig, x: TokenInputs) -> TokenLoss:
    import torch  # noqa: PLC0415 - see the note at the top
    assert isinstance(cfg, SAPOConfig) and x.old_logp is not None and x.advantages is not None
    ratio, bounded = bounded_exp(x.logp - x.old_logp)
    tau = torch.where(x.advantages > 0, cfg.tau_pos, cfg.tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return TokenLoss(-gate * x.advantages, torch.zeros_like(ratio, dtype=torch.bool), bounded)


def dppo_valid(cfg: DPPOConfig, logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """DPPO's binary trust-region mask [T] (bool, no gradient; DPPO, arXiv 2602.04879),
    as verl's compute_policy_loss_dppo_tv / _dppo_kl and SkyRL's dppo_policy_loss compute it.
    p = exp(logp), q = exp(old). binary_tv: A > 0 keeps p − q <= delta_high, A <= 0 keeps
    p − q >= −delta_low (also prime-rl's default_loss_fn). tv, whatever A's sign: keeps
    −delta_low <= p − q <= delta_high (prime-rl's ipo_loss_fn with both = ipo_threshold). binary_kl with D = q·(old − logp) + (1 − q)·log((1 − q + 1e-8)/(1 − p + 1e-8)):
    A > 0 keeps D <= delta_high or p <= q, A <= 0 keeps D <= delta_low or p >= q."""
    import torch  # noqa: PLC0415 - see the note at the top
    with torch.no_grad():
        p, q = torch.exp(logp), torch.exp(old)
        if cfg.divergence == "tv":
            return ((p - q) <= cfg.delta_high) & ((p - q) >= -cfg.delta_low)
        if cfg.divergence == "binary_tv":
            keep_pos, keep_neg = (p - q) <= cfg.delta_high, (p - q) >= -cfg.delta_low
        else:
            div = q * (old - logp) + (1 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
            keep_pos, keep_neg = (div <= cfg.delta_high) | (p <= q), (div <= cfg.delta_low) | (p >= q)
        return torch.where(adv > 0, keep_pos, keep_neg)


def _dppo(cfg: LossConfig, x: TokenInputs) -> TokenLoss:
    assert isinstance(cfg, DPPOConfig) and x.old_logp is not None and x.advantages is not None
    ratio, bounded = bounded_exp(x.logp - x.old_logp)
    valid = dppo_valid(cfg, x.logp.detach(), x.old_logp, x.advantages)
    if cfg.surrogate == "ratio":
        return TokenLoss(-(ratio * x.advantages * valid), ~valid, bounded)
    weight = ratio.detach() if cfg.ratio_cap is None else ratio.detach().clamp(max=cfg.ratio_cap)
    return TokenLoss(-x.advantages * weight * x.logp * valid, ~valid, bounded)


def _geo_mean(cfg: LossConfig, x: TokenInputs) -> TokenLoss:
    import torch  # noqa: PLC0415 - see the note at the top
    assert isinstance(cfg, GeoMeanConfig) and x.old_logp is not None and x.advantages is not None
    adv = x.advantages
    delta = x.logp - x.old_logp
    # Per token: A > 0 caps the log-ratio above at clip_high, A < 0 below at -clip_low, A = 0 gives 0
    # (sgn(A)·min(sgn(A)·δ, sgn(A)·clamp(δ)), verl's compute_policy_loss_geo_mean).
    sign = torch.sign(adv)
    clamped = delta.clamp(-cfg.clip_low, cfg.clip_high)
    kept = sign * torch.minimum(sign * delta, sign * clamped)
    mask = (x.weights != 0).to(x.logp.dtype)
    count = _segment_sum(mask, x.sample_index, x.num_samples).clamp_min(1.0)
    log_ratio = _segment_sum(kept * mask, x.sample_index, x.num_samples) / count
    seq_adv = _segment_sum(adv * mask, x.sample_index, x.num_samples) / count
    ratio, bounded = bounded_exp(log_ratio)
    loss = (-seq_adv * ratio)[x.sample_index]
    return TokenLoss(loss, (delta != clamped).detach(), bounded[x.sample_index])


def _covariance(x: TokenInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(cov [T], valid [T]): cov_t = (A_t − mean A)·(logp_t − mean logp), means over the valid
    tokens (w != 0) of `x`, detached; the statistic Clip-Cov and KL-Cov select tokens by."""
    assert x.advantages is not None
    valid = x.weights != 0
    logp, adv = x.logp.detach(), x.advantages.detach()
    n = valid.sum().clamp_min(1)
    mean_adv = (adv * valid).sum() / n
    mean_logp = (logp * valid).sum() / n
    return (adv - mean_adv) * (logp - mean_logp), valid


def _clip_cov_selection(cfg: LossConfig, x: TokenInputs) -> torch.Tensor:
    """1.0 for the tokens Clip-Cov drops, else 0.0 [T]: among the valid tokens that PPO's clip
    did not already clip and whose covariance lies in (clip_cov_lb, clip_cov_ub), a uniformly
    random subset (torch.randperm on torch's default generator, as verl and SkyRL draw it) of
    max(int(clip_cov_ratio · valid tokens), 1) of them."""
    import torch  # noqa: PLC0415 - see the note at the top
    assert isinstance(cfg, ClipCovConfig) and x.old_logp is not None and x.advantages is not None
    cov, valid = _covariance(x)
    ratio, _ = bounded_exp(x.logp.detach() - x.old_logp)
    by_clip = (-x.advantages * _clip_ratio(ratio, cfg)) > (-x.advantages * ratio)
    candidates = torch.nonzero(valid & ~by_clip & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub))[:, 0]
    selected = torch.zeros_like(x.logp, dtype=x.logp.dtype)
    if len(candidates):
        count = max(int(cfg.clip_cov_ratio * int(valid.sum())), 1)
        chosen = candidates[torch.randperm(len(candidates))[: min(count, len(candidates))].to(candidates.device)]
        selected[chosen] = 1.0
    return selected.detach()


def _clip_cov(cfg: LossConfig, x: TokenInputs) -> TokenLoss:
    import torch  # noqa: PLC0415 - see the note at the top
    assert isinstance(cfg, ClipCovConfig) and x.old_logp is not None and x.advantages is not None
    assert x.batch_stat is not None
    adv = x.advantages
    ratio, bounded = bounded_exp(x.logp - x.old_logp)
    unclipped_obj, clipped_obj = ratio * adv, _clip_ratio(ratio, cfg) * adv
    loss = -torch.minimum(unclipped_obj, clipped_obj) * (1.0 - x.batch_stat)
    clipped = (unclipped_obj.detach() > clipped_obj.detach()) | (x.batch_stat > 0)
    return TokenLoss(loss, clipped, bounded)


def _kl_cov_selection(cfg: LossConfig, x: TokenInputs) -> torch.Tensor:
    """1.0 for the tokens KL-Cov penalises, else 0.0 [T]: the max(1, int(kl_cov_ratio · n)) valid
    tokens with the largest covariance (torch.topk), n = valid tokens; none when n = 0."""
    import torch  # noqa: PLC0415 - see the note at the top
    assert isinstance(cfg, KLCovConfig)
    cov, valid = _covariance(x)
    index = torch.nonzero(valid)[:, 0]
    selected = torch.zeros_like(x.logp, dtype=x.logp.dtype)
    if len(index):
        k = max(1, int(len(index) * cfg.kl_cov_ratio))
        selected[index[torch.topk(cov[index], k, largest=True).indices]] = 1.0
    return selected.detach()


def _kl_cov(cfg: LossConfig, x: TokenInputs) -> TokenLoss:
    assert isinstance(cfg, KLCovConfig) and x.old_logp is not None and x.advantages is not None
    assert x.batch_stat is not None
    delta = x.logp - x.old_logp
    ratio, bounded = bounded_exp(delta)
    loss = -x.advantages * ratio + cfg.ppo_kl_coef * delta.abs() * x.batch_stat
    return TokenLoss(loss, x.batch_stat > 0, bounded)


PerTokenLoss = Callable[[LossConfig, TokenInputs], "TokenLoss"]
BatchStatistic = Callable[[LossConfig, TokenInputs], "torch.Tensor"]


@dataclass(frozen=True)
class LossDef:
    """One loss: its name, config class, per-token function and the inputs it needs.

    `per_token(config, inputs)` returns a `TokenLoss` (per-token loss ℓ_t, clipped and
    exp-bounded masks). `inputs` lists the per-sample fields every sample must carry for
    this loss (reference log-probs are also needed by any loss whose `kl.coef` > 0).
    `batch_statistic(config, inputs)`, for losses that select tokens by a statistic of the whole
    call (Clip-Cov, KL-Cov), maps the `TokenInputs` of every token of the call (log-probs of a
    no-grad pre-pass) to one value per token [T], which `per_token` reads as `inputs.batch_stat`;
    the policy computes it once per forward_backward before any micro-batch runs (like the
    aggregation scales), so the result does not depend on the micro-batching.
    """

    name: str
    config: type[LossConfig]
    per_token: PerTokenLoss
    inputs: tuple[LossInput, ...]
    summary: str
    batch_statistic: BatchStatistic | None = None


_POLICY_INPUTS: tuple[LossInput, ...] = ("old_logprobs", "advantages")

LOSSES: dict[str, LossDef] = {
    d.name: d
    for d in (
        LossDef("cross_entropy", CrossEntropyConfig, _cross_entropy, (), "SFT: -w*logp"),
        LossDef("importance_sampling", ImportanceSamplingConfig, _importance_sampling, _POLICY_INPUTS, "-r*A"),
        LossDef("ppo", PPOConfig, _ppo, _POLICY_INPUTS, "-min(r*A, clip(r)*A), optional dual clip"),
        LossDef("cispo", CISPOConfig, _cispo, _POLICY_INPUTS, "-sg(clip(r))*A*logp"),
        LossDef("gspo", GSPOConfig, _gspo, _POLICY_INPUTS, "sequence-level ratio, clipped like ppo; ratio_gradient sequence|token"),
        LossDef("dro", DROConfig, _dro, _POLICY_INPUTS, "-(A*logp - beta/2*(logp-logp_old)^2)"),
        LossDef("sapo", SAPOConfig, _sapo, _POLICY_INPUTS, "-sigmoid(tau*(r-1))*4/tau*A, tau by the sign of A"),
        LossDef("dppo", DPPOConfig, _dppo, _POLICY_INPUTS, "ratio or log-prob surrogate with a TV / binary-KL trust-region mask"),
        LossDef("geo_mean", GeoMeanConfig, _geo_mean, _POLICY_INPUTS, "-mean(A)*exp(mean of the per-token clipped log-ratio) (GMPO)"),
        LossDef("clip_cov", ClipCovConfig, _clip_cov, _POLICY_INPUTS, "ppo with a random share of high-covariance tokens dropped",
                _clip_cov_selection),
        LossDef("kl_cov", KLCovConfig, _kl_cov, _POLICY_INPUTS, "-r*A + coef*|logp-old| on the top-covariance tokens",
                _kl_cov_selection),
    )
}


def loss_names() -> str:
    """The registered loss names, sorted and comma-separated (for error messages)."""
    return ", ".join(sorted(LOSSES))


def loss_capabilities() -> dict[str, Any]:
    """What `Backend.info().capabilities` reports about losses: names (registry order),
    aggregations and KL estimators."""
    return {
        "losses": list(LOSSES),
        "aggregations": list(get_args(Aggregation)),
        "kl_estimators": list(get_args(KLEstimator)),
    }


@dataclass(frozen=True)
class LossSpec:
    """A resolved loss: its name and validated config; what it needs comes from `LOSSES`."""

    name: str
    config: LossConfig

    @property
    def definition(self) -> LossDef:
        return LOSSES[self.name]

    @property
    def needs_old_logprobs(self) -> bool:
        return "old_logprobs" in self.definition.inputs

    @property
    def needs_advantages(self) -> bool:
        return "advantages" in self.definition.inputs

    @property
    def needs_ref_logprobs(self) -> bool:
        return "ref_logprobs" in self.definition.inputs or self.config.kl.coef > 0

    @property
    def needs_entropy_grad(self) -> bool:
        return self.config.entropy.coef > 0

    def resolved(self) -> dict[str, Any]:
        """The config with every default filled in, the KL's and entropy's aggregation included
        (a None there is reported as the loss's aggregation, the one that ran)."""
        out = self.config.model_dump()
        _, out["kl"]["aggregation"], out["entropy"]["aggregation"] = self.config.term_aggregations()
        return out


def resolve_loss(name: str, config: dict[str, Any] | None) -> LossSpec:
    """Validate a loss name and config dict into a `LossSpec`.

    Raises InvalidInput("loss", ...) for an unknown name (listing the registered ones) and
    InvalidInput("loss_config.<key>", ...) for an unknown key or a bad value.
    """
    if name not in LOSSES:
        raise InvalidInput("loss", f"unknown loss {name!r}; choose one of {loss_names()}")
    if config is not None and not isinstance(config, dict):
        raise InvalidInput("loss_config", "must be a mapping of config keys to values")
    return LossSpec(name, parse_config(LOSSES[name].config, config or {}, where="loss_config"))


def batch_statistic(spec: LossSpec, x: TokenInputs) -> torch.Tensor | None:
    """The loss's `batch_statistic` [T] over the tokens of `x` (log-probs detached), or None
    for a loss without one. `x` must hold every token of the forward_backward call."""
    stat = spec.definition.batch_statistic
    if stat is None:
        return None
    import torch  # noqa: PLC0415 - see the note at the top
    with torch.no_grad():
        return stat(spec.config, TokenInputs(**{**x.__dict__, "logp": x.logp.detach()}))


def per_token_policy_loss(spec: LossSpec, x: TokenInputs) -> TokenLoss:
    """The unweighted per-token loss ℓ_t with its clipped and exp-bounded masks. A loss with a
    batch statistic and `x.batch_stat` None computes it on `x` (x is then the whole call)."""
    if spec.definition.batch_statistic is not None and x.batch_stat is None:
        x = TokenInputs(**{**x.__dict__, "batch_stat": batch_statistic(spec, x)})
    return spec.definition.per_token(spec.config, x)


def compute_loss(spec: LossSpec, x: TokenInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """Aggregated loss of one micro-batch and the raw sums its metrics are built from.

    The returned loss is Σ_t w_t · (scale_t·ℓ_t + kl_coef·kl_scale_t·k_t − entropy_coef·entropy_scale_t·H_t)
    (each term under its own aggregation's scale, `TokenInputs`); the sums are combined across
    micro-batches by `finalize_metrics`.
    """
    import torch  # noqa: PLC0415 - see the note at the top
    cfg = spec.config
    out = per_token_policy_loss(spec, x)
    clipped, bounded = out.clipped, out.bounded
    scaled = out.loss * x.scale
    policy_term = scaled
    if cfg.kl.coef > 0:
        assert x.ref_logp is not None
        kl, kl_bounded = kl_estimate(x.logp, x.ref_logp, cfg.kl.estimator)
        scaled = scaled + cfg.kl.coef * kl * (x.scale if x.kl_scale is None else x.kl_scale)
        bounded = bounded | kl_bounded
    if cfg.entropy.coef > 0:
        assert x.entropy is not None
        scaled = scaled - cfg.entropy.coef * x.entropy * (x.scale if x.entropy_scale is None else x.entropy_scale)
    loss = (scaled * x.weights).sum()

    with torch.no_grad():
        active = x.weights != 0
        n_active = int(active.sum())
        sums: dict[str, float] = {
            "loss": float(loss),
            "policy_loss": float((policy_term * x.weights).sum()),
            "tokens": float(n_active),
            "weight_sum": float(x.weights.sum()),
            "clipped_tokens": float((clipped & active).sum()),
            "exp_bounded_tokens": float((bounded & active).sum()),
        }
        if x.entropy is not None:
            sums["entropy_sum"] = float(x.entropy[active].sum())
        if x.old_logp is not None and n_active:
            # Tokens were drawn from the sampler (old). With r = p_policy / p_sampler:
            # KL(sampler ‖ policy) = E_sampler[−log r] (k1) = E_sampler[r − 1 − log r] (k3).
            log_r = (x.logp - x.old_logp)[active]
            ratio, _ = bounded_exp(log_r)
            sums["ratio_sum"] = float(ratio.sum())
            sums["ratio_min"] = float(ratio.min())
            sums["ratio_max"] = float(ratio.max())
            sums["kl_sampler_k1_sum"] = float((-log_r).sum())
            sums["kl_sampler_k3_sum"] = float((ratio - 1.0 - log_r).sum())
        if x.ref_logp is not None and n_active:
            sums["kl_ref_k3_sum"] = float(kl_estimate(x.logp[active], x.ref_logp[active], "k3")[0].sum())
    return loss, sums


def finalize_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Combine micro-batch sums into the metrics reported by forward_backward."""
    tokens = sum(p["tokens"] for p in parts)
    out = {
        "loss": sum(p["loss"] for p in parts),
        "policy_loss": sum(p["policy_loss"] for p in parts),
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
        out["kl_sampler_k1"] = sum(p.get("kl_sampler_k1_sum", 0.0) for p in parts) / denom
        out["kl_sampler_k3"] = sum(p.get("kl_sampler_k3_sum", 0.0) for p in parts) / denom
    if any("kl_ref_k3_sum" in p for p in parts):
        out["kl_ref_k3"] = sum(p.get("kl_ref_k3_sum", 0.0) for p in parts) / denom
    bounded = sum(p.get("exp_bounded_tokens", 0.0) for p in parts)
    if bounded:
        out["exp_bounded_tokens"] = bounded  # reported only when EXP_BOUND bit
    return out
