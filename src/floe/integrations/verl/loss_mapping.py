"""verl's actor loss config -> floe's loss name and loss_config (pure; no verl import).

verl's PPO actor loss (verl.workers.utils.losses.ppo_loss) is the policy loss registered under
`actor.policy_loss.loss_mode` in verl.trainer.ppo.core_algos, aggregated by `agg_loss`, plus an
optional KL term against the reference and an optional entropy bonus. Each of verl 0.9.1's
registered policy losses maps onto a floe loss; every key that changes the loss is either
mapped or refused with floe.errors.InvalidInput naming verl's key (e.g.
"actor_rollout_ref.actor.policy_loss.loss_mode") — never silently ignored.

| verl loss_mode (core_algos function)  | floe loss and keys (from actor.* / actor.policy_loss.*) |
|---------------------------------------|----------------------------------------------------------|
| vanilla (compute_policy_loss_vanilla) | ppo: clip_low/high = clip_ratio_low/high, dual_clip = clip_ratio_c |
| dppo_tv / dppo_kl (…_dppo_tv / _kl)   | dppo: divergence binary_tv / binary_kl, delta_low/high = clip_ratio_low/high, surrogate log_prob, ratio_cap = clip_ratio_c |
| gspo (…_gspo)                         | gspo: ratio_gradient token, log_ratio_cap 10, clip_low/high = clip_ratio_low/high |
| sapo (…_sapo)                         | sapo: tau_pos, tau_neg; aggregation seq_mean_token_mean whatever loss_agg_mode (verl's own choice) |
| gpg (…_gpg)                           | dro with beta 0 (−A·logp) |
| clip_cov (…_clip_cov)                 | clip_cov: clip_low/high, clip_cov_ratio, clip_cov_lb, clip_cov_ub |
| kl_cov (…_kl_cov)                     | kl_cov: kl_cov_ratio, ppo_kl_coef |
| geo_mean (…_geo_mean)                 | geo_mean: clip_low/high = clip_ratio_low/high; aggregation seq_mean_token_mean (verl: mean over the micro-batch's rows) |
| dro (…_dro)                           | dro: beta = dro_beta (> 0) |
| cispo (…_cispo)                       | cispo: clip_low/high = clip_ratio_low/high |
| bypass_mode (…_bypass_mode)           | policy_loss.rollout_correction: loss_type ppo_clip → ppo; reinforce → dro beta 0; reinforce with rollout_is token and a float rollout_is_threshold C → cispo clip_low 1, clip_high C − 1; rollout_rs, sequence IS, IcePop bounds and batch normalisation refused (rollout correction) |

| verl key (actor_rollout_ref.actor.*)          | floe loss_config                               |
|-----------------------------------------------|------------------------------------------------|
| clip_ratio_low / clip_ratio_high (clip_ratio) | clip_low / clip_high (dppo: delta_low / delta_high) |
| clip_ratio_c                                  | dual_clip (vanilla), ratio_cap (dppo)          |
| loss_agg_mode token-mean / token-sum          | aggregation token_mean / sum                   |
| loss_agg_mode seq-mean-token-mean             | aggregation seq_mean_token_mean                |
| loss_agg_mode seq-mean-token-sum              | seq_mean_token_sum_norm, norm_length 1         |
| loss_agg_mode seq-mean-token-sum-norm         | seq_mean_token_sum_norm, norm_length = loss_scale_factor (None: longest response of the mini-batch) |
| use_kl_loss, kl_loss_coef                     | kl.coef (0 when use_kl_loss is false)          |
| kl_loss_type kl|k1, mse|k2, low_var_kl|k3     | kl.estimator k1 / k2 / k3 ("abs", "full", "+" refused) |
| entropy_coeff                                 | entropy.coef (must be >= 0)                    |
| tau_pos, tau_neg (sapo)                       | tau_pos, tau_neg                               |
| policy_loss.clip_cov_ratio/_lb/_ub, kl_cov_ratio, ppo_kl_coef, dro_beta | the same-named floe keys (dro_beta -> beta) |

sapo and geo_mean fix their policy term's aggregation, while verl aggregates the KL and entropy
terms by loss_agg_mode; floe has one aggregation per loss, so with a KL or entropy term those two
need loss_agg_mode = seq-mean-token-mean (else refused).

Batch statistics and verl's micro-batches. verl computes each loss per micro-batch of its
mini-batch (ppo_micro_batch_size_per_gpu, or use_dynamic_bsz's token budget); the plugin makes
one forward_backward per mini-batch, and floe computes clip_cov's and kl_cov's covariance, token
count and selection over that whole call (a no-grad pre-pass), and geo_mean's mean over all its
samples. The two agree when verl runs one micro-batch per mini-batch per GPU
(ppo_micro_batch_size_per_gpu = ppo_mini_batch_size · rollout.n / data-parallel size, no dynamic
bsz): with K micro-batches verl selects clip_cov/kl_cov tokens within each micro-batch, and verl's
geo_mean gradient is the sum of K micro-batch means (K times floe's for equal micro-batches).
clip_cov draws its random subset with torch.randperm on the policy process's default generator,
as verl does on its own. The per-sequence means of gspo and geo_mean never cross samples, and
floe never splits a sample, so they are exact for any micro-batching.

algorithm.rollout_correction.bypass_mode = true is bypass_mode with that block (verl's trainer
copies it into policy_loss and sets old_log_probs = rollout_log_probs). Otherwise
algorithm.rollout_correction.rollout_is / rollout_rs (decoupled importance weights and rejection
of rollout tokens) are refused; ppo_epochs, ppo_mini_batch_size and shuffle are honoured by the
plugin's update loop (verl's own mini-batch iterator).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from floe.errors import InvalidInput

ACTOR = "actor_rollout_ref.actor"
ALGORITHM = "algorithm"

_AGGREGATIONS: dict[str, tuple[str, int | None]] = {
    "token-mean": ("token_mean", None),
    "token-sum": ("sum", None),
    "seq-mean-token-mean": ("seq_mean_token_mean", None),
    "seq-mean-token-sum": ("seq_mean_token_sum_norm", 1),
}
# verl 0.9.1's registered policy losses (core_algos.register_policy_loss), all mapped.
LOSS_MODES = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo",
              "bypass_mode")
GSPO_LOG_RATIO_CAP = 10.0  # verl's and SkyRL's clamp of GSPO's log-ratio before the exp
_KL_ESTIMATORS = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


@dataclass(frozen=True)
class VerlLoss:
    """What one verl mini-batch update asks of floe: `client.forward_backward(batch, loss,
    loss_config)`, plus whether reference log-probs must travel (the KL term)."""

    loss: str
    loss_config: dict[str, Any] = field(default_factory=dict)

    @property
    def needs_ref_logprobs(self) -> bool:
        return self.loss_config["kl"]["coef"] > 0


# loss modes whose clip_ratio_low bounds a ratio exp(.) > 0 from below (1 - clip_ratio_low)
_RATIO_CLAMPS = ("vanilla", "cispo", "gspo", "clip_cov")


def _number(cfg: Mapping[str, Any], key: str, default: float | None) -> float | None:
    value = cfg.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidInput(f"{ACTOR}.{key}", f"must be a finite number, got {value!r}")
    return float(value)


def verl_loss(actor: Mapping[str, Any], algorithm: Mapping[str, Any] | None = None) -> VerlLoss:
    """floe's loss for verl's `actor_rollout_ref.actor` config (and `algorithm`), as plain dicts.

    Defaults are verl 0.9.1's (clip_ratio 0.2, clip_ratio_c 3.0, token-mean, no KL, no
    entropy). Raises InvalidInput naming the verl key for anything floe cannot honour.
    """
    if not isinstance(actor, Mapping):
        raise InvalidInput(ACTOR, f"must be a mapping, got {type(actor).__name__}")
    policy_loss = actor.get("policy_loss") or {}
    mode = policy_loss.get("loss_mode", "vanilla")
    if mode not in LOSS_MODES:
        raise InvalidInput(f"{ACTOR}.policy_loss.loss_mode",
                           f"{mode!r} is not a verl 0.9.1 policy loss floe maps; one of {', '.join(LOSS_MODES)}")

    clip = _number(actor, "clip_ratio", 0.2)
    clip_low = _number(actor, "clip_ratio_low", None)
    clip_high = _number(actor, "clip_ratio_high", None)
    clip_low = clip if clip_low is None else clip_low
    clip_high = clip if clip_high is None else clip_high
    if clip_low is None or clip_low < 0:
        raise InvalidInput(f"{ACTOR}.clip_ratio_low", f"must be >= 0, got {clip_low!r}")
    if mode in _RATIO_CLAMPS and clip_low > 1:
        # verl clamps the ratio (> 0) from below at 1 - clip_ratio_low: any value >= 1 clamps at or
        # below 0, never bites, and is floe's clip_low = 1 exactly (e.g. verl's cispo example: 10).
        # (geo_mean's and dppo's lower bounds are on the log-ratio / the divergence: any value >= 0.)
        clip_low = 1.0
    if clip_high is None or clip_high < 0:
        raise InvalidInput(f"{ACTOR}.clip_ratio_high", f"must be >= 0, got {clip_high!r}")
    clip_c = _number(actor, "clip_ratio_c", 3.0)

    agg_mode = actor.get("loss_agg_mode", "token-mean")
    scale_factor = actor.get("loss_scale_factor")
    if agg_mode == "seq-mean-token-sum-norm":
        if scale_factor is not None and (isinstance(scale_factor, bool) or not isinstance(scale_factor, int)
                                         or scale_factor <= 0):
            raise InvalidInput(f"{ACTOR}.loss_scale_factor", f"must be a positive integer or null, got {scale_factor!r}")
        aggregation, norm_length = "seq_mean_token_sum_norm", scale_factor
    elif agg_mode in _AGGREGATIONS:
        aggregation, norm_length = _AGGREGATIONS[agg_mode]
    else:
        raise InvalidInput(f"{ACTOR}.loss_agg_mode",
                           f"unknown mode {agg_mode!r}; one of {sorted([*_AGGREGATIONS, 'seq-mean-token-sum-norm'])}")

    kl_coef = 0.0
    kl_estimator = "k3"
    if actor.get("use_kl_loss", False):
        kl_coef = _number(actor, "kl_loss_coef", 0.001) or 0.0
        if kl_coef < 0:
            raise InvalidInput(f"{ACTOR}.kl_loss_coef", f"must be >= 0, got {kl_coef}")
        kl_type = actor.get("kl_loss_type", "low_var_kl")
        if kl_type not in _KL_ESTIMATORS:
            raise InvalidInput(f"{ACTOR}.kl_loss_type",
                               f"floe has the k1, k2 and k3 estimators ({sorted(_KL_ESTIMATORS)}), got {kl_type!r}")
        kl_estimator = _KL_ESTIMATORS[kl_type]

    entropy_coef = _number(actor, "entropy_coeff", 0.0) or 0.0
    if entropy_coef < 0:
        raise InvalidInput(f"{ACTOR}.entropy_coeff", f"must be >= 0 (an entropy bonus), got {entropy_coef}")

    epochs = actor.get("ppo_epochs", 1)
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise InvalidInput(f"{ACTOR}.ppo_epochs", f"must be an integer >= 1, got {epochs!r}")

    correction = (algorithm or {}).get("rollout_correction") or {}
    bypass = bool(correction.get("bypass_mode", False))
    if bypass:
        # verl's trainer (apply_bypass_mode) then sets old_log_probs = rollout_log_probs, copies
        # algorithm.rollout_correction into policy_loss.rollout_correction and runs loss_mode=bypass_mode.
        mode = "bypass_mode"
        policy_loss = {**policy_loss, "loss_mode": mode, "rollout_correction": correction}
    for key in () if bypass else ("rollout_is", "rollout_rs"):
        if correction.get(key) is not None:
            raise InvalidInput(f"{ALGORITHM}.rollout_correction.{key}",
                               f"rollout importance weights / rejection are not supported by floe's verl plugin; "
                               f"set it to null (got {correction[key]!r})")

    if mode in ("sapo", "geo_mean"):
        # verl aggregates these policy terms by seq-mean-token-mean (sapo) / the mean over rows
        # (geo_mean) whatever loss_agg_mode says, but its KL and entropy terms by loss_agg_mode.
        if (kl_coef > 0 or entropy_coef > 0) and agg_mode != "seq-mean-token-mean":
            raise InvalidInput(f"{ACTOR}.loss_agg_mode",
                               f"verl's {mode} aggregates its policy term by sequence mean and the KL / entropy terms by "
                               f"loss_agg_mode ({agg_mode!r}); floe has one aggregation per loss: set loss_agg_mode="
                               "seq-mean-token-mean, or turn off use_kl_loss and entropy_coeff")
        aggregation, norm_length = "seq_mean_token_mean", None

    name, specific = _policy_loss(mode, actor, policy_loss, clip_low, clip_high, clip_c)
    config: dict[str, Any] = {
        **specific,
        "aggregation": aggregation,
        "kl": {"coef": kl_coef, "estimator": kl_estimator},
        "entropy": {"coef": entropy_coef},
    }
    if norm_length is not None:
        config["norm_length"] = norm_length
    return VerlLoss(name, config)


def _policy_loss(
    mode: str, actor: Mapping[str, Any], policy_loss: Mapping[str, Any], clip_low: float, clip_high: float,
    clip_c: float | None,
) -> tuple[str, dict[str, Any]]:
    """floe's loss name and its own keys for verl's loss_mode (see the module's table)."""
    clips = {"clip_low": clip_low, "clip_high": clip_high}
    if mode == "vanilla":
        if clip_c is None or clip_c <= 1:
            raise InvalidInput(f"{ACTOR}.clip_ratio_c", f"must be > 1 (verl's dual-clip bound), got {clip_c!r}")
        return "ppo", {**clips, "dual_clip": clip_c}
    if mode in ("dppo_tv", "dppo_kl"):
        if clip_c is None or clip_c <= 0:
            raise InvalidInput(f"{ACTOR}.clip_ratio_c", f"must be > 0 (DPPO's truncation of the ratio), got {clip_c!r}")
        return "dppo", {"divergence": "binary_tv" if mode == "dppo_tv" else "binary_kl", "delta_low": clip_low,
                        "delta_high": clip_high, "surrogate": "log_prob", "ratio_cap": clip_c}
    if mode == "gspo":
        return "gspo", {**clips, "ratio_gradient": "token", "log_ratio_cap": GSPO_LOG_RATIO_CAP}
    if mode == "sapo":
        taus = {k: _number(actor, k, d) for k, d in (("tau_pos", 1.0), ("tau_neg", 1.05))}
        for k, v in taus.items():
            if v is None or v <= 0:
                raise InvalidInput(f"{ACTOR}.{k}", f"must be > 0 (SAPO's gate temperature), got {v!r}")
        return "sapo", taus
    if mode == "gpg":
        return "dro", {"beta": 0.0}
    if mode == "geo_mean":
        return "geo_mean", clips
    if mode == "cispo":
        return "cispo", clips
    if mode == "dro":
        beta = _policy_number(policy_loss, "dro_beta", None)
        if beta is None or beta <= 0:
            raise InvalidInput(f"{ACTOR}.policy_loss.dro_beta", f"must be > 0 for loss_mode=dro (verl requires it), got {beta!r}")
        return "dro", {"beta": beta}
    if mode == "clip_cov":
        ratio = _policy_number(policy_loss, "clip_cov_ratio", 0.0002)
        if ratio is None or not 0 < ratio <= 1:
            raise InvalidInput(f"{ACTOR}.policy_loss.clip_cov_ratio", f"must be in (0, 1], got {ratio!r}")
        lb, ub = _policy_number(policy_loss, "clip_cov_lb", 1.0), _policy_number(policy_loss, "clip_cov_ub", 5.0)
        return "clip_cov", {**clips, "clip_cov_ratio": ratio, "clip_cov_lb": lb if lb is not None else 1.0,
                            "clip_cov_ub": ub if ub is not None else 5.0}
    if mode == "kl_cov":
        ratio = _policy_number(policy_loss, "kl_cov_ratio", 0.0002)
        if ratio is None or not 0 < ratio <= 1:
            raise InvalidInput(f"{ACTOR}.policy_loss.kl_cov_ratio", f"must be in (0, 1] (verl's top-k fails above 1), got {ratio!r}")
        coef = _policy_number(policy_loss, "ppo_kl_coef", 0.1)
        coef = 1.0 if coef is None else coef  # verl's fallback when the key is null
        if coef < 0:
            raise InvalidInput(f"{ACTOR}.policy_loss.ppo_kl_coef", f"must be >= 0, got {coef!r}")
        return "kl_cov", {"kl_cov_ratio": ratio, "ppo_kl_coef": coef}
    assert mode == "bypass_mode"
    from_algorithm = policy_loss.get("rollout_correction") is not None and bool(
        policy_loss["rollout_correction"].get("bypass_mode", False))
    return _bypass_mode(policy_loss.get("rollout_correction"), clips, clip_c,
                        f"{ALGORITHM}.rollout_correction" if from_algorithm else RC)


RC = f"{ACTOR}.policy_loss.rollout_correction"
RC_REFUSED = "is rollout correction (importance weights / rejection computed against the rollout log-probs), which " \
             "floe's verl plugin does not run"


def _bypass_mode(
    rc: Mapping[str, Any] | None, clips: dict[str, float], clip_c: float | None, where: str = RC
) -> tuple[str, dict[str, Any]]:
    """verl's bypass_mode (old log-probs = the rollout's): the cases that are a registry loss
    on those log-probs; everything that needs rejection or batch-level IS weights is refused.
    `where`: the verl key of `rc` (policy_loss.rollout_correction, or algorithm.rollout_correction
    with bypass_mode=true, which verl copies there)."""
    if rc is None:
        raise InvalidInput(RC, "loss_mode=bypass_mode needs policy_loss.rollout_correction (verl raises without it)")
    if rc.get("rollout_rs") is not None:
        raise InvalidInput(f"{where}.rollout_rs", f"rejection sampling {RC_REFUSED}; set it to null")
    loss_type = rc.get("loss_type", "ppo_clip")
    if loss_type == "ppo_clip":  # verl computes the IS weights for its metrics only
        if clip_c is None or clip_c <= 1:
            raise InvalidInput(f"{ACTOR}.clip_ratio_c", f"must be > 1 (verl's dual-clip bound), got {clip_c!r}")
        return "ppo", {**clips, "dual_clip": clip_c}
    if loss_type != "reinforce":
        raise InvalidInput(f"{where}.loss_type", f"must be ppo_clip or reinforce (as in verl), got {loss_type!r}")
    rollout_is = rc.get("rollout_is", "sequence")  # verl's RolloutCorrectionConfig default
    threshold = rc.get("rollout_is_threshold", 2.0)
    if rollout_is is None or threshold is None:
        return "dro", {"beta": 0.0}  # REINFORCE: -A·logp
    if rollout_is != "token":
        raise InvalidInput(f"{where}.rollout_is", f"{rollout_is!r} importance weights {RC_REFUSED}; floe maps 'token' or null")
    if rc.get("rollout_is_batch_normalize", False):
        raise InvalidInput(f"{where}.rollout_is_batch_normalize", f"batch-normalised weights {RC_REFUSED}; set it to false")
    try:
        cap = float(threshold)
    except (TypeError, ValueError):
        raise InvalidInput(f"{where}.rollout_is_threshold",
                           f"a lower_upper threshold (IcePop) {RC_REFUSED}; give one float >= 1") from None
    if isinstance(threshold, bool) or not math.isfinite(cap) or cap < 1:
        raise InvalidInput(f"{where}.rollout_is_threshold", f"must be a float >= 1 (the truncation of the weight), got {threshold!r}")
    # -sg(min(r, C))·A·logp: cispo with the ratio clipped to [0, C].
    return "cispo", {"clip_low": 1.0, "clip_high": cap - 1.0}


def _policy_number(policy_loss: Mapping[str, Any], key: str, default: float | None) -> float | None:
    value = policy_loss.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidInput(f"{ACTOR}.policy_loss.{key}", f"must be a finite number, got {value!r}")
    return float(value)
