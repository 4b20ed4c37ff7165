"""verl's actor loss config -> floe's loss name and loss_config (pure; no verl import).

verl's PPO actor loss (verl.workers.utils.losses.ppo_loss with the "vanilla" policy loss of
verl.trainer.ppo.core_algos) is floe's `ppo` loss with a dual clip, an aggregation, an
optional KL term against the reference and an optional entropy bonus. Every key that changes
the loss is either mapped or refused with floe.errors.InvalidInput naming verl's key (e.g.
"actor_rollout_ref.actor.policy_loss.loss_mode") — never silently ignored.

| verl key (actor_rollout_ref.actor.*)          | floe loss_config                               |
|-----------------------------------------------|------------------------------------------------|
| policy_loss.loss_mode = vanilla               | loss "ppo" (other modes refused)               |
| clip_ratio_low / clip_ratio_high (clip_ratio) | clip_low / clip_high                           |
| clip_ratio_c                                  | dual_clip                                      |
| loss_agg_mode token-mean / token-sum          | aggregation token_mean / sum                   |
| loss_agg_mode seq-mean-token-mean             | aggregation seq_mean_token_mean                |
| loss_agg_mode seq-mean-token-sum              | seq_mean_token_sum_norm, norm_length 1         |
| loss_agg_mode seq-mean-token-sum-norm         | seq_mean_token_sum_norm, norm_length = loss_scale_factor (None: longest response of the mini-batch) |
| use_kl_loss, kl_loss_coef                     | kl.coef (0 when use_kl_loss is false)          |
| kl_loss_type kl|k1, mse|k2, low_var_kl|k3     | kl.estimator k1 / k2 / k3 ("abs", "full", "+" refused) |
| entropy_coeff                                 | entropy.coef (must be >= 0)                    |

algorithm.rollout_correction.rollout_is / rollout_rs (importance weights and rejection of
rollout tokens) are refused; ppo_epochs, ppo_mini_batch_size and shuffle are honoured by the
plugin's update loop (verl's own mini-batch iterator), micro-batch sizes do not change the
numbers (floe plans its own micro-batches).
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
    loss_config)`, plus whether reference log-probs must travel (the KL term)."""

    loss: str
    loss_config: dict[str, Any] = field(default_factory=dict)

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
    if mode != "vanilla":
        raise InvalidInput(f"{ACTOR}.policy_loss.loss_mode",
                           f"floe maps verl's 'vanilla' PPO loss only, got {mode!r}; use loss_mode=vanilla")

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

    correction = (algorithm or {}).get("rollout_correction") or {}
    for key in ("rollout_is", "rollout_rs"):
        if correction.get(key) is not None:
            raise InvalidInput(f"{ALGORITHM}.rollout_correction.{key}",
                               f"rollout importance weights / rejection are not supported by floe's verl plugin; "
                               f"set it to null (got {correction[key]!r})")

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
    return VerlLoss("ppo", config)
