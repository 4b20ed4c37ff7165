"""floe.integrations.verl's pure mappings (no verl import; core suite): verl's actor loss
config -> floe's loss, the `floe` block and optimizer -> the backend, verl's sampling params
-> floe.SamplingParams. Every key floe cannot honour is refused by its verl name; the mapped
loss configs are accepted by a real floe backend."""

from __future__ import annotations

import pytest

import floe
import floe.compute.losses
from floe.integrations.verl.backend_config import floe_target
from floe.integrations.verl.local_server import LocalServer, null_overrides, to_toml
from floe.integrations.verl.loss_mapping import (
    IS_FOLD_EXACT,
    IS_FOLD_REFUSED,
    ROLLOUT_CORRECTION_DEFAULTS,
    verl_loss,
    weighted_advantages,
)
from floe.integrations.verl.loss_mapping import LOSS_MODES as MAPPED_MODES
from floe.integrations.verl.rollout_mapping import floe_sampling_params

# verl 0.9.1's actor defaults (verl/trainer/config/actor/actor.yaml) for the keys the loss reads.
VERL_ACTOR_DEFAULTS = {
    "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
    "policy_loss": {"loss_mode": "vanilla"}, "loss_agg_mode": "token-mean", "loss_scale_factor": None,
    "entropy_coeff": 0, "use_kl_loss": False, "kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl", "ppo_epochs": 1,
    "optim": {"optimizer": "AdamW", "lr": 1e-6, "weight_decay": 0.01, "betas": [0.9, 0.999], "clip_grad": 1.0,
              "lr_scheduler_type": "constant", "lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.0},
}


def actor(**changes):
    return {**VERL_ACTOR_DEFAULTS, **changes}


def test_verl_defaults_are_ppo_with_verls_dual_clip_and_token_mean():
    loss = verl_loss(actor())
    assert loss.loss == "ppo"
    assert loss.loss_config == {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 3.0, "aggregation": "token_mean",
                                "kl": {"coef": 0.0, "estimator": "k3", "aggregation": "token_mean"},
                                "entropy": {"coef": 0.0, "aggregation": "token_mean"}}
    assert not loss.needs_ref_logprobs


@pytest.mark.parametrize(
    ("mode", "factor", "aggregation", "norm_length"),
    [
        ("token-mean", None, "token_mean", None),
        ("token-sum", None, "sum", None),
        ("seq-mean-token-mean", None, "seq_mean_token_mean", None),
        ("seq-mean-token-sum", None, "seq_mean_token_sum_norm", 1),
        ("seq-mean-token-sum-norm", None, "seq_mean_token_sum_norm", None),
        ("seq-mean-token-sum-norm", 512, "seq_mean_token_sum_norm", 512),
    ],
)
def test_aggregation_modes(mode, factor, aggregation, norm_length):
    cfg = verl_loss(actor(loss_agg_mode=mode, loss_scale_factor=factor)).loss_config
    assert cfg["aggregation"] == aggregation and cfg.get("norm_length") == norm_length
    assert cfg["kl"]["aggregation"] == cfg["entropy"]["aggregation"] == aggregation  # agg_loss(.., loss_agg_mode)


@pytest.mark.parametrize("loss_mode", ["sapo", "geo_mean"])
@pytest.mark.parametrize(
    ("mode", "factor", "aggregation", "norm_length"),
    [("token-mean", None, "token_mean", None), ("token-sum", None, "sum", None),
     ("seq-mean-token-sum", None, "seq_mean_token_sum_norm", 1), ("seq-mean-token-sum-norm", 64, "seq_mean_token_sum_norm", 64)],
)
def test_sapo_and_geo_mean_aggregate_kl_and_entropy_by_loss_agg_mode(loss_mode, mode, factor, aggregation, norm_length):
    """verl's sapo / geo_mean policy term is a sequence mean whatever loss_agg_mode says; its KL and
    entropy terms follow loss_agg_mode (ppo_loss's agg_loss): floe's kl / entropy aggregation."""
    mapped = verl_loss(actor(policy_loss={"loss_mode": loss_mode}, loss_agg_mode=mode, loss_scale_factor=factor,
                             use_kl_loss=True, kl_loss_coef=0.01, entropy_coeff=0.001))
    cfg = mapped.loss_config
    assert cfg["aggregation"] == "seq_mean_token_mean"
    assert cfg["kl"]["aggregation"] == cfg["entropy"]["aggregation"] == aggregation
    assert cfg.get("norm_length") == norm_length
    floe.compute.losses.resolve_loss(mapped.loss, cfg)  # floe accepts it (norm_length serves the KL / entropy terms)


@pytest.mark.parametrize(("verl_type", "estimator"), [("kl", "k1"), ("k1", "k1"), ("mse", "k2"), ("k2", "k2"),
                                                     ("low_var_kl", "k3"), ("k3", "k3")])
def test_kl_loss_maps_coefficient_and_estimator(verl_type, estimator):
    loss = verl_loss(actor(use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type=verl_type))
    assert loss.loss_config["kl"] == {"coef": 0.05, "estimator": estimator, "aggregation": "token_mean"}
    assert loss.needs_ref_logprobs


def test_a_lower_clip_of_one_or_more_is_no_lower_clip():
    # verl clamps the ratio (> 0) at 1 - clip_ratio_low: >= 1 never bites (verl's cispo example uses 10)
    for mode in ("vanilla", "cispo"):
        cfg = verl_loss(actor(policy_loss={"loss_mode": mode}, clip_ratio_low=10, clip_ratio_high=0.2)).loss_config
        assert cfg["clip_low"] == 1.0 and cfg["clip_high"] == 0.2
    # geo_mean's lower bound is on the log-ratio: kept as given
    assert verl_loss(actor(policy_loss={"loss_mode": "geo_mean"}, clip_ratio_low=1.5)).loss_config["clip_low"] == 1.5


def test_clips_entropy_and_the_clip_ratio_fallback():
    cfg = verl_loss(actor(clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=5.0, entropy_coeff=0.01)).loss_config
    assert (cfg["clip_low"], cfg["clip_high"], cfg["dual_clip"], cfg["entropy"]) == (0.1, 0.28, 5.0, {"coef": 0.01, "aggregation": "token_mean"})
    cfg = verl_loss(actor(clip_ratio=0.3, clip_ratio_low=None, clip_ratio_high=None)).loss_config
    assert (cfg["clip_low"], cfg["clip_high"]) == (0.3, 0.3)


BYPASS = {"rollout_correction": {"bypass_mode": True}}  # verl's trainer bypass: old log-probs = the sampler's


@pytest.mark.parametrize(
    ("changes", "algorithm", "field"),
    [
        ({"policy_loss": {"loss_mode": "reinforce"}}, None, "actor_rollout_ref.actor.policy_loss.loss_mode"),
        ({"policy_loss": {"loss_mode": "dro"}}, None, "actor_rollout_ref.actor.policy_loss.dro_beta"),
        ({"policy_loss": {"loss_mode": "dro", "dro_beta": 0.0}}, None, "actor_rollout_ref.actor.policy_loss.dro_beta"),
        ({"policy_loss": {"loss_mode": "clip_cov", "clip_cov_ratio": 0.0}}, None,
         "actor_rollout_ref.actor.policy_loss.clip_cov_ratio"),
        ({"policy_loss": {"loss_mode": "kl_cov", "kl_cov_ratio": 2.0}}, None, "actor_rollout_ref.actor.policy_loss.kl_cov_ratio"),
        ({"policy_loss": {"loss_mode": "kl_cov", "ppo_kl_coef": "x"}}, None, "actor_rollout_ref.actor.policy_loss.ppo_kl_coef"),
        ({"policy_loss": {"loss_mode": "sapo"}, "tau_neg": 0.0}, None, "actor_rollout_ref.actor.tau_neg"),
        ({"policy_loss": {"loss_mode": "dppo_tv"}, "clip_ratio_c": 0.0}, None, "actor_rollout_ref.actor.clip_ratio_c"),
        # loss_mode=bypass_mode (verl's bypass loss, bypass.py): needs the trainer's bypass, then its block's checks
        ({"policy_loss": {"loss_mode": "bypass_mode"}}, None, "actor_rollout_ref.actor.policy_loss.loss_mode"),
        ({"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": {"rollout_rs": "token_k1"}}}, BYPASS,
         "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_rs_threshold"),
        ({"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": {
            "loss_type": "reinforce", "rollout_is": "token", "rollout_is_batch_normalize": True}}}, BYPASS,
         "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is_batch_normalize"),
        ({"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": {
            "loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": "2.0_0.5"}}}, BYPASS,
         "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is_threshold"),
        ({"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": {"loss_type": "dpo"}}}, BYPASS,
         "actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type"),
        ({"loss_agg_mode": "token-median"}, None, "actor_rollout_ref.actor.loss_agg_mode"),
        ({"use_kl_loss": True, "kl_loss_type": "abs"}, None, "actor_rollout_ref.actor.kl_loss_type"),
        ({"use_kl_loss": True, "kl_loss_type": "low_var_kl+"}, None, "actor_rollout_ref.actor.kl_loss_type"),
        ({"clip_ratio_c": 1.0}, None, "actor_rollout_ref.actor.clip_ratio_c"),
        ({"clip_ratio_low": -0.1}, None, "actor_rollout_ref.actor.clip_ratio_low"),
        ({"entropy_coeff": -0.1}, None, "actor_rollout_ref.actor.entropy_coeff"),
        ({"ppo_epochs": 0}, None, "actor_rollout_ref.actor.ppo_epochs"),
        ({"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 0}, None,
         "actor_rollout_ref.actor.loss_scale_factor"),
    ],
)
def test_what_floe_cannot_honour_is_refused_by_its_verl_key(changes, algorithm, field):
    with pytest.raises(floe.InvalidInput) as info:
        verl_loss(actor(**changes), algorithm)
    assert info.value.field == field


# verl 0.9.1 defaults (PolicyLossConfig, ActorConfig) for each loss_mode, as floe's loss and keys.
LOSS_MODES = [
    ({"loss_mode": "dppo_tv"}, {}, "dppo", {"divergence": "binary_tv", "delta_low": 0.2, "delta_high": 0.2,
                                            "surrogate": "log_prob", "ratio_cap": 3.0}),
    ({"loss_mode": "dppo_kl"}, {"clip_ratio_low": 0.01, "clip_ratio_high": 0.02, "clip_ratio_c": 20.0}, "dppo",
     {"divergence": "binary_kl", "delta_low": 0.01, "delta_high": 0.02, "surrogate": "log_prob", "ratio_cap": 20.0}),
    ({"loss_mode": "gspo"}, {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}, "gspo",
     {"clip_low": 3e-4, "clip_high": 4e-4, "ratio_gradient": "token", "log_ratio_cap": 10.0}),
    ({"loss_mode": "sapo"}, {"tau_pos": 1.0, "tau_neg": 1.05}, "sapo",
     {"tau_pos": 1.0, "tau_neg": 1.05, "aggregation": "seq_mean_token_mean"}),
    ({"loss_mode": "sapo"}, {"loss_agg_mode": "seq-mean-token-mean", "use_kl_loss": True}, "sapo",
     {"tau_pos": 1.0, "tau_neg": 1.05, "aggregation": "seq_mean_token_mean"}),
    ({"loss_mode": "gpg"}, {"loss_agg_mode": "token-sum"}, "dro", {"beta": 0.0, "aggregation": "sum"}),
    ({"loss_mode": "clip_cov"}, {}, "clip_cov",
     {"clip_low": 0.2, "clip_high": 0.2, "clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0}),
    ({"loss_mode": "clip_cov", "clip_cov_ratio": 0.01, "clip_cov_lb": -1.0, "clip_cov_ub": 2.0}, {}, "clip_cov",
     {"clip_cov_ratio": 0.01, "clip_cov_lb": -1.0, "clip_cov_ub": 2.0}),
    ({"loss_mode": "kl_cov"}, {}, "kl_cov", {"kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1}),
    ({"loss_mode": "kl_cov", "kl_cov_ratio": 0.01, "ppo_kl_coef": None}, {}, "kl_cov", {"kl_cov_ratio": 0.01, "ppo_kl_coef": 1.0}),
    ({"loss_mode": "geo_mean"}, {"loss_agg_mode": "token-sum"}, "geo_mean",
     {"clip_low": 0.2, "clip_high": 0.2, "aggregation": "seq_mean_token_mean"}),
    ({"loss_mode": "dro", "dro_beta": 0.05}, {}, "dro", {"beta": 0.05}),
    ({"loss_mode": "cispo"}, {}, "cispo", {"clip_low": 0.2, "clip_high": 0.2}),
    ({"loss_mode": "vanilla"}, {}, "ppo", {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 3.0}),
    ({"loss_mode": "bypass_mode", "rollout_correction": {"loss_type": "ppo_clip", "rollout_is": "sequence"}}, {}, "ppo",
     {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 3.0}),
    ({"loss_mode": "bypass_mode", "rollout_correction": {"loss_type": "reinforce", "rollout_is": None}}, {}, "dro",
     {"beta": 0.0}),
    # bypass_mode with token TIS: floe's dro with beta 0 on A·m'·w, w from verl's own helper per mini-batch (bypass.py)
    ({"loss_mode": "bypass_mode", "rollout_correction": {"loss_type": "reinforce", "rollout_is": "token",
                                                         "rollout_is_threshold": 2.0}}, {}, "dro", {"beta": 0.0}),
]


@pytest.mark.parametrize(("policy_loss", "changes", "loss", "expect"), LOSS_MODES,
                         ids=[f"{p['loss_mode']}-{i}" for i, (p, *_) in enumerate(LOSS_MODES)])
def test_every_verl_loss_mode_maps_with_its_keys(make_client, policy_loss, changes, loss, expect):
    # loss_mode=bypass_mode needs verl's trainer bypass (old log-probs = the sampler's)
    algorithm = BYPASS if policy_loss["loss_mode"] == "bypass_mode" else None
    mapped = verl_loss(actor(policy_loss=policy_loss, **changes), algorithm)
    assert mapped.loss == loss
    assert {k: mapped.loss_config[k] for k in expect} == expect
    client = make_client()
    group = floe.Group([3, 4, 5], [floe.Sample([6, 7], logprobs=[-2.0, -2.1], advantage=[0.5, 0.5],
                                               ref_logprobs=[-2.2, -2.0], weights=[1.0, 1.0])])
    result = client.forward_backward([group], mapped.loss, mapped.loss_config)
    assert result.loss == loss and all(result.loss_config[k] == v for k, v in expect.items())


@pytest.mark.parametrize("mode", [p["loss_mode"] for p, *_ in LOSS_MODES if p["loss_mode"] != "bypass_mode"])
def test_trainer_bypass_keeps_the_loss_mode(mode):
    """algorithm.rollout_correction.bypass_mode=true in verl's V1 trainer (the plugin's) only sets
    old = rollout log-probs (trainer_base._compute_old_log_prob; no apply_bypass_mode): the loss_mode
    runs unchanged against the sampler's log-probs, with no trainer IS weights."""
    policy_loss = next(p for p, *_ in LOSS_MODES if p["loss_mode"] == mode)
    changes = next(c for p, c, *_ in LOSS_MODES if p["loss_mode"] == mode)
    plain = verl_loss(actor(policy_loss=policy_loss, **changes))
    mapped = verl_loss(actor(policy_loss=policy_loss, **changes), BYPASS)
    assert (mapped.loss, mapped.loss_config) == (plain.loss, plain.loss_config)
    assert mapped.bypass is None and not mapped.rollout_is_weights


def test_trainer_bypass_refusals_name_the_algorithm_block():
    """verl's V1 trainer skips the decoupled correction in bypass mode: rollout_rs / rollout_is /
    loss_type there would be ignored (verl reads them from policy_loss.rollout_correction, for
    loss_mode=bypass_mode), so they are refused by the algorithm key."""
    with pytest.raises(floe.InvalidInput) as info:
        verl_loss(actor(), {"rollout_correction": {"bypass_mode": True, "rollout_rs": "seq_mean_k1",
                                                   "rollout_rs_threshold": "0.999_1.001"}})
    assert info.value.field == "algorithm.rollout_correction.rollout_rs"
    with pytest.raises(floe.InvalidInput) as info:
        verl_loss(actor(), {"rollout_correction": {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "sequence"}})
    assert info.value.field == "algorithm.rollout_correction.loss_type"


# Decoupled rollout IS (verl's trainer writes rollout_is_weights; the plugin folds them into A) and
# rejection (zeros in response_mask, floe weights 0) on top of each loss_mode.
IS_EXACT = [p for p, *_ in LOSS_MODES if p["loss_mode"] in IS_FOLD_EXACT]
IS_REFUSED = [p for p, *_ in LOSS_MODES if p["loss_mode"] in IS_FOLD_REFUSED]


@pytest.mark.parametrize("policy_loss", IS_EXACT, ids=[p["loss_mode"] for p in IS_EXACT])
def test_rollout_is_folds_into_every_homogeneous_loss(policy_loss):
    changes = next(c for p, c, *_ in LOSS_MODES if p is policy_loss)
    plain = verl_loss(actor(policy_loss=policy_loss, **changes))
    mapped = verl_loss(actor(policy_loss=policy_loss, **changes),
                       {"rollout_correction": {"rollout_is": "token", "rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"}})
    assert mapped.rollout_is_weights and (mapped.loss, mapped.loss_config) == (plain.loss, plain.loss_config)


@pytest.mark.parametrize("policy_loss", IS_REFUSED, ids=[p["loss_mode"] for p in IS_REFUSED])
def test_rollout_is_with_a_non_homogeneous_loss_is_refused_rejection_is_not(policy_loss):
    changes = next(c for p, c, *_ in LOSS_MODES if p is policy_loss)
    with pytest.raises(floe.InvalidInput) as info:
        verl_loss(actor(policy_loss=policy_loss, **changes), {"rollout_correction": {"rollout_is": "sequence"}})
    assert info.value.field == "algorithm.rollout_correction.rollout_is"
    assert policy_loss["loss_mode"] in str(info.value)
    mapped = verl_loss(actor(policy_loss=policy_loss, **changes),
                       {"rollout_correction": {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"}})
    assert not mapped.rollout_is_weights  # rejection only: zero weights, exact for every loss_mode


def test_every_loss_mode_is_classified_for_rollout_is():
    assert set(IS_FOLD_EXACT) | set(IS_FOLD_REFUSED) | {"bypass_mode"} == set(MAPPED_MODES)
    assert not set(IS_FOLD_EXACT) & set(IS_FOLD_REFUSED)


def test_every_registered_verl_loss_mode_is_mapped():
    from floe.integrations.verl.loss_mapping import LOSS_MODES as MAPPED  # noqa: PLC0415
    assert {p["loss_mode"] for p, *_ in LOSS_MODES} == set(MAPPED)


RC = "algorithm.rollout_correction"
# verl 0.9.1's YAML block (trainer/config/algorithm/rollout_correction.yaml, as main_ppo resolves it)
VERL_RC_DEFAULTS = {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_rs": None, "rollout_rs_threshold": None,
                    "bypass_mode": False, "loss_type": "ppo_clip", "rollout_is_batch_normalize": False}


def test_rollout_correction_keys_are_verls():
    assert ROLLOUT_CORRECTION_DEFAULTS == VERL_RC_DEFAULTS


@pytest.mark.parametrize(("rc", "weights"), [
    ({}, False),
    (VERL_RC_DEFAULTS, False),  # metrics only: verl's trainer still logs rollout_corr/*
    ({"rollout_is": "token"}, True),  # decoupled_token_is
    ({"rollout_is": "sequence", "rollout_is_threshold": 5.0, "rollout_is_batch_normalize": True}, True),
    ({"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"}, True),  # decoupled_token_icepop
    ({"rollout_is": "sequence", "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0"}, True),  # seq_is_rs
    ({"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"}, False),  # decoupled_geo_rs
    ({"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01}, False),  # decoupled_k3_rs
    ({"rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": "0.5_2.0,0.3"}, False),
    ({"rollout_rs": "token_k2,seq_sum_k3", "rollout_rs_threshold": 0.2}, False),  # one threshold for both
    ({"bypass_mode": True}, False),  # bypass_ppo_clip: old log-probs = the sampler's
])
def test_rollout_correction_takes_effect(rc, weights):
    loss = verl_loss(actor(), {"rollout_correction": rc})
    assert loss.rollout_is_weights is weights
    assert loss.loss_config == verl_loss(actor()).loss_config  # the PPO loss itself is unchanged


@pytest.mark.parametrize(("rc", "key"), [
    ({"rollout_is": "tokens"}, "rollout_is"),
    ({"rollout_is": "token", "rollout_is_threshold": 0}, "rollout_is_threshold"),
    ({"rollout_is": "token", "rollout_is_threshold": "5.0_0.5"}, "rollout_is_threshold"),
    ({"rollout_is": "token", "rollout_is_threshold": "two"}, "rollout_is_threshold"),
    ({"rollout_is_threshold": 3.0}, "rollout_is_threshold"),  # no effect without rollout_is
    ({"rollout_is_batch_normalize": True}, "rollout_is_batch_normalize"),
    ({"rollout_rs": "seq"}, "rollout_rs"),
    ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": "0.5_2.0"}, "rollout_rs"),  # verl has no seq_max_k1
    ({"rollout_rs": "token_k1"}, "rollout_rs_threshold"),
    ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.1_0.3"}, "rollout_rs_threshold"),  # k2/k3: upper only
    ({"rollout_rs": "token_k1,token_k2,seq_sum_k3", "rollout_rs_threshold": "2.0,0.1"}, "rollout_rs_threshold"),
    ({"rollout_rs_threshold": 0.1}, "rollout_rs_threshold"),
    ({"loss_type": "reinforce", "bypass_mode": True}, "loss_type"),
    ({"loss_type": "dpo"}, "loss_type"),
    ({"bypass_mode": True, "rollout_is": "sequence"}, "rollout_is"),  # bypass_pg_is's weights: refused
    ({"bypass_mode": True, "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"}, "rollout_rs"),
    ({"bypass_mode": "yes"}, "bypass_mode"),
    ({"veto_threshold": 1e-4}, "veto_threshold"),
])
def test_rollout_correction_refusals_name_the_key(rc, key):
    with pytest.raises(floe.InvalidInput) as info:
        verl_loss(actor(), {"rollout_correction": rc})
    assert info.value.field == f"{RC}.{key}"


@pytest.mark.parametrize(("rc", "loss"), [
    (None, "ppo"),  # the dataclass defaults: ppo_clip (sequence IS weights for metrics only)
    ({"rollout_is": None, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01}, "ppo"),  # bypass_ppo_clip_k3_rs
    ({"loss_type": "reinforce"}, "dro"),  # bypass_pg_is: -A·logp·w
    ({"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": "0.5_5.0"}, "dro"),  # bypass_pg_token_icepop
    ({"loss_type": "reinforce", "rollout_is": None, "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"},
     "dro"),  # bypass_pg_geo_rs
])
def test_bypass_mode_loss_maps(rc, loss):
    policy_loss = {"loss_mode": "bypass_mode", **({} if rc is None else {"rollout_correction": rc})}
    mapped = verl_loss(actor(policy_loss=policy_loss, use_kl_loss=True, kl_loss_coef=0.1), BYPASS)
    assert mapped.loss == loss and mapped.bypass is not None and not mapped.rollout_is_weights
    assert mapped.bypass.rollout_is == ("sequence" if rc is None else rc.get("rollout_is", "sequence"))
    if loss == "dro":  # no ratio, no clip: the policy's own log-prob times A·w
        assert mapped.loss_config == {"aggregation": "token_mean", "kl": {"coef": 0.1, "estimator": "k3", "aggregation":
                                      "token_mean"}, "entropy": {"coef": 0.0, "aggregation": "token_mean"}, "beta": 0.0}
    floe.compute.losses.resolve_loss(mapped.loss, mapped.loss_config)


@pytest.mark.parametrize(("policy_loss", "algorithm", "field"), [
    ({"loss_mode": "bypass_mode"}, None, "actor_rollout_ref.actor.policy_loss.loss_mode"),  # needs the trainer's bypass
    ({"loss_mode": "vanilla", "rollout_correction": {"rollout_is": "token"}}, BYPASS,
     "actor_rollout_ref.actor.policy_loss.rollout_correction"),
    ({"loss_mode": "bypass_mode", "rollout_correction": {"loss_type": "reinforce", "rollout_is_batch_normalize": True}},
     BYPASS, "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is_batch_normalize"),
    ({"loss_mode": "bypass_mode", "rollout_correction": {"loss_type": "a2c"}}, BYPASS,
     "actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type"),
    ({"loss_mode": "bypass_mode", "rollout_correction": {"rollout_rs": "token_k9", "rollout_rs_threshold": 1.0}}, BYPASS,
     "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_rs"),
])
def test_bypass_mode_refusals_name_the_key(policy_loss, algorithm, field):
    with pytest.raises(floe.InvalidInput) as info:
        verl_loss(actor(policy_loss=policy_loss), algorithm)
    assert info.value.field == field


def test_weighted_advantages_scale_each_token():
    assert weighted_advantages([[1.0, -2.0], [0.5]], [[2.0, 0.0], [1.5]]) == [[2.0, -0.0], [0.75]]
    for bad in ([[1.0]], [[1.0, 1.0], [-1.0]]):
        with pytest.raises(floe.InvalidInput):
            weighted_advantages([[1.0, -2.0], [0.5]], bad)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
def test_mapped_configs_run_on_a_real_backend(make_client, mode):
    client = make_client()
    loss = verl_loss(actor(loss_agg_mode=mode, use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01))
    group = floe.Group([3, 4, 5], [floe.Sample([6, 7], logprobs=[-2.0, -2.1], advantage=[0.5, 0.5],
                                               ref_logprobs=[-2.2, -2.0], weights=[1.0, 1.0])])
    result = client.forward_backward([group], loss.loss, loss.loss_config)
    assert result.loss == "ppo" and result.loss_config["aggregation"] == loss.loss_config["aggregation"]
    assert result.loss_config["kl"] == loss.loss_config["kl"] and result.metrics["tokens"] == 2


def test_floe_block_defaults_to_an_own_backend_on_the_recipe_model():
    cfg = {"trainer": {"device": "cpu"}, "actor_rollout_ref": {"model": {"path": "/models/tiny"}, "actor": VERL_ACTOR_DEFAULTS}}
    target = floe_target(cfg)
    assert target.url is None and target.token is None
    assert target.backend is not None and target.backend["model"] == "/models/tiny"
    assert target.backend["optimizer"] == {
        "lr": 1e-6, "weight_decay": 0.01, "grad_clip": 1.0, "betas": (0.9, 0.999), "schedule": "constant"}
    assert target.backend["device"] == "cpu"  # the rest of the recipe's hardware: tests/integrations/test_verl_hardware.py
    floe.BackendConfig.model_validate(target.backend)  # a valid floe config
    cfg["floe"] = {"backend": {"num_threads": 1, "optimizer": {"lr": 0.5}, "compute": {"logprob_chunk_tokens": 64}}}
    target = floe_target(cfg)
    assert target.backend["num_threads"] == 1 and target.backend["optimizer"]["lr"] == 0.5
    assert target.backend["optimizer"]["weight_decay"] == 0.01  # floe.backend merges into what the recipe mapped
    assert target.backend["compute"] == {"gradient_checkpointing": True, "logprob_chunk_tokens": 64}


def test_floe_block_with_a_url():
    target = floe_target({"floe": {"url": "http://127.0.0.1:7000/", "token": "t", "timeout_s": 30},
                          "trainer": {"device": "cpu"}})
    assert (target.url, target.token, target.timeout_s, target.backend) == ("http://127.0.0.1:7000", "t", 30.0, None)


@pytest.mark.parametrize(
    ("cfg", "field"),
    [
        ({"floe": {"urll": "http://x:1"}}, "floe.urll"),
        ({"floe": {"url": "127.0.0.1:7000"}}, "floe.url"),
        ({"floe": {"url": "http://x:1", "backend": {"seed": 1}}}, "floe.backend"),
        ({"floe": {"token": "t"}, "actor_rollout_ref": {"model": {"path": "m"}}}, "floe.token"),
        ({"floe": {"timeout_s": 0}}, "floe.timeout_s"),
        ({"actor_rollout_ref": {"model": {}}}, "actor_rollout_ref.model.path"),
        ({"actor_rollout_ref": {"model": {"path": "m"}, "actor": {"optim": {"optimizer": "SGD"}}}},
         "actor_rollout_ref.actor.optim.optimizer"),
        ({"actor_rollout_ref": {"model": {"path": "m"}, "actor": {"optim": {"lr_scheduler_type": "linear"}}}},
         "actor_rollout_ref.actor.optim.lr_scheduler_type"),
        ({"actor_rollout_ref": {"model": {"path": "m"}, "actor": {"optim": {"warmup_style": "wsd"}}}},
         "actor_rollout_ref.actor.optim.warmup_style"),
        ({"actor_rollout_ref": {"model": {"path": "m"}, "actor": {"optim": {"min_lr_ratio": 1.5}}}},
         "actor_rollout_ref.actor.optim.min_lr_ratio"),
        ({"actor_rollout_ref": {"model": {"path": "m"}, "actor": {"optim": {"lr_warmup_steps_ratio": -0.1}}}},
         "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio"),
        ({"actor_rollout_ref": {"model": {"path": "m"}, "actor": {"optim": {"num_cycles": True}}}},
         "actor_rollout_ref.actor.optim.num_cycles"),
    ],
)
def test_bad_floe_blocks_and_unmappable_optimizers_are_refused(cfg, field):
    with pytest.raises(floe.InvalidInput) as info:
        floe_target(cfg)
    assert info.value.field == field


def test_sampling_params_follow_verls_vllm_server():
    params = floe_sampling_params({"temperature": 0.7, "top_p": 0.9, "top_k": -1, "repetition_penalty": 1.0,
                                   "logprobs": True}, prompt_len=20, response_length=16, prompt_length=192)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.stop_at_eos) == (16, 0.7, 0.9, 0, True)
    greedy = floe_sampling_params({"temperature": 0, "top_k": 5, "max_tokens": 4, "ignore_eos": True}, 20, 16, 192)
    assert (greedy.max_tokens, greedy.temperature, greedy.top_k, greedy.stop_at_eos) == (4, 0.0, 5, False)
    # The remaining context bounds the new tokens.
    assert floe_sampling_params({}, prompt_len=200, response_length=16, prompt_length=192).max_tokens == 8
    for bad, field in (({"repetition_penalty": 1.1}, "sampling_params.repetition_penalty"),
                       ({"min_p": 0.1}, "sampling_params.min_p")):
        with pytest.raises(floe.InvalidInput) as info:
            floe_sampling_params(bad, 20, 16, 192)
        assert info.value.field == field
    with pytest.raises(floe.InvalidInput) as info:
        floe_sampling_params({}, prompt_len=208, response_length=16, prompt_length=192)
    assert info.value.field == "prompt_ids"


def test_server_config_is_valid_toml():
    import tomllib

    table = {"backend": {"model": 'a "quoted" path', "num_threads": 1, "optimizer": {"betas": (0.9, 0.99), "lr": 1e-3},
                         "tokenizer": None, "reference": {"enabled": True}}}
    assert tomllib.loads(to_toml(table)) == {"backend": {"model": 'a "quoted" path', "num_threads": 1,
                                                         "optimizer": {"betas": [0.9, 0.99], "lr": 1e-3},
                                                         "reference": {"enabled": True}}}


def test_a_none_in_the_plugins_server_config_reaches_the_server(tiny_model, tmp_path):
    """TOML has no null: `+floe.backend.optimizer.grad_clip=null` (no clipping) left out of the
    server's TOML would become the default clip of 1.0. It goes on the command line instead."""
    target = floe_target({"trainer": {"device": "cpu"}, "actor_rollout_ref": {"model": {"path": str(tiny_model)},
                                                                             "rollout": {"name": "floe"}},
                          "floe": {"backend": {"optimizer": {"grad_clip": None}, "state_dir": str(tmp_path / "s")}}})
    assert target.backend["optimizer"]["grad_clip"] is None
    assert null_overrides({"backend": target.backend}) == ["--backend.optimizer.grad_clip", "null"]
    server = LocalServer(target.backend)
    try:
        assert floe.connect(server.url, token=server.token).info().capabilities["optimizer"]["grad_clip"] is None
    finally:
        server.stop()


def test_an_unknown_floe_backend_key_is_named_in_full():
    with pytest.raises(floe.InvalidInput) as info:
        floe_target({"actor_rollout_ref": {"model": {"path": "m"}}, "floe": {"backend": {"compute": {"bogus": 1}}}})
    assert info.value.field == "floe.backend.compute.bogus"


def test_warm_up_and_cosine_keys_are_accepted_and_leave_the_schedule_to_verls_scheduler():
    optim = {**VERL_ACTOR_DEFAULTS["optim"], "lr_scheduler_type": "cosine", "lr_warmup_steps": 10, "min_lr_ratio": 0.1,
             "num_cycles": 0.5, "zero_indexed_step": False}
    target = floe_target({"actor_rollout_ref": {"model": {"path": "m"}, "actor": {"optim": optim}}})
    # the plugin passes verl's rate with every optim_step (schedule.py); floe's own schedule stays flat
    assert target.backend["optimizer"]["schedule"] == "constant"
    floe.OptimizerConfig(**target.backend["optimizer"])


def _optim(**keys):
    optim = {**VERL_ACTOR_DEFAULTS["optim"], **keys}
    return floe_target({"actor_rollout_ref": {"model": {"path": "m"}, "actor": {"optim": optim}}}).backend["optimizer"]


def test_every_adamw_setting_verls_build_optimizer_applies_reaches_floes_optimizer():
    # verl's build_optimizer: AdamW(lr, weight_decay, betas) updated by override_optimizer_config
    out = _optim(override_optimizer_config={"eps": 1e-5, "betas": [0.8, 0.95], "lr": 3e-6, "foreach": True})
    assert (out["eps"], out["betas"], out["lr"], out["weight_decay"]) == (1e-5, (0.8, 0.95), 3e-6, 0.01)
    floe.OptimizerConfig(**out)
    # the deprecated grad_clip, which FSDPOptimizerConfig.__post_init__ copies over clip_grad
    assert _optim(grad_clip=0.5)["grad_clip"] == 0.5 and _optim()["grad_clip"] == 1.0


@pytest.mark.parametrize(("keys", "field"), [
    ({"override_optimizer_config": {"amsgrad": True}}, "override_optimizer_config.amsgrad"),
    ({"override_optimizer_config": {"momentum": 0.9}}, "override_optimizer_config.momentum"),
    ({"override_optimizer_config": {"eps": 0}}, "override_optimizer_config.eps"),
    ({"optimizer_impl": "torchao.optim"}, "optimizer_impl"),
    ({"clip_grad": 0}, "clip_grad"),
    ({"grad_clip": -1.0}, "grad_clip"),
])
def test_optimizer_settings_floe_cannot_honour_are_refused_by_their_verl_key(keys, field):
    with pytest.raises(floe.InvalidInput) as info:
        _optim(**keys)
    assert info.value.field == f"actor_rollout_ref.actor.optim.{field}"
