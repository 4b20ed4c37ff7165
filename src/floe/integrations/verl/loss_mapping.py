"""verl's actor loss config -> floe's loss name and loss_config (pure; no verl import).

verl's PPO actor loss (verl.workers.utils.losses.ppo_loss with the "vanilla" policy loss of
verl.trainer.ppo.core_algos) is floe's `ppo` loss with a dual clip, an aggregation, an
optional KL term against the reference and an optional entropy bonus. Every key that changes
the loss is either mapped or refused with floe.errors.InvalidInput naming verl's key (e.g.
"actor_rollout_ref.actor.policy_loss.loss_mode") — never silently ignored.

| verl key (actor_rollout_ref.actor.*)          | floe loss_config                               |
|-----------------------------------------------|------------------------------------------------|
| policy_loss.loss_mode = vanilla               | loss "ppo"                                     |
| policy_loss.loss_mode = bypass_mode           | "ppo" (ppo_clip) / "dro", beta 0 (reinforce)   |
| clip_ratio_low / clip_ratio_high (clip_ratio) | clip_low / clip_high                           |
| clip_ratio_c                                  | dual_clip                                      |
| loss_agg_mode token-mean / token-sum          | aggregation token_mean / sum                   |
| loss_agg_mode seq-mean-token-mean             | aggregation seq_mean_token_mean                |
| loss_agg_mode seq-mean-token-sum              | seq_mean_token_sum_norm, norm_length 1         |
| loss_agg_mode seq-mean-token-sum-norm         | seq_mean_token_sum_norm, norm_length = loss_scale_factor (None: longest response of the mini-batch) |
| use_kl_loss, kl_loss_coef                     | kl.coef (0 when use_kl_loss is false)          |
| kl_loss_type kl|k1, mse|k2, low_var_kl|k3     | kl.estimator k1 / k2 / k3 ("abs", "full", "+" refused) |
| entropy_coeff                                 | entropy.coef (must be >= 0)                    |
| algorithm.rollout_correction.*                | A·w_is and response_mask (`rollout_correction`) |

`algorithm.rollout_correction` (verl's rollout correction, decoupled mode): verl's V1 trainer
itself computes the importance weights and the rejection mask (rollout_corr_helper.
compute_rollout_correction_and_add_to_batch, in `_compute_advantage`) from the trainer's
log-probs (`old_log_probs`, floe's policy forward) and the sampler's (`rollout_log_probs`, floe's
sampled log-probs), and writes `rollout_is_weights` and the rejected tokens' zeros into
`response_mask`. The rejection reaches floe as zero weights (out of every denominator, as verl's
agg_loss drops them). verl multiplies only the policy-gradient term by w_is (core_algos.
compute_policy_loss_vanilla: pg_losses * rollout_is_weights; KL and entropy unweighted, the
denominators from response_mask), and verl's PPO loss with dual clip is positively homogeneous
in the advantage, so the plugin sends A·w_is as floe's advantage (`weighted_advantages`): the
same loss and gradients, exactly. bypass_mode=true alone is verl V1's own bypass (old log-probs =
the sampler's, no policy forward); with `policy_loss.loss_mode=bypass_mode` verl's bypass loss
computes the correction from the policy being updated, per mini-batch (`bypass_loss_correction`,
applied by bypass.py: ppo_clip -> ppo, reinforce -> dro with beta 0).

ppo_epochs, ppo_mini_batch_size and shuffle are honoured by the plugin's update loop (verl's own
mini-batch iterator), micro-batch sizes do not change the numbers (floe plans its own
micro-batches).
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
    if mode not in ("vanilla", "bypass_mode"):
        raise InvalidInput(f"{ACTOR}.policy_loss.loss_mode",
                           f"floe maps verl's 'vanilla' PPO loss and its 'bypass_mode' loss only, got {mode!r}")
    for name in policy_loss:
        if name == "rollout_correction" and mode != "bypass_mode":
            raise InvalidInput(f"{ACTOR}.policy_loss.rollout_correction", "is read only by loss_mode=bypass_mode")

    clip = _number(actor, "clip_ratio", 0.2)
    clip_low = _number(actor, "clip_ratio_low", None)
    clip_high = _number(actor, "clip_ratio_high", None)
    clip_low = clip if clip_low is None else clip_low
    clip_high = clip if clip_high is None else clip_high
    if clip_low is None or not 0 <= clip_low <= 1:
        raise InvalidInput(f"{ACTOR}.clip_ratio_low", f"must be in [0, 1] (the ratio's lower clip is 1 - it), got {clip_low!r}")
    if clip_high is None or clip_high < 0:
        raise InvalidInput(f"{ACTOR}.clip_ratio_high", f"must be >= 0, got {clip_high!r}")
    dual_clip = _number(actor, "clip_ratio_c", 3.0)
    if dual_clip is None or dual_clip <= 1:
        raise InvalidInput(f"{ACTOR}.clip_ratio_c", f"must be > 1 (verl's dual-clip bound), got {dual_clip!r}")

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

    config: dict[str, Any] = {
        "clip_low": clip_low,
        "clip_high": clip_high,
        "dual_clip": dual_clip,
        "aggregation": aggregation,
        "kl": {"coef": kl_coef, "estimator": kl_estimator},
        "entropy": {"coef": entropy_coef},
    }
    if norm_length is not None:
        config["norm_length"] = norm_length
    if bypass is not None and bypass.loss_type == "reinforce":
        # compute_policy_loss_reinforce: -A·logp·w = floe's dro with beta 0 on A·w (no ratio, no clip)
        for key in ("clip_low", "clip_high", "dual_clip"):
            del config[key]
        return VerlLoss("dro", {**config, "beta": 0.0}, bypass=bypass)
    return VerlLoss("ppo", config, rollout_is_weights=correction.rollout_is is not None, bypass=bypass)


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
