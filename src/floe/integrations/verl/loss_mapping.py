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
| sapo (…_sapo)                         | sapo: tau_pos, tau_neg; aggregation seq_mean_token_mean whatever loss_agg_mode (verl's own choice); kl / entropy aggregation = loss_agg_mode |
| gpg (…_gpg)                           | dro with beta 0 (−A·logp) |
| clip_cov (…_clip_cov)                 | clip_cov: clip_low/high, clip_cov_ratio, clip_cov_lb, clip_cov_ub |
| kl_cov (…_kl_cov)                     | kl_cov: kl_cov_ratio, ppo_kl_coef |
| geo_mean (…_geo_mean)                 | geo_mean: clip_low/high = clip_ratio_low/high; aggregation seq_mean_token_mean (verl: mean over the micro-batch's rows); kl / entropy aggregation = loss_agg_mode |
| dro (…_dro)                           | dro: beta = dro_beta (> 0) |
| cispo (…_cispo)                       | cispo: clip_low/high = clip_ratio_low/high |
| bypass_mode (…_bypass_mode)           | policy_loss.rollout_correction: loss_type ppo_clip → ppo (dual clip), reinforce → dro beta 0; verl's IS weights and rejection from the current policy per mini-batch folded into A (bypass.py); needs algorithm.rollout_correction.bypass_mode=true |

| verl key (actor_rollout_ref.actor.*)          | floe loss_config                               |
|-----------------------------------------------|------------------------------------------------|
| clip_ratio_low / clip_ratio_high (clip_ratio) | clip_low / clip_high (dppo: delta_low / delta_high) |
| clip_ratio_c                                  | dual_clip (vanilla, bypass_mode ppo_clip), ratio_cap (dppo) |
| loss_agg_mode token-mean / token-sum          | aggregation token_mean / sum (and kl.aggregation, entropy.aggregation) |
| loss_agg_mode seq-mean-token-mean             | aggregation seq_mean_token_mean                |
| loss_agg_mode seq-mean-token-sum              | seq_mean_token_sum_norm, norm_length 1         |
| loss_agg_mode seq-mean-token-sum-norm         | seq_mean_token_sum_norm, norm_length = loss_scale_factor (None: longest response of the mini-batch) |
| use_kl_loss, kl_loss_coef                     | kl.coef (0 when use_kl_loss is false)          |
| kl_loss_type kl|k1, mse|k2, low_var_kl|k3     | kl.estimator k1 / k2 / k3 ("abs", "full", "+" refused) |
| entropy_coeff                                 | entropy.coef (must be >= 0)                    |
| tau_pos, tau_neg (sapo)                       | tau_pos, tau_neg                               |
| policy_loss.clip_cov_ratio/_lb/_ub, kl_cov_ratio, ppo_kl_coef, dro_beta | the same-named floe keys (dro_beta -> beta) |
| algorithm.rollout_correction.*                | A·w_is and response_mask (`rollout_correction`) |
| policy_loss.rollout_correction.* (bypass_mode) | A·m'·w (`bypass_loss_correction`, bypass.py) |

sapo and geo_mean fix their policy term's aggregation (seq-mean-token-mean, geo_mean's mean over
rows), while verl aggregates the KL and entropy terms by loss_agg_mode for every loss_mode
(workers/utils/losses.ppo_loss: agg_loss(kld / entropy, response_mask, loss_agg_mode)): floe's
`aggregation` is the policy term's, `kl.aggregation` and `entropy.aggregation` are loss_agg_mode's
(norm_length, from loss_scale_factor, serves whichever term uses seq_mean_token_sum_norm).

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

`algorithm.rollout_correction` (verl's rollout correction, decoupled mode): verl's V1 trainer
itself computes the importance weights and the rejection mask (rollout_corr_helper.
compute_rollout_correction_and_add_to_batch, in `_compute_advantage`) from the trainer's
log-probs (`old_log_probs`, floe's policy forward) and the sampler's (`rollout_log_probs`, floe's
sampled log-probs), and writes `rollout_is_weights` and the rejected tokens' zeros into
`response_mask`. The rejection reaches floe as zero weights (out of every denominator and every
batch statistic, as verl's agg_loss and its clip_cov / kl_cov selection drop them): any loss_mode.
verl multiplies only the policy-gradient term by w_is (`pg_losses * rollout_is_weights` in each
core_algos policy loss; KL and entropy unweighted, the denominators from response_mask), so the
plugin sends A·w_is as floe's advantage (`weighted_advantages`). That is exact for the losses
whose per-token policy term is positively homogeneous in A (ℓ(w·A) = w·ℓ(A), w >= 0): vanilla
(dual clip included), dppo_tv / dppo_kl (the trust-region mask reads only sign(A)), gspo
(GSPO-token, per-token A), sapo (the gate temperature reads only sign(A)), gpg and cispo
(`IS_FOLD_EXACT`). It is not for clip_cov and kl_cov (their token selection is a covariance of A
with log p), geo_mean (verl weights each sequence by the geometric mean of w, the fold would give
the arithmetic mean of A·w) and dro (its ½β(log r)² penalty is multiplied by w but holds no A):
rollout_is with those is refused by key (`IS_FOLD_REFUSED`).

Bypass. The plugin runs verl's V1 trainer, whose bypass (`algorithm.rollout_correction.
bypass_mode=true`) only puts the sampler's log-probs in `old_log_probs` and skips the decoupled
correction (trainer_base._compute_old_log_prob; the V1 trainer does not call the legacy
trainer's apply_bypass_mode): any loss_mode then runs against the sampler's log-probs, and
rollout_is / rollout_rs in that block would be ignored, so they are refused. verl's
`policy_loss.loss_mode=bypass_mode` loss computes the correction itself from the policy being
updated, per mini-batch, with `policy_loss.rollout_correction` (`bypass_loss_correction`,
applied by bypass.py with verl's own compute_rollout_correction_and_rejection_mask: ppo_clip ->
ppo on the rejected mask, reinforce -> dro with beta 0 on A·w); it needs bypass_mode=true.

ppo_epochs, ppo_mini_batch_size and shuffle are honoured by the plugin's update loop (verl's own
mini-batch iterator).
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
# loss_modes whose policy term is not positively homogeneous in A: verl's rollout IS weights
# (`pg_losses * rollout_is_weights`) cannot be folded into the advantages; why, for the refusal.
IS_FOLD_REFUSED: dict[str, str] = {
    "clip_cov": "its token selection is a covariance of the advantages with the log-probs",
    "kl_cov": "its token selection is a covariance of the advantages with the log-probs",
    "geo_mean": "it weights each sequence by the geometric mean of the IS weights (a fold would give the arithmetic "
                "mean of A·w)",
    "dro": "its ½·dro_beta·(log r)² penalty is multiplied by the IS weight but holds no advantage",
}
# The others: ℓ(w·A) = w·ℓ(A) for w >= 0, so A·w_is is verl's loss exactly (bypass_mode: no trainer IS weights).
IS_FOLD_EXACT = tuple(m for m in LOSS_MODES if m not in IS_FOLD_REFUSED and m != "bypass_mode")
GSPO_LOG_RATIO_CAP = 10.0  # verl's and SkyRL's clamp of GSPO's log-ratio before the exp
_KL_ESTIMATORS = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


@dataclass(frozen=True)
class VerlLoss:
    """What one verl mini-batch update asks of floe: `client.forward_backward(batch, loss,
    loss_config)`, plus whether reference log-probs must travel (the KL term) and whether
    verl's rollout importance weights multiply the advantages (`weighted_advantages`)."""

    loss: str
    loss_config: dict[str, Any] = field(default_factory=dict)
    rollout_is_weights: bool = False  # verl's trainer writes `rollout_is_weights`: fold them into A
    # loss_mode=bypass_mode: verl's bypass correction, from each mini-batch's current log-probs (bypass.py)
    bypass: RolloutCorrection | None = None

    @property
    def needs_ref_logprobs(self) -> bool:
        return self.loss_config["kl"]["coef"] > 0


# loss modes whose clip_ratio_low bounds a ratio exp(.) > 0 from below (1 - clip_ratio_low)
_RATIO_CLAMPS = ("vanilla", "cispo", "gspo", "clip_cov")


def _number(cfg: Mapping[str, Any], key: str, default: float | None, where: str = ACTOR) -> float | None:
    """cfg[key] (or `default`) as a float; InvalidInput("<where>.<key>") unless a finite number or None."""
    value = cfg.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidInput(f"{where}.{key}", f"must be a finite number, got {value!r}")
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
    for name in policy_loss:
        if name == "rollout_correction" and mode != "bypass_mode":
            raise InvalidInput(f"{ACTOR}.policy_loss.rollout_correction", "is read only by loss_mode=bypass_mode")

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

    correction = rollout_correction((algorithm or {}).get("rollout_correction"))
    bypass = None
    if mode == "bypass_mode":
        if not correction.bypass_mode:
            raise InvalidInput(f"{ACTOR}.policy_loss.loss_mode", "bypass_mode treats the old log-probs as the sampler's: it needs "
                               f"{RC}.bypass_mode=true (else verl would correct twice, on the trainer's log-probs)")
        bypass = bypass_loss_correction(policy_loss.get("rollout_correction"))
    if correction.rollout_is is not None and mode in IS_FOLD_REFUSED:
        raise InvalidInput(f"{RC}.rollout_is", f"verl's {mode} loss with rollout IS weights is not supported by floe's verl "
                           f"plugin: {IS_FOLD_REFUSED[mode]}, so the weights cannot be folded into the advantages "
                           "exactly; set rollout_is=null (rejection, rollout_rs, works with every loss_mode)")

    # verl's KL and entropy terms are agg_loss(..., loss_agg_mode) for every loss_mode (workers/utils/
    # losses.ppo_loss); so is the policy term except sapo's (seq-mean-token-mean) and geo_mean's (the
    # mean over rows) whatever loss_agg_mode says: floe's kl.aggregation / entropy.aggregation.
    policy_aggregation = "seq_mean_token_mean" if mode in ("sapo", "geo_mean") else aggregation

    name, specific = _policy_loss(mode, actor, policy_loss, clip_low, clip_high, clip_c, bypass)
    config: dict[str, Any] = {
        **specific,
        "aggregation": policy_aggregation,
        "kl": {"coef": kl_coef, "estimator": kl_estimator, "aggregation": aggregation},
        "entropy": {"coef": entropy_coef, "aggregation": aggregation},
    }
    if norm_length is not None:
        config["norm_length"] = norm_length
    return VerlLoss(name, config, rollout_is_weights=correction.rollout_is is not None, bypass=bypass)


def _policy_loss(
    mode: str, actor: Mapping[str, Any], policy_loss: Mapping[str, Any], clip_low: float, clip_high: float,
    clip_c: float | None, bypass: RolloutCorrection | None = None,
) -> tuple[str, dict[str, Any]]:
    """floe's loss name and its own keys for verl's loss_mode (see the module's table)."""
    clips = {"clip_low": clip_low, "clip_high": clip_high}
    if mode == "bypass_mode" and bypass is not None and bypass.loss_type == "reinforce":
        # compute_policy_loss_reinforce: -A·logp·w = floe's dro with beta 0 on A·w (no ratio, no clip; bypass.py)
        return "dro", {"beta": 0.0}
    if mode in ("vanilla", "bypass_mode"):  # bypass_mode ppo_clip: vanilla PPO on the rejected mask (bypass.py)
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
    raise AssertionError(mode)  # LOSS_MODES is checked first


def _policy_number(policy_loss: Mapping[str, Any], key: str, default: float | None) -> float | None:
    return _number(policy_loss, key, default, f"{ACTOR}.policy_loss")


RC = f"{ALGORITHM}.rollout_correction"
# verl 0.9.1 rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS
ROLLOUT_RS_OPTIONS = frozenset({
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
})
# verl 0.9.1 RolloutCorrectionConfig's keys and the YAML defaults (trainer/config/algorithm/rollout_correction.yaml)
ROLLOUT_CORRECTION_DEFAULTS: dict[str, Any] = {
    "rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
    "rollout_rs": None, "rollout_rs_threshold": None, "bypass_mode": False, "loss_type": "ppo_clip",
}


@dataclass(frozen=True)
class RolloutCorrection:
    """verl's `algorithm.rollout_correction`, validated (the keys as verl names them)."""

    rollout_is: str | None = None
    rollout_is_threshold: str | float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"


def _positive_numbers(spec: Any, key: str, *, pair_ok: bool) -> list[float]:
    """A threshold as verl writes it: a positive number, or (where `pair_ok`) "lower_upper"."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise InvalidInput(key, f"must be a number or a string, got {spec!r}")
    parts = str(spec).strip().split("_", 1) if isinstance(spec, str) else [str(spec)]
    if len(parts) == 2 and not pair_ok:
        raise InvalidInput(key, f"takes one upper bound here, not a 'lower_upper' pair, got {spec!r}")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise InvalidInput(key, f"not a number or 'lower_upper' pair: {spec!r}") from None
    if not all(math.isfinite(v) and v > 0 for v in values) or (len(values) == 2 and values[0] > values[1]):
        raise InvalidInput(key, f"bounds must be positive and lower <= upper, got {spec!r}")
    return values


def rollout_correction(cfg: Mapping[str, Any] | None) -> RolloutCorrection:
    """Validate verl 0.9.1's `algorithm.rollout_correction` (a dict, or None) for floe's plugin.

    Honoured (decoupled mode, computed by verl's own trainer; see the module doc):
    `rollout_is` token | sequence with `rollout_is_threshold` (a number: TIS, w = min(ρ, C);
    "lower_upper": IcePop, w = ρ inside [lower, upper], else 0), `rollout_is_batch_normalize`,
    `rollout_rs` (comma-separated options of ROLLOUT_RS_OPTIONS) with `rollout_rs_threshold`, and
    `bypass_mode` (old log-probs = the sampler's). Refused, naming the key: unknown keys, values
    verl rejects, thresholds or loss_type set for a feature that is off (verl would ignore them),
    and bypass_mode with rollout_is / rollout_rs / loss_type=reinforce here: verl's V1 trainer skips
    its correction in bypass mode, so they would be ignored; verl applies them only in its
    `bypass_mode` policy loss, configured under `actor.policy_loss.rollout_correction`
    (`bypass_loss_correction`).
    """
    return _correction(cfg, RC, ROLLOUT_CORRECTION_DEFAULTS, in_loss=False)


BYPASS_RC = f"{ACTOR}.policy_loss.rollout_correction"
# verl 0.9.1's RolloutCorrectionConfig dataclass defaults: what `actor.policy_loss.rollout_correction`
# holds when the recipe sets none of it (the actor YAML has no such block; note rollout_is "sequence").
BYPASS_LOSS_DEFAULTS: dict[str, Any] = {**ROLLOUT_CORRECTION_DEFAULTS, "rollout_is": "sequence"}


def bypass_loss_correction(cfg: Mapping[str, Any] | None) -> RolloutCorrection:
    """Validate `actor_rollout_ref.actor.policy_loss.rollout_correction`, the config verl's
    `bypass_mode` policy loss reads (core_algos.compute_policy_loss_bypass_mode), with the
    dataclass defaults (BYPASS_LOSS_DEFAULTS). Same keys and checks as `rollout_correction`;
    `loss_type` ppo_clip | reinforce both honoured; its `bypass_mode` key is not read by the loss
    (verl's trainer reads `algorithm.rollout_correction.bypass_mode`). Refused besides:
    `rollout_is_batch_normalize` with reinforce (verl normalises per micro-batch)."""
    c = _correction(cfg, BYPASS_RC, BYPASS_LOSS_DEFAULTS, in_loss=True)
    if c.loss_type == "reinforce" and c.rollout_is_batch_normalize:
        raise InvalidInput(f"{BYPASS_RC}.rollout_is_batch_normalize", "verl's bypass loss normalises the weights over each "
                           "micro-batch, a split floe does not reproduce (floe plans its own micro-batches)")
    return c


def _correction(cfg: Mapping[str, Any] | None, prefix: str, defaults: dict[str, Any], *, in_loss: bool) -> RolloutCorrection:
    if cfg is None:
        cfg = {}
    if not isinstance(cfg, Mapping):
        raise InvalidInput(prefix, f"must be a mapping, got {type(cfg).__name__}")
    for name in cfg:
        if name not in defaults and name != "_target_":  # hydra's class tag, no setting
            raise InvalidInput(f"{prefix}.{name}", f"not a verl 0.9.1 rollout_correction key ({sorted(defaults)})")
    c = {**defaults, **{k: v for k, v in cfg.items() if k != "_target_"}}
    level = c["rollout_is"]
    if level not in (None, "token", "sequence"):
        raise InvalidInput(f"{prefix}.rollout_is", f"must be null, 'token' or 'sequence', got {level!r}")
    threshold = c["rollout_is_threshold"]
    if level is not None:
        _positive_numbers(threshold, f"{prefix}.rollout_is_threshold", pair_ok=True)
    elif threshold != defaults["rollout_is_threshold"]:
        raise InvalidInput(f"{prefix}.rollout_is_threshold", "has no effect with rollout_is=null; set rollout_is, or leave it at 2.0")
    normalize = c["rollout_is_batch_normalize"]
    if not isinstance(normalize, bool):
        raise InvalidInput(f"{prefix}.rollout_is_batch_normalize", f"must be a boolean, got {normalize!r}")
    if normalize and level is None:
        raise InvalidInput(f"{prefix}.rollout_is_batch_normalize", "has no effect with rollout_is=null")
    rs, rs_threshold = c["rollout_rs"], c["rollout_rs_threshold"]
    if rs is not None:
        options = [o.strip() for o in rs.split(",") if o.strip()] if isinstance(rs, str) else []
        if not options or any(o not in ROLLOUT_RS_OPTIONS for o in options):
            raise InvalidInput(f"{prefix}.rollout_rs", f"comma-separated options of {sorted(ROLLOUT_RS_OPTIONS)}, got {rs!r}")
        if rs_threshold is None:
            raise InvalidInput(f"{prefix}.rollout_rs_threshold", "is required when rollout_rs is set")
        specs = [s.strip() for s in rs_threshold.split(",") if s.strip()] if isinstance(rs_threshold, str) else [rs_threshold]
        unique = list(dict.fromkeys(options))
        if len(specs) not in (1, len(unique)):
            raise InvalidInput(f"{prefix}.rollout_rs_threshold", f"one threshold for all options or one per option ({len(unique)}), got {rs_threshold!r}")
        for option, spec in zip(unique, specs * len(unique) if len(specs) == 1 else specs):
            _positive_numbers(spec, f"{prefix}.rollout_rs_threshold", pair_ok=option.endswith("k1"))
    elif rs_threshold is not None:
        raise InvalidInput(f"{prefix}.rollout_rs_threshold", "has no effect with rollout_rs=null")
    bypass, loss_type = c["bypass_mode"], c["loss_type"]
    if not isinstance(bypass, bool):
        raise InvalidInput(f"{prefix}.bypass_mode", f"must be a boolean, got {bypass!r}")
    if loss_type not in ("ppo_clip", "reinforce"):
        raise InvalidInput(f"{prefix}.loss_type", f"must be 'ppo_clip' or 'reinforce', got {loss_type!r}")
    if not in_loss:
        if loss_type != "ppo_clip":
            raise InvalidInput(f"{prefix}.loss_type", "is read only by verl's bypass_mode policy loss, from "
                               f"{BYPASS_RC}.loss_type (with policy_loss.loss_mode=bypass_mode); leave it at ppo_clip here")
        if bypass and (level is not None or rs is not None):
            key = "rollout_is" if level is not None else "rollout_rs"
            raise InvalidInput(f"{prefix}.{key}", "with bypass_mode=true verl's trainer skips this correction (it would be "
                               "ignored); verl's bypass variants compute it inside the bypass_mode policy loss: set "
                               f"policy_loss.loss_mode=bypass_mode and {BYPASS_RC}.{key}, or use bypass_mode=false "
                               "(decoupled: verl's trainer computes it once per batch)")
    return RolloutCorrection(level, threshold, normalize, rs, rs_threshold, bypass, loss_type)


def weighted_advantages(advantages: list[list[float]], weights: list[list[float]]) -> list[list[float]]:
    """verl's rollout IS weights folded into the advantages, per row and token: A'_t = A_t·w_t.

    Exact for verl's vanilla PPO loss: w ≥ 0 and ℓ_ppo(w·A) = w·ℓ_ppo(A), dual clip included
    (min(r·wA, clip(r)·wA) = w·min(r·A, clip(r)·A), and for A < 0 the cap −c·wA = w·(−c·A)), which is
    verl's `pg_losses * rollout_is_weights` (core_algos.compute_policy_loss_vanilla); the KL and
    entropy terms stay unweighted, as in verl. Rows are ragged lists of equal lengths pairwise.
    """
    if len(advantages) != len(weights):
        raise InvalidInput("rollout_is_weights", f"{len(weights)} rows for {len(advantages)} rows of advantages")
    out = []
    for a, w in zip(advantages, weights):
        if len(a) != len(w):
            raise InvalidInput("rollout_is_weights", f"a row of {len(w)} weights for {len(a)} advantages")
        if any(not (x >= 0) for x in w):
            raise InvalidInput("rollout_is_weights", "verl's rollout IS weights must be >= 0")
        out.append([x * y for x, y in zip(a, w)])
    return out
