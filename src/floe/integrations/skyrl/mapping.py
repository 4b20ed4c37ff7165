"""SkyRL 0.4.0's training config onto floe: loss, optimizer and sampling keys, honoured or refused.

Pure functions on plain dicts (``dataclasses.asdict`` of SkyRL's config sections), no SkyRL
import, so the core suite tests every row of the mapping (docs/integrations.md has the tables).
A key floe cannot honour raises InvalidInput naming the SkyRL key (``trainer.algorithm.…``);
nothing is dropped silently. A key that SkyRL's own trainer code applies before floe is called
(advantage estimator, reward KL, dynamic sampling, ...) is listed in ``TRAINER_SIDE`` and passes.

How SkyRL's reductions are honoured exactly. SkyRL 0.4.0 applies ``loss_reduction`` by
pre-scaling the advantages of each mini-batch (``apply_loss_reduction_to_advantages_minibatch``)
and then *sums* the masked per-token policy loss; its KL term is the per-sequence token mean
averaged over the mini-batch (``masked_mean(kl, loss_mask, dim=-1).mean()`` per micro-batch,
times the micro-batch's share of rows), and its entropy term the token mean of each micro-batch
weighted by the micro-batch's share of rows (worker.py ``_forward_backward_micro``). floe's loss
is the policy term with ``aggregation = "sum"`` + kl_coef·(KL with ``kl.aggregation =
"seq_mean_token_mean"``) − ent_coef·(entropy, summed). The KL term needs nothing else: its
per-sequence token mean over the mini-batch is floe's seq_mean_token_mean exactly. SkyRL's
entropy term is not a floe aggregation (its denominators are SkyRL's micro-batches), so it
travels in the weights: token t gets the weight ω_t it needs and the advantage A_t·m_t/ω_t
(``token_weights`` / ``floe_advantages``). That reproduces the policy term because every floe
policy loss but clip_cov and kl_cov is positively homogeneous in the advantage (ℓ(c·A) = c·ℓ(A)
for c > 0), and leaves the KL term unchanged because ω is m times one factor per row, which a
per-sequence token mean cancels.

Policy losses (SkyRL ``policy_loss_type`` -> floe loss; every key of each is mapped):

| SkyRL (ppo_utils function)              | floe loss and keys (trainer.algorithm.*) |
|-----------------------------------------|------------------------------------------|
| regular / dual_clip (ppo_policy_loss)   | ppo: eps_clip_low/high, clip_ratio_c (dual_clip) |
| gspo (gspo_policy_loss, GSPO-token)     | gspo: ratio_gradient token, log_ratio_cap 10, eps_clip_low/high |
| sapo (sapo_policy_loss)                 | sapo: sapo.tau_pos, sapo.tau_neg |
| cispo (compute_policy_loss_cispo)       | cispo: cispo.cispo_eps_clip_low/high; cispo.cispo_anchor old: ratio to the old log-probs, rollout: to the rollout log-probs (sent as the samples' log-probs) |
| rollout_is (rollout_is_policy_loss)     | cispo with out_of_range zero, eps_clip_low/high; the rollout log-probs as the samples' log-probs |
| dppo (dppo_policy_loss)                 | dppo: surrogate ratio, dppo.dppo_type, dppo.delta_low/high; the rollout log-probs when the batch has them (as SkyRL), else the old |
| clip_cov (compute_policy_loss_clip_cov) | clip_cov: eps_clip_low/high, clip_cov.clip_ratio, clip_cov.clip_cov_lb/ub |
| kl_cov (compute_policy_loss_kl_cov)     | kl_cov: kl_cov.kl_cov_frac, kl_cov.ppo_kl_coef |
| importance_sampling, cross_entropy      | the same-named floe losses |

clip_cov and kl_cov are not homogeneous in the advantage (the covariance bounds are absolute;
kl_cov's |log r| term is not multiplied by it), so they need the plain mask weighting: they run
with use_kl_loss (its own aggregation, above) and are refused with use_entropy_loss. SkyRL computes their covariance and token count
per micro-batch (trainer.micro_train_batch_size_per_gpu rows), floe over the whole mini-batch
(one forward_backward): the same when one micro-batch holds the GPU's whole mini-batch
(micro_train_batch_size_per_gpu >= policy_mini_batch_size · n_samples_per_prompt / GPUs).

Off-policy correction (``off_policy_correction.*``, and the deprecated ``use_tis`` /
``tis_imp_ratio_cap``) enters the same way. SkyRL's policy losses end with
``apply_off_policy_correction``: the per-token loss times the TIS ratio ρ̄ (token or sequence,
truncated), summed over the loss mask times the outlier / token / sequence masks; the KL and
entropy terms keep the original mask, and the pre-scaled advantages keep the original
denominators. So the plugin runs SkyRL's own ``compute_off_policy_correction`` on the mini-batch
(old vs rollout log-probs) and sends A·ρ̄·keep as the advantage (``corrected_advantages``): a
rejected token keeps its KL / entropy weight and contributes no policy term, as in SkyRL.
SkyRL calls ``apply_off_policy_correction`` in regular / dual_clip, gspo, sapo, cispo, rollout_is
and dppo (each positively homogeneous in A: dppo's trust-region mask and sapo's gate read only
sign(A), gspo is GSPO-token, so the fold is exact for each, ``OFF_POLICY_LOSSES``); its
clip_cov, kl_cov, importance_sampling and cross_entropy losses never call it, so the correction
with those is refused by key (``IGNORES_OFF_POLICY``: SkyRL would ignore it), and so is TIS with
cispo's rollout anchor (SkyRL raises: the anchor already is the correction).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from floe.errors import InvalidInput
from floe.integrations.stand_in import stand_in_optimizer

SKYRL_VERSION = "0.4.0"

Weighting = Literal["mask", "entropy"]
# Which log-probs the samples carry as `Sample.logprobs`: SkyRL's old ones (action_log_probs),
# the rollout's (rollout_logprobs), or the rollout's when the batch has them, else the old.
Behaviour = Literal["old", "rollout", "rollout_or_old"]

# SkyRL 0.4.0 policy_loss_type (PolicyLossType) -> floe loss name.
POLICY_LOSSES: dict[str, str] = {
    "regular": "ppo",
    "dual_clip": "ppo",
    "gspo": "gspo",
    "cispo": "cispo",
    "rollout_is": "cispo",
    "sapo": "sapo",
    "dppo": "dppo",
    "clip_cov": "clip_cov",
    "kl_cov": "kl_cov",
    "importance_sampling": "importance_sampling",
    "cross_entropy": "cross_entropy",
}
KL_ESTIMATORS = ("k1", "k2", "k3")
GSPO_LOG_RATIO_CAP = 10.0  # SkyRL's clamp of GSPO's log-ratio before the exp

# trainer.algorithm keys that SkyRL's own trainer applies before any floe call.
TRAINER_SIDE = frozenset({
    "advantage_estimator", "kl_ctrl", "use_kl_in_reward", "advantage_batch_normalize", "grpo_norm_by_std",
    "zero_variance_filter", "zero_variance_filter_tol", "lambd", "gamma", "dynamic_sampling",
    "loss_reduction", "max_seq_len",
})
# Keys read only by a model floe refuses (a critic).
UNUSED_WHEN_REFUSED = frozenset({"value_head_prefix", "value_clip"})
MAPPED = frozenset({
    "policy_loss_type", "eps_clip_low", "eps_clip_high", "clip_ratio_c", "use_kl_loss", "kl_loss_coef",
    "kl_estimator_type", "use_entropy_loss", "entropy_loss_coef", "temperature", "cispo", "sapo", "clip_cov", "kl_cov",
    "dppo",
})
# Keys floe refuses unless they hold SkyRL's default (off) value.
MUST_BE_DEFAULT: dict[str, Any] = {
    "enable_sample_support_replay": False,
}
# The deprecated TIS switch (validate_cfg turns use_tis into off_policy_correction.tis_ratio_type=token).
DEPRECATED_TIS = {"use_tis": False, "tis_imp_ratio_cap": -1.0}
# SkyRL 0.4.0 OffPolicyCorrectionConfig: every key and its default.
OFF_POLICY_DEFAULTS: dict[str, Any] = {
    "tis_ratio_type": None, "token_tis_ratio_clip_high": 2.0, "sequence_tis_ratio_clip_high": 5.0,
    "sequence_mask_metric": None, "geo_mask_high": 1.01, "geo_mask_low": 0.99, "product_mask_high": 2.0,
    "product_mask_low": 0.5, "outlier_token_is_threshold_low": None, "outlier_token_is_threshold_high": None,
    "token_mask_is_threshold_low": None, "token_mask_is_threshold_high": None,
}
# SkyRL policy losses whose function ignores off_policy_correction (compute_policy_loss_clip_cov / _kl_cov,
# importance_sampling_loss, cross_entropy_loss never call apply_off_policy_correction).
IGNORES_OFF_POLICY = ("clip_cov", "kl_cov", "importance_sampling", "cross_entropy")
# The others call it, and each is positively homogeneous in A: the fold A·ρ̄·keep is exact.
OFF_POLICY_LOSSES = ("regular", "dual_clip", "gspo", "sapo", "cispo", "rollout_is", "dppo")


@dataclass(frozen=True)
class SkyRLLoss:
    """What one SkyRL mini-batch becomes in floe: `forward_backward(batch, loss, loss_config,
    temperature)` with per-token weights chosen by `weighting` (see `token_weights`)."""

    loss: str
    loss_config: dict[str, Any]
    weighting: Weighting
    temperature: float
    behaviour: Behaviour = "old"
    off_policy: dict[str, Any] | None = None  # the OffPolicyCorrectionConfig in effect (None: off)


def _key(name: str) -> str:
    return f"trainer.algorithm.{name}"


def map_loss(
    algorithm: Mapping[str, Any], *, max_tokens_per_microbatch: int = 0, has_critic: bool = False
) -> SkyRLLoss:
    """SkyRL's ``trainer.algorithm`` (as a dict) -> the floe loss that computes the same loss.

    Args: `algorithm` = ``asdict(cfg.trainer.algorithm)``; `max_tokens_per_microbatch` =
    ``cfg.trainer.max_tokens_per_microbatch`` (token-packed micro-batches change SkyRL's entropy
    weighting); `has_critic` = a critic model is configured. Raises InvalidInput naming the key
    for anything floe cannot honour exactly, including keys this mapping does not know.
    """
    for name in algorithm:
        if name not in TRAINER_SIDE | UNUSED_WHEN_REFUSED | MAPPED | MUST_BE_DEFAULT.keys() | DEPRECATED_TIS.keys() | {"off_policy_correction"}:
            raise InvalidInput(_key(name), f"not a SkyRL {SKYRL_VERSION} algorithm key known to floe's mapping")
    if has_critic:
        raise InvalidInput("trainer.critic.model.path", "floe has no value model; use a critic-free estimator (grpo, rloo, ...)")
    if algorithm.get("advantage_estimator") == "gae":
        raise InvalidInput(_key("advantage_estimator"), "'gae' needs a critic, which floe does not train")
    for name, default in MUST_BE_DEFAULT.items():
        if algorithm.get(name, default) != default:
            raise InvalidInput(_key(name), f"not supported by floe (must stay {default!r})")
    off_policy = off_policy_correction(algorithm)

    kind = algorithm.get("policy_loss_type", "regular")
    if kind not in POLICY_LOSSES:
        raise InvalidInput(_key("policy_loss_type"), f"{kind!r} has no floe equivalent; supported: {', '.join(POLICY_LOSSES)}")
    if off_policy is not None and kind in IGNORES_OFF_POLICY:
        raise InvalidInput(_key("off_policy_correction"), f"SkyRL's {kind!r} loss ignores off-policy correction "
                           "(it never calls apply_off_policy_correction); turn the correction off or use one of "
                           f"{', '.join(OFF_POLICY_LOSSES)}")
    loss = POLICY_LOSSES[kind]
    cfg: dict[str, Any] = {"aggregation": "sum"}
    behaviour: Behaviour = "old"
    if kind in ("regular", "dual_clip", "gspo", "rollout_is", "clip_cov"):
        cfg["clip_low"] = _clip_low(algorithm.get("eps_clip_low", 0.2), "eps_clip_low")
        cfg["clip_high"] = _non_negative(algorithm.get("eps_clip_high", 0.2), "eps_clip_high")
    if kind == "dual_clip":
        c = float(algorithm.get("clip_ratio_c", 3.0))
        if not c > 1:
            raise InvalidInput(_key("clip_ratio_c"), f"dual clip needs c > 1, got {c}")
        cfg["dual_clip"] = c
    if kind == "gspo":  # GSPO-token, exact for any advantages
        cfg.update(ratio_gradient="token", log_ratio_cap=GSPO_LOG_RATIO_CAP)
    if kind == "cispo":
        cispo = algorithm.get("cispo") or {}
        anchor = cispo.get("cispo_anchor", "old")
        if anchor not in ("old", "rollout"):
            raise InvalidInput(_key("cispo.cispo_anchor"), f"must be 'old' or 'rollout' (as in SkyRL), got {anchor!r}")
        behaviour = "old" if anchor == "old" else "rollout"
        if anchor == "rollout" and off_policy is not None and off_policy["tis_ratio_type"] is not None:
            raise InvalidInput(_key("off_policy_correction.tis_ratio_type"), "cispo with cispo_anchor='rollout' is already "
                               "rollout-anchored (it is the off-policy correction); TIS would double-count it, SkyRL "
                               "raises: set tis_ratio_type=null (masks only) or cispo_anchor='old'")
        cfg["clip_low"] = _clip_low(cispo.get("cispo_eps_clip_low", 1.0), "cispo.cispo_eps_clip_low")
        cfg["clip_high"] = _non_negative(cispo.get("cispo_eps_clip_high", 4.0), "cispo.cispo_eps_clip_high")
    if kind == "rollout_is":  # -sg(r·1[1-eps_low < r < 1+eps_high])·A·logp against the rollout log-probs
        cfg["out_of_range"] = "zero"
        behaviour = "rollout"
    if kind == "sapo":
        sapo = algorithm.get("sapo") or {}
        for name, default in (("tau_pos", 1.0), ("tau_neg", 1.05)):
            tau = float(sapo.get(name, default))
            if not tau > 0:
                raise InvalidInput(_key(f"sapo.{name}"), f"must be > 0 (SAPO's gate temperature), got {tau!r}")
            cfg[name] = tau
    if kind == "dppo":
        dppo = algorithm.get("dppo") or {}
        divergence = dppo.get("dppo_type", "binary_tv")
        if divergence not in ("binary_tv", "binary_kl"):
            raise InvalidInput(_key("dppo.dppo_type"), f"must be binary_tv or binary_kl (as in SkyRL), got {divergence!r}")
        cfg.update(divergence=divergence, surrogate="ratio",
                   delta_low=_non_negative(dppo.get("delta_low", 0.2), "dppo.delta_low"),
                   delta_high=_non_negative(dppo.get("delta_high", 0.2), "dppo.delta_high"))
        behaviour = "rollout_or_old"
    if kind == "clip_cov":
        clip_cov = algorithm.get("clip_cov") or {}
        cfg.update(clip_cov_ratio=_share(clip_cov.get("clip_ratio", 0.0002), "clip_cov.clip_ratio"),
                   clip_cov_lb=float(clip_cov.get("clip_cov_lb", 1.0)), clip_cov_ub=float(clip_cov.get("clip_cov_ub", 5.0)))
    if kind == "kl_cov":
        kl_cov = algorithm.get("kl_cov") or {}
        cfg.update(kl_cov_ratio=_share(kl_cov.get("kl_cov_frac", 0.2), "kl_cov.kl_cov_frac"),
                   ppo_kl_coef=_non_negative(kl_cov.get("ppo_kl_coef", 1.0), "kl_cov.ppo_kl_coef"))

    use_kl = bool(algorithm.get("use_kl_loss", True))
    use_entropy = bool(algorithm.get("use_entropy_loss", False))
    weighting: Weighting = "mask"
    if loss != "cross_entropy":  # SkyRL's SFT branch adds neither KL nor entropy: a plain masked sum.
        if use_kl:  # masked_mean(kl, loss_mask, dim=-1).mean(): the per-sequence token mean over the mini-batch
            estimator = algorithm.get("kl_estimator_type", "k3")
            if estimator not in KL_ESTIMATORS:
                raise InvalidInput(_key("kl_estimator_type"), f"{estimator!r} is not a floe KL estimator ({', '.join(KL_ESTIMATORS)})")
            cfg["kl"] = {"coef": _non_negative(algorithm.get("kl_loss_coef", 0.001), "kl_loss_coef"), "estimator": estimator,
                         "aggregation": "seq_mean_token_mean"}
        if use_entropy:
            if max_tokens_per_microbatch > 0:
                raise InvalidInput("trainer.max_tokens_per_microbatch", "entropy loss with token-packed micro-batches is not supported by floe")
            if kind in ("clip_cov", "kl_cov"):
                raise InvalidInput(_key("use_entropy_loss"), f"{kind} with an entropy term is not supported by floe's SkyRL "
                                   "plugin: SkyRL's per-micro-batch entropy mean travels in re-weighted advantages, which "
                                   f"{kind}'s covariance selection (and kl_cov's |log r| term) would see; set use_entropy_loss=false")
            cfg["entropy"] = {"coef": _non_negative(algorithm.get("entropy_loss_coef", 0.01), "entropy_loss_coef")}
            weighting = "entropy"

    temperature = algorithm.get("temperature")
    if temperature is None or not float(temperature) > 0:
        raise InvalidInput(_key("temperature"), f"must be > 0 (SkyRL's validate_cfg copies the sampling temperature), got {temperature!r}")
    return SkyRLLoss(loss, cfg, weighting, float(temperature), behaviour, off_policy)


def _share(value: Any, name: str) -> float:
    """SkyRL's share of the micro-batch's tokens: max(int(share · n), 1) tokens, at most all of
    them, so a share >= 1 is floe's 1.0; refused unless > 0."""
    v = float(value)
    if not v > 0:
        raise InvalidInput(_key(name), f"must be > 0, got {value!r}")
    return min(v, 1.0)


def _positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidInput(_key(name), f"must be a positive number, got {value!r}")
    return float(value)


def off_policy_correction(algorithm: Mapping[str, Any]) -> dict[str, Any] | None:
    """SkyRL 0.4.0's off-policy correction in effect, as OffPolicyCorrectionConfig fields, or None when off.

    ``trainer.algorithm.off_policy_correction`` (every key of OFF_POLICY_DEFAULTS), with the
    deprecated ``use_tis`` = true read as SkyRL's validate_cfg reads it (tis_ratio_type "token",
    token_tis_ratio_clip_high = ``tis_imp_ratio_cap``). Refused, naming the key: unknown keys,
    values SkyRL would reject or misuse (a non-positive cap or bound, low > high, ``use_tis`` with
    the -1 default cap: every weight would be -1), a setting whose feature is off (SkyRL ignores
    it: a cap without its ``tis_ratio_type``, mask bounds without their ``sequence_mask_metric``,
    one of the two ``token_mask_is_threshold_*``, ``tis_imp_ratio_cap`` without ``use_tis``), and
    ``use_tis`` with ``tis_ratio_type=sequence`` (validate_cfg would overwrite it).
    """
    given = algorithm.get("off_policy_correction") or {}
    if not isinstance(given, Mapping):
        raise InvalidInput(_key("off_policy_correction"), f"must be a mapping, got {type(given).__name__}")
    for name in given:
        if name not in OFF_POLICY_DEFAULTS:
            raise InvalidInput(_key(f"off_policy_correction.{name}"), f"not a SkyRL {SKYRL_VERSION} off_policy_correction key")
    c = {**OFF_POLICY_DEFAULTS, **given}
    use_tis, cap = algorithm.get("use_tis", False), algorithm.get("tis_imp_ratio_cap", -1.0)
    if use_tis:
        if c["tis_ratio_type"] not in (None, "token"):
            raise InvalidInput(_key("use_tis"), f"is token-level TIS; it conflicts with off_policy_correction.tis_ratio_type={c['tis_ratio_type']!r}")
        c["tis_ratio_type"], c["token_tis_ratio_clip_high"] = "token", _positive(cap, "tis_imp_ratio_cap")
    elif cap != DEPRECATED_TIS["tis_imp_ratio_cap"]:
        raise InvalidInput(_key("tis_imp_ratio_cap"), "has no effect without use_tis; use "
                           "off_policy_correction.tis_ratio_type=token and token_tis_ratio_clip_high")

    def off_unless(feature_on: bool, names: tuple[str, ...], why: str) -> None:
        for name in names:
            if not feature_on and c[name] != OFF_POLICY_DEFAULTS[name]:
                raise InvalidInput(_key(f"off_policy_correction.{name}"), f"has no effect {why}")

    tis = c["tis_ratio_type"]
    if tis not in (None, "token", "sequence"):
        raise InvalidInput(_key("off_policy_correction.tis_ratio_type"), f"must be null, 'token' or 'sequence', got {tis!r}")
    off_unless(tis == "token", ("token_tis_ratio_clip_high",), "unless tis_ratio_type=token")
    off_unless(tis == "sequence", ("sequence_tis_ratio_clip_high",), "unless tis_ratio_type=sequence")
    metric = c["sequence_mask_metric"]
    if metric not in (None, "product", "geometric"):
        raise InvalidInput(_key("off_policy_correction.sequence_mask_metric"), f"must be null, 'product' or 'geometric', got {metric!r}")
    off_unless(metric == "geometric", ("geo_mask_low", "geo_mask_high"), "unless sequence_mask_metric=geometric")
    off_unless(metric == "product", ("product_mask_low", "product_mask_high"), "unless sequence_mask_metric=product")
    pairs = [("outlier_token_is_threshold_low", "outlier_token_is_threshold_high"),
             ("token_mask_is_threshold_low", "token_mask_is_threshold_high")]
    if metric is not None:
        pairs.append(("geo_mask_low", "geo_mask_high") if metric == "geometric" else ("product_mask_low", "product_mask_high"))
    for name in ("token_tis_ratio_clip_high", "sequence_tis_ratio_clip_high"):
        _positive(c[name], f"off_policy_correction.{name}")
    for low, high in pairs:
        lo = None if c[low] is None else _positive(c[low], f"off_policy_correction.{low}")
        hi = None if c[high] is None else _positive(c[high], f"off_policy_correction.{high}")
        if lo is not None and hi is not None and lo > hi:
            raise InvalidInput(_key(f"off_policy_correction.{low}"), f"must be <= {high} ({lo} > {hi})")
    if (c["token_mask_is_threshold_low"] is None) != (c["token_mask_is_threshold_high"] is None):
        name = "token_mask_is_threshold_low" if c["token_mask_is_threshold_low"] is None else "token_mask_is_threshold_high"
        raise InvalidInput(_key(f"off_policy_correction.{name}"), "SkyRL masks tokens only when both "
                           "token_mask_is_threshold_low and _high are set; set both, or neither")
    enabled = (tis is not None or metric is not None or c["outlier_token_is_threshold_low"] is not None
               or c["outlier_token_is_threshold_high"] is not None or c["token_mask_is_threshold_low"] is not None)
    return c if enabled else None


def corrected_advantages(advantages: torch.Tensor, tis_ratio: torch.Tensor | None, loss_mask: torch.Tensor,
                         corrected_mask: torch.Tensor) -> torch.Tensor:
    """SkyRL's off-policy correction folded into the (pre-scaled) advantages, [B, R]:
    A·ρ̄·keep, keep = corrected_mask / loss_mask (0 where SkyRL's masks rejected a token).

    `tis_ratio` ([B, R] or [B, 1], None without TIS) and `corrected_mask` are what SkyRL's
    ``compute_off_policy_correction(old, rollout, loss_mask, cfg)`` returns. Exact for SkyRL's
    ``loss * tis_ratio`` summed over ``corrected_mask``: its losses (ppo, dual clip, gspo-token,
    cispo) are positively homogeneous in A and ρ̄ ≥ 0 (see the module doc)."""
    m = loss_mask.to(torch.float64)
    keep = torch.where(m > 0, corrected_mask.to(torch.float64) / torch.where(m > 0, m, torch.ones_like(m)), torch.zeros_like(m))
    scale = keep if tis_ratio is None else keep * tis_ratio.to(torch.float64)
    if bool((scale < 0).any()):
        raise InvalidInput("trainer.algorithm.off_policy_correction", "SkyRL's TIS ratio must be >= 0")
    return advantages.to(torch.float64) * scale


def _non_negative(value: Any, name: str) -> float:
    v = float(value)
    if not v >= 0:
        raise InvalidInput(_key(name), f"must be >= 0, got {value!r}")
    return v


def _clip_low(value: Any, name: str) -> float:
    v = _non_negative(value, name)
    if v > 1:
        raise InvalidInput(_key(name), f"must be <= 1 (the ratio is clipped below at 1 - {name}), got {value!r}")
    return v


OPTIMIZER_KEY = "trainer.policy.optimizer_config."
# transformers schedulers that fail under SkyRL itself: two step() on a metric SkyRL never passes,
# three need `scheduler_specific_kwargs` SkyRL's FSDP strategy never passes.
_NO_METRIC = "its step() needs a metric, which SkyRL's trainer never passes"
_NO_KWARGS = "it needs scheduler-specific arguments, which SkyRL's FSDP strategy never passes"
UNSTEPPABLE = {"reduce_lr_on_plateau": _NO_METRIC, "greedy": _NO_METRIC, "cosine_with_min_lr": _NO_KWARGS,
               "cosine_warmup_with_min_lr": _NO_KWARGS, "warmup_stable_decay": _NO_KWARGS}


def map_optimizer(optimizer: Mapping[str, Any], total_steps: int | None = None) -> dict[str, Any]:
    """SkyRL's ``trainer.policy.optimizer_config`` (as a dict) -> floe ``OptimizerConfig`` fields.

    The LR schedule is not among them: SkyRL's own scheduler (`lr_scheduler`) runs in the
    plugin and each `optim_step` carries its rate, so floe's `schedule` stays "constant".
    `total_steps`: optimizer steps of the whole run when known, for checking the scheduler
    early (`lr_scheduler`). Raises InvalidInput naming the key.
    """
    key = OPTIMIZER_KEY
    known = {"lr", "adam_betas", "weight_decay", "max_grad_norm", "offload_after_step", "num_warmup_steps", "scheduler"}
    for name in optimizer:
        if name not in known:
            raise InvalidInput(key + name, f"not a SkyRL {SKYRL_VERSION} optimizer key known to floe's mapping")
    if total_steps is not None:
        lr_scheduler(optimizer, total_steps)
    out: dict[str, Any] = {
        "lr": float(optimizer.get("lr", 1e-6)),
        "betas": tuple(float(b) for b in optimizer.get("adam_betas", (0.9, 0.999))),
        "weight_decay": float(optimizer.get("weight_decay", 1e-2)),
    }
    clip = optimizer.get("max_grad_norm", 1.0)
    out["grad_clip"] = float(clip) if clip is not None and float(clip) > 0 else None
    out["schedule"] = "constant"
    return out


def optimizer_steps(trainer: Any, training_steps: int | None) -> int | None:
    """Optimizer steps of `training_steps` SkyRL training steps (None stays None), counted as
    SkyRL's RayPPOTrainer.build_models counts them for its scheduler: per training step,
    train_batch_size // policy_mini_batch_size mini-batches × update_epochs_per_batch.
    `trainer`: SkyRL's ``cfg.trainer``."""
    if training_steps is None:
        return None
    return training_steps * (trainer.train_batch_size // trainer.policy_mini_batch_size * trainer.update_epochs_per_batch)


def lr_scheduler(optimizer: Mapping[str, Any], total_steps: int | None) -> torch.optim.lr_scheduler.LRScheduler:
    """SkyRL's LR scheduler, built as its FSDP strategy builds it (``transformers.get_scheduler(
    scheduler, AdamW(lr), num_warmup_steps, num_training_steps)``), over a one-element stand-in
    parameter: only its learning rate is used. SkyRL steps it after every optimizer step, so
    optimizer step k runs at ``get_last_lr()[0]`` after k steps of it.

    `total_steps`: the run's optimizer steps (SkyRL's ``policy_num_training_steps``: training
    steps × mini-batches per step × update epochs), or None when unknown. InvalidInput naming
    ``…optimizer_config.scheduler`` for a name transformers does not know, a scheduler SkyRL
    cannot step (`UNSTEPPABLE`) or one that needs the total when it is None; naming
    ``…num_warmup_steps`` for a negative warm-up."""
    from transformers.optimization import get_scheduler
    from transformers.trainer_utils import SchedulerType

    name = str(optimizer.get("scheduler", "constant_with_warmup"))
    known = [t.value for t in SchedulerType]
    if name not in known:
        raise InvalidInput(OPTIMIZER_KEY + "scheduler", f"{name!r} is not a transformers scheduler ({', '.join(known)})")
    if name in UNSTEPPABLE:
        raise InvalidInput(OPTIMIZER_KEY + "scheduler", f"{name!r} cannot run under SkyRL: {UNSTEPPABLE[name]}")
    warmup = optimizer.get("num_warmup_steps", 0)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise InvalidInput(OPTIMIZER_KEY + "num_warmup_steps", f"must be an int >= 0, got {warmup!r}")
    stand_in = stand_in_optimizer(float(optimizer.get("lr", 1e-6)))
    try:
        return get_scheduler(name, stand_in, num_warmup_steps=warmup, num_training_steps=total_steps)
    except ValueError as e:  # transformers' "requires `num_training_steps`, please provide that argument."
        raise InvalidInput(OPTIMIZER_KEY + "scheduler", f"{name!r}: {e} (set trainer.max_training_steps, or epochs "
                           "with a sized dataset)") from None


# vLLM-style sampling keys SkyRL sends (skyrl...engine_utils.get_vllm_sampling_params).
SAMPLING_KEYS = frozenset({
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "logprobs", "stop", "stop_token_ids", "seed",
    "min_tokens", "skip_special_tokens", "include_stop_str_in_output", "n",
})


def map_sampling(params: Mapping[str, Any]) -> dict[str, Any]:
    """SkyRL's per-request vLLM-style sampling dict -> floe ``SamplingParams`` fields.

    Honoured: max_tokens, temperature, top_p, top_k (-1 = off), stop, stop_token_ids, seed.
    Accepted as floe already behaves: logprobs 0/1/None (floe always returns the sampled
    token's log-prob), include_stop_str_in_output=True, skip_special_tokens (text only),
    min_tokens <= 1 (floe always generates a token), n = 1. Anything else is an InvalidInput
    naming ``sampling_params.<key>``.
    """
    for name in params:
        if name not in SAMPLING_KEYS:
            raise InvalidInput(f"sampling_params.{name}", "not supported by floe")
    if float(params.get("min_p") or 0.0) != 0.0:
        raise InvalidInput("sampling_params.min_p", "min-p sampling is not supported by floe")
    if int(params.get("min_tokens") or 0) > 1:
        raise InvalidInput("sampling_params.min_tokens", "floe supports min_tokens <= 1 only")
    if params.get("logprobs") not in (None, 0, 1):
        raise InvalidInput("sampling_params.logprobs", "floe returns the sampled token's log-prob only (0 or 1)")
    if params.get("include_stop_str_in_output", True) is not True:
        raise InvalidInput("sampling_params.include_stop_str_in_output", "floe keeps the stop string in the output")
    if int(params.get("n") or 1) != 1:
        raise InvalidInput("sampling_params.n", "SkyRL's generator sends one sample per request")
    out: dict[str, Any] = {}
    if params.get("max_tokens") is not None:
        out["max_tokens"] = int(params["max_tokens"])
    for name in ("temperature", "top_p"):
        if params.get(name) is not None:
            out[name] = float(params[name])
    top_k = params.get("top_k")
    if top_k is not None:
        out["top_k"] = max(int(top_k), 0)
    if params.get("stop"):
        out["stop"] = [str(s) for s in params["stop"]]
    if params.get("stop_token_ids"):
        out["stop_token_ids"] = [int(t) for t in params["stop_token_ids"]]
    if params.get("seed") is not None:
        out["seed"] = int(params["seed"])
    return out


def token_weights(loss_mask: torch.Tensor, weighting: Weighting, micro_batch_size: int | None = None) -> torch.Tensor:
    """floe per-token weights ω [B, R] for one SkyRL mini-batch of B rows (see the module doc).

    mask: ω = m. entropy: ω = m · (b_j / B) / Σ_{micro-batch j} m, with SkyRL's consecutive
    micro-batches of `micro_batch_size` rows (b_j rows in micro-batch j). Rows without loss
    tokens get ω = 0. (The KL term needs no weights: floe's kl.aggregation seq_mean_token_mean.)
    """
    m = loss_mask.to(torch.float64)
    rows = m.shape[0]
    if weighting == "mask":
        return m
    if micro_batch_size is None or micro_batch_size < 1:
        raise InvalidInput("trainer.micro_train_batch_size_per_gpu", "must be >= 1 for the entropy loss")
    out = torch.zeros_like(m)
    for start in range(0, rows, micro_batch_size):
        chunk = m[start : start + micro_batch_size]
        tokens = float(chunk.sum())
        if tokens > 0:
            out[start : start + micro_batch_size] = chunk * (chunk.shape[0] / rows) / tokens
    return out


def floe_advantages(advantages: torch.Tensor, loss_mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The advantages to send with weights ω so that ω·ℓ(A') = m·ℓ(A): A' = A·m/ω where ω > 0, else 0."""
    a = advantages.to(torch.float64)
    w = weights.to(torch.float64)
    return torch.where(w > 0, a * loss_mask.to(torch.float64) / torch.where(w > 0, w, torch.ones_like(w)), torch.zeros_like(a))

