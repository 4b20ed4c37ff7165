"""floe.integrations.verl's pure mappings (no verl import; core suite): verl's actor loss
config -> floe's loss, the `floe` block and optimizer -> the backend, verl's sampling params
-> floe.SamplingParams. Every key floe cannot honour is refused by its verl name; the mapped
loss configs are accepted by a real floe backend."""

from __future__ import annotations

import pytest

import floe
import floe.compute.losses
from floe.integrations.verl.backend_config import floe_target
from floe.integrations.verl.local_server import to_toml
from floe.integrations.verl.loss_mapping import ROLLOUT_CORRECTION_DEFAULTS, verl_loss, weighted_advantages
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
                                "kl": {"coef": 0.0, "estimator": "k3"}, "entropy": {"coef": 0.0}}
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


@pytest.mark.parametrize(("verl_type", "estimator"), [("kl", "k1"), ("k1", "k1"), ("mse", "k2"), ("k2", "k2"),
                                                     ("low_var_kl", "k3"), ("k3", "k3")])
def test_kl_loss_maps_coefficient_and_estimator(verl_type, estimator):
    loss = verl_loss(actor(use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type=verl_type))
    assert loss.loss_config["kl"] == {"coef": 0.05, "estimator": estimator} and loss.needs_ref_logprobs


def test_clips_entropy_and_the_clip_ratio_fallback():
    cfg = verl_loss(actor(clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=5.0, entropy_coeff=0.01)).loss_config
    assert (cfg["clip_low"], cfg["clip_high"], cfg["dual_clip"], cfg["entropy"]) == (0.1, 0.28, 5.0, {"coef": 0.01})
    cfg = verl_loss(actor(clip_ratio=0.3, clip_ratio_low=None, clip_ratio_high=None)).loss_config
    assert (cfg["clip_low"], cfg["clip_high"]) == (0.3, 0.3)


@pytest.mark.parametrize(
    ("changes", "algorithm", "field"),
    [
        ({"policy_loss": {"loss_mode": "gspo"}}, None, "actor_rollout_ref.actor.policy_loss.loss_mode"),
        ({"loss_agg_mode": "token-median"}, None, "actor_rollout_ref.actor.loss_agg_mode"),
        ({"use_kl_loss": True, "kl_loss_type": "abs"}, None, "actor_rollout_ref.actor.kl_loss_type"),
        ({"use_kl_loss": True, "kl_loss_type": "low_var_kl+"}, None, "actor_rollout_ref.actor.kl_loss_type"),
        ({"clip_ratio_c": 1.0}, None, "actor_rollout_ref.actor.clip_ratio_c"),
        ({"clip_ratio_low": 1.5}, None, "actor_rollout_ref.actor.clip_ratio_low"),
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


BYPASS = {"rollout_correction": {"bypass_mode": True}}


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
        assert mapped.loss_config == {"aggregation": "token_mean", "kl": {"coef": 0.1, "estimator": "k3"},
                                      "entropy": {"coef": 0.0}, "beta": 0.0}
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
    cfg = {"actor_rollout_ref": {"model": {"path": "/models/tiny"}, "actor": VERL_ACTOR_DEFAULTS}}
    target = floe_target(cfg)
    assert target.url is None and target.token is None
    assert target.backend == {"model": "/models/tiny", "optimizer": {
        "lr": 1e-6, "weight_decay": 0.01, "grad_clip": 1.0, "betas": (0.9, 0.999), "schedule": "constant"}}
    floe.BackendConfig.model_validate(target.backend)  # a valid floe config
    cfg["floe"] = {"backend": {"num_threads": 1, "optimizer": {"lr": 0.5}}}
    target = floe_target(cfg)
    assert target.backend["num_threads"] == 1 and target.backend["optimizer"]["lr"] == 0.5


def test_floe_block_with_a_url():
    target = floe_target({"floe": {"url": "http://127.0.0.1:7000/", "token": "t", "timeout_s": 30}})
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


def test_warm_up_and_cosine_keys_are_accepted_and_leave_the_schedule_to_verls_scheduler():
    optim = {**VERL_ACTOR_DEFAULTS["optim"], "lr_scheduler_type": "cosine", "lr_warmup_steps": 10, "min_lr_ratio": 0.1,
             "num_cycles": 0.5, "zero_indexed_step": False}
    target = floe_target({"actor_rollout_ref": {"model": {"path": "m"}, "actor": {"optim": optim}}})
    # the plugin passes verl's rate with every optim_step (schedule.py); floe's own schedule stays flat
    assert target.backend["optimizer"]["schedule"] == "constant"
    floe.OptimizerConfig(**target.backend["optimizer"])
