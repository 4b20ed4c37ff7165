"""prime-rl's `[trainer.loss]` table -> the floe loss that computes the same thing, or a refusal.

prime-rl (commit `PRIME_RL_COMMIT`, src/prime_rl/trainer/rl/loss.py) has three loss types:

- `default` (DPPO + KL): per token, -keep·adv_tau·A·r + kl_tau·(log r)², r = exp(logp − logp_inf),
  where `keep` drops tokens whose probability moved by more than `dppo_mask_low/high`
  (p − p_inf < −low for A < 0, > high for A > 0).
- `ipo`: the same with a symmetric mask |p − p_inf| > `ipo_threshold`.
- `custom`: a Python function imported by path.

Each token's loss is multiplied by its rl weight and the sum is divided by the step's global
count of trainable tokens (`rl_scale`). Both map to floe's `dppo` loss with the `ratio`
surrogate (−v·r·A, gradient through r) on the inference log-probs as the old policy:
`default` with divergence `binary_tv` (v keeps p − p_inf <= high for A > 0, >= −low otherwise:
prime-rl's `torch.where(A > 0, ...)`), `ipo` with divergence `tv` and both thresholds =
`ipo_threshold`; advantages are scaled by `adv_tau`, and a `k2` KL term (½(logp − ref)², coef =
2·kl_tau, on every trainable token, masked or not, as prime-rl's) whose reference is the
inference log-probs adds kl_tau·(log r)². Aggregation `sum` with per-token weights
rl_weight / rl_scale (batch.py) gives prime-rl's normalisation. floe's ratio is
`bounded_exp(log r)`, equal to exp(log r) below EXP_BOUND (log r = 20). `custom` is refused.

Pure function: no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from floe.errors import InvalidInput

# prime-rl's defaults at the pinned commit (packages/prime-rl-configs/.../configs/trainer.py).
DEFAULTS: dict[str, dict[str, Any]] = {
    "default": {"dppo_mask_low": 0.2, "dppo_mask_high": 0.2, "adv_tau": 1.0, "kl_tau": 1e-3},
    "ipo": {"ipo_threshold": 0.1, "adv_tau": 1.0, "kl_tau": 1e-3},
}


@dataclass(frozen=True)
class MappedLoss:
    """A floe loss for `client.forward_backward(loss=name, loss_config=config)`.

    advantage_scale: multiply prime-rl's advantages by this before sending them.
    ref_is_inference: send the inference log-probs as the samples' `ref_logprobs` (the KL
    term regularises toward the sampling policy, as prime-rl's does).
    """

    name: str
    config: dict[str, Any] = field(default_factory=dict)
    advantage_scale: float = 1.0
    ref_is_inference: bool = False


def map_loss(loss: dict[str, Any] | None, where: str = "trainer.loss") -> MappedLoss:
    """Map prime-rl's `[trainer.loss]` table (None or {} = prime-rl's default loss).

    Raises InvalidInput(f"{where}.<key>", ...) for an unknown type or key, a bad value or a
    `custom` loss.
    """
    table = dict(loss or {})
    kind = table.pop("type", "default")
    if kind == "custom":
        raise InvalidInput(f"{where}.type", "a custom prime-rl loss (a Python function over prime-rl's tensors) cannot "
                           "run in floe; choose a floe loss in [floe.loss] (docs/losses.md)")
    if kind not in DEFAULTS:
        raise InvalidInput(f"{where}.type", f"unknown prime-rl loss type {kind!r}; one of default, ipo, custom")
    values = dict(DEFAULTS[kind])
    for key, value in table.items():
        if key not in values:
            raise InvalidInput(f"{where}.{key}", f"not a key of prime-rl's {kind!r} loss; keys: {', '.join(values)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise InvalidInput(f"{where}.{key}", f"must be a number >= 0, got {value!r}")
        values[key] = float(value)
    if kind == "default":
        mask = {"divergence": "binary_tv", "delta_low": values["dppo_mask_low"], "delta_high": values["dppo_mask_high"]}
    else:
        mask = {"divergence": "tv", "delta_low": values["ipo_threshold"], "delta_high": values["ipo_threshold"]}
    config: dict[str, Any] = {**mask, "surrogate": "ratio", "aggregation": "sum"}
    kl_tau = values["kl_tau"]
    if kl_tau > 0:
        config["kl"] = {"coef": 2.0 * kl_tau, "estimator": "k2"}
    return MappedLoss("dppo", config, advantage_scale=values["adv_tau"], ref_is_inference=kl_tau > 0)


def native_loss(table: dict[str, Any], where: str = "floe.loss") -> MappedLoss:
    """A floe loss chosen directly: `{"name": "ppo", "config": {...}}` (validated by the
    backend when it runs; the name against floe's registry here). Its aggregation is
    forced to `sum` by the trainer's prime-rl normalisation, so `config.aggregation` is refused."""
    from floe.compute.losses import LOSSES, loss_names  # noqa: PLC0415 - the registry; no torch

    table = dict(table)
    name = table.pop("name", None)
    config = table.pop("config", {})
    if table:
        raise InvalidInput(f"{where}.{next(iter(table))}", "unknown key; [floe.loss] has `name` and `config`")
    if name not in LOSSES:
        raise InvalidInput(f"{where}.name", f"unknown floe loss {name!r}; one of {loss_names()}")
    if not isinstance(config, dict):
        raise InvalidInput(f"{where}.config", "must be a table of the loss's keys")
    if "aggregation" in config:
        raise InvalidInput(f"{where}.config.aggregation", "is set by the trainer: prime-rl divides each step's loss by "
                           "its global trainable-token count (weights rl_weight / count, aggregation sum)")
    return MappedLoss(name, {**config, "aggregation": "sum"})
