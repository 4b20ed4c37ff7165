"""SkyRL config -> floe mapping (floe.integrations.skyrl.mapping): core suite, no SkyRL import.

Each honoured key maps to the floe value it means; each key floe cannot honour is refused with
an InvalidInput naming the SkyRL key. The weighting test checks the algebra the plugin relies
on: floe's loss with the plugin's weights and advantages equals SkyRL 0.4.0's loss (policy
term on pre-scaled advantages, KL per-sequence token mean, entropy per micro-batch token mean,
transcribed from skyrl.backends.skyrl_train.workers.worker) in value and gradient, for every
loss reduction SkyRL applies to the advantages. The same check against SkyRL's own functions
runs in the SkyRL environment (test_loss_equivalence.py).
"""

from __future__ import annotations

import math

import pytest
import torch

import floe
from floe.compute.losses import TokenInputs, compute_loss, resolve_loss, term_scales
from floe.errors import InvalidInput
from floe.integrations.skyrl.mapping import (
    OFF_POLICY_LOSSES,
    floe_advantages,
    lr_scheduler,
    map_loss,
    map_optimizer,
    map_sampling,
    token_weights,
)

ALGO = {"policy_loss_type": "regular", "eps_clip_low": 0.2, "eps_clip_high": 0.28, "use_kl_loss": True,
        "kl_loss_coef": 0.001, "kl_estimator_type": "k3", "temperature": 1.0, "advantage_estimator": "grpo",
        "loss_reduction": "token_mean"}


def test_default_grpo_recipe_maps_to_ppo_with_kl() -> None:
    m = map_loss(ALGO)
    assert m.loss == "ppo" and m.weighting == "mask" and m.temperature == 1.0
    assert m.loss_config == {"aggregation": "sum", "clip_low": 0.2, "clip_high": 0.28,
                             "kl": {"coef": 0.001, "estimator": "k3", "aggregation": "seq_mean_token_mean"}}
    resolve_loss(m.loss, m.loss_config)  # floe accepts it as is


@pytest.mark.parametrize(("extra", "loss", "expect"), [
    ({"policy_loss_type": "dual_clip", "clip_ratio_c": 3.0}, "ppo", {"dual_clip": 3.0}),
    ({"policy_loss_type": "gspo"}, "gspo", {"clip_low": 0.2, "clip_high": 0.28, "ratio_gradient": "token",
                                            "log_ratio_cap": 10.0}),
    # GSPO-token takes per-token advantages: any estimator
    ({"policy_loss_type": "gspo", "advantage_estimator": "reinforce++", "gamma": 0.9}, "gspo", {"ratio_gradient": "token"}),
    ({"policy_loss_type": "sapo"}, "sapo", {"tau_pos": 1.0, "tau_neg": 1.05}),
    ({"policy_loss_type": "sapo", "sapo": {"tau_pos": 2.0, "tau_neg": 3.0}}, "sapo", {"tau_pos": 2.0, "tau_neg": 3.0}),
    ({"policy_loss_type": "dppo"}, "dppo", {"divergence": "binary_tv", "delta_low": 0.2, "delta_high": 0.2,
                                            "surrogate": "ratio"}),
    ({"policy_loss_type": "dppo", "dppo": {"dppo_type": "binary_kl", "delta_low": 0.01, "delta_high": 0.02}}, "dppo",
     {"divergence": "binary_kl", "delta_low": 0.01, "delta_high": 0.02}),
    ({"policy_loss_type": "rollout_is"}, "cispo", {"clip_low": 0.2, "clip_high": 0.28, "out_of_range": "zero"}),
    ({"policy_loss_type": "cispo", "cispo": {"cispo_anchor": "rollout"}}, "cispo", {"clip_low": 1.0, "clip_high": 4.0}),
    ({"policy_loss_type": "clip_cov", "use_kl_loss": False}, "clip_cov",
     {"clip_low": 0.2, "clip_high": 0.28, "clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0}),
    ({"policy_loss_type": "clip_cov", "use_kl_loss": False, "clip_cov": {"clip_ratio": 3.0, "clip_cov_lb": -1.0,
                                                                          "clip_cov_ub": 2.0}}, "clip_cov",
     {"clip_cov_ratio": 1.0, "clip_cov_lb": -1.0, "clip_cov_ub": 2.0}),
    ({"policy_loss_type": "kl_cov", "use_kl_loss": False}, "kl_cov", {"kl_cov_ratio": 0.2, "ppo_kl_coef": 1.0}),
    ({"policy_loss_type": "kl_cov", "use_kl_loss": False, "kl_cov": {"kl_cov_frac": 0.05, "ppo_kl_coef": 0.3}}, "kl_cov",
     {"kl_cov_ratio": 0.05, "ppo_kl_coef": 0.3}),
    ({"policy_loss_type": "cispo", "cispo": {"cispo_eps_clip_low": 1.0, "cispo_eps_clip_high": 4.0, "cispo_anchor": "old"}},
     "cispo", {"clip_low": 1.0, "clip_high": 4.0}),
    ({"policy_loss_type": "importance_sampling"}, "importance_sampling", {}),
    ({"use_kl_loss": False, "use_entropy_loss": True, "entropy_loss_coef": 0.02}, "ppo", {"entropy": {"coef": 0.02}}),
    ({"kl_estimator_type": "k1", "kl_loss_coef": 0.5}, "ppo",
     {"kl": {"coef": 0.5, "estimator": "k1", "aggregation": "seq_mean_token_mean"}}),
    # KL and entropy together: the KL by its own aggregation, the entropy in the weights
    ({"use_entropy_loss": True, "entropy_loss_coef": 0.02}, "ppo",
     {"entropy": {"coef": 0.02}, "kl": {"coef": 0.001, "estimator": "k3", "aggregation": "seq_mean_token_mean"}}),
    # clip_cov / kl_cov with SkyRL's KL loss (its recipes): plain mask weights, the KL's own aggregation
    ({"policy_loss_type": "clip_cov"}, "clip_cov",
     {"clip_cov_ratio": 0.0002, "kl": {"coef": 0.001, "estimator": "k3", "aggregation": "seq_mean_token_mean"}}),
    ({"policy_loss_type": "kl_cov", "kl_loss_coef": 0.01}, "kl_cov",
     {"kl_cov_ratio": 0.2, "kl": {"coef": 0.01, "estimator": "k3", "aggregation": "seq_mean_token_mean"}}),
])
def test_each_loss_key_maps(extra: dict, loss: str, expect: dict) -> None:
    m = map_loss({**ALGO, **extra})
    assert m.loss == loss
    assert m.weighting == ("entropy" if extra.get("use_entropy_loss") else "mask")
    for key, value in expect.items():
        assert m.loss_config[key] == value
    resolve_loss(m.loss, m.loss_config)


@pytest.mark.parametrize(("kind", "extra", "behaviour"), [
    ("regular", {}, "old"), ("cispo", {}, "old"), ("cispo", {"cispo": {"cispo_anchor": "rollout"}}, "rollout"),
    ("rollout_is", {}, "rollout"), ("dppo", {}, "rollout_or_old"), ("sapo", {}, "old"),
])
def test_losses_read_the_log_probs_skyrl_reads(kind: str, extra: dict, behaviour: str) -> None:
    """rollout_is and cispo with the rollout anchor take their ratio against the rollout
    log-probs, dppo against them when the batch has them (SkyRL's dppo_policy_loss)."""
    assert map_loss({**ALGO, "policy_loss_type": kind, **extra}).behaviour == behaviour


def test_every_skyrl_policy_loss_type_is_mapped() -> None:
    from floe.integrations.skyrl.mapping import POLICY_LOSSES  # noqa: PLC0415
    assert set(POLICY_LOSSES) == {"regular", "dual_clip", "gspo", "cispo", "rollout_is", "clip_cov", "kl_cov", "sapo",
                                  "cross_entropy", "importance_sampling", "dppo"}  # SkyRL 0.4.0's PolicyLossType


def test_cross_entropy_is_a_plain_masked_sum() -> None:
    m = map_loss({**ALGO, "policy_loss_type": "cross_entropy"})
    assert (m.loss, m.loss_config, m.weighting) == ("cross_entropy", {"aggregation": "sum"}, "mask")


@pytest.mark.parametrize(("extra", "field"), [
    ({"surprise": 1}, "trainer.algorithm.surprise"),
    ({"policy_loss_type": "custom"}, "trainer.algorithm.policy_loss_type"),
    ({"policy_loss_type": "sapo", "sapo": {"tau_neg": 0.0}}, "trainer.algorithm.sapo.tau_neg"),
    ({"policy_loss_type": "dppo", "dppo": {"dppo_type": "topk_tv"}}, "trainer.algorithm.dppo.dppo_type"),
    ({"policy_loss_type": "dppo", "dppo": {"delta_low": -0.1}}, "trainer.algorithm.dppo.delta_low"),
    ({"policy_loss_type": "clip_cov", "use_entropy_loss": True}, "trainer.algorithm.use_entropy_loss"),
    ({"policy_loss_type": "kl_cov", "use_kl_loss": False, "use_entropy_loss": True}, "trainer.algorithm.use_entropy_loss"),
    ({"policy_loss_type": "clip_cov", "use_kl_loss": False, "clip_cov": {"clip_ratio": 0.0}},
     "trainer.algorithm.clip_cov.clip_ratio"),
    ({"policy_loss_type": "kl_cov", "use_kl_loss": False, "kl_cov": {"kl_cov_frac": 0.0}}, "trainer.algorithm.kl_cov.kl_cov_frac"),
    ({"kl_estimator_type": "abs"}, "trainer.algorithm.kl_estimator_type"),
    ({"enable_sample_support_replay": True}, "trainer.algorithm.enable_sample_support_replay"),
    ({"policy_loss_type": "cispo", "cispo": {"cispo_anchor": "sampler"}}, "trainer.algorithm.cispo.cispo_anchor"),
    ({"advantage_estimator": "gae"}, "trainer.algorithm.advantage_estimator"),
    ({"temperature": None}, "trainer.algorithm.temperature"),
    ({"policy_loss_type": "dual_clip", "clip_ratio_c": 1.0}, "trainer.algorithm.clip_ratio_c"),
    ({"eps_clip_low": 1.5}, "trainer.algorithm.eps_clip_low"),
    ({"kl_loss_coef": -1.0}, "trainer.algorithm.kl_loss_coef"),
])
def test_what_floe_cannot_honour_is_refused_by_name(extra: dict, field: str) -> None:
    with pytest.raises(InvalidInput) as err:
        map_loss({**ALGO, **extra})
    assert err.value.field == field


OPC_OFF = {"tis_ratio_type": None, "token_tis_ratio_clip_high": 2.0, "sequence_tis_ratio_clip_high": 5.0,
           "sequence_mask_metric": None, "geo_mask_high": 1.01, "geo_mask_low": 0.99, "product_mask_high": 2.0,
           "product_mask_low": 0.5, "outlier_token_is_threshold_low": None, "outlier_token_is_threshold_high": None,
           "token_mask_is_threshold_low": None, "token_mask_is_threshold_high": None}  # SkyRL 0.4.0's defaults


@pytest.mark.parametrize(("extra", "expect"), [
    ({}, None),
    ({"off_policy_correction": OPC_OFF}, None),  # SkyRL's full default block: off
    ({"off_policy_correction": {"tis_ratio_type": "token", "token_tis_ratio_clip_high": 3.0}},
     {"tis_ratio_type": "token", "token_tis_ratio_clip_high": 3.0}),
    ({"off_policy_correction": {"tis_ratio_type": "sequence", "sequence_mask_metric": "geometric", "geo_mask_low": 0.9}},
     {"tis_ratio_type": "sequence", "sequence_mask_metric": "geometric", "geo_mask_low": 0.9}),
    ({"off_policy_correction": {"sequence_mask_metric": "product", "product_mask_high": 3.0}},
     {"sequence_mask_metric": "product", "product_mask_high": 3.0}),
    ({"off_policy_correction": {"outlier_token_is_threshold_high": 100.0}}, {"outlier_token_is_threshold_high": 100.0}),
    ({"off_policy_correction": {"token_mask_is_threshold_low": 0.5, "token_mask_is_threshold_high": 2.0}},
     {"token_mask_is_threshold_low": 0.5, "token_mask_is_threshold_high": 2.0}),
    # deprecated: as SkyRL's validate_cfg rewrites it (and idempotent after it did)
    ({"use_tis": True, "tis_imp_ratio_cap": 2.5}, {"tis_ratio_type": "token", "token_tis_ratio_clip_high": 2.5}),
    ({"use_tis": True, "tis_imp_ratio_cap": 2.5, "off_policy_correction": {"tis_ratio_type": "token", "token_tis_ratio_clip_high": 2.5}},
     {"tis_ratio_type": "token", "token_tis_ratio_clip_high": 2.5}),
])
def test_off_policy_correction_maps_to_skyrl_config_in_effect(extra: dict, expect: dict | None) -> None:
    for kind in OFF_POLICY_LOSSES:
        m = map_loss({**ALGO, "policy_loss_type": kind, **extra})
        assert m.off_policy == (None if expect is None else {**OPC_OFF, **expect})


@pytest.mark.parametrize(("extra", "field"), [
    ({"surprise": 1}, "off_policy_correction.surprise"),
    ({"tis_ratio_type": "tokens"}, "off_policy_correction.tis_ratio_type"),
    ({"sequence_mask_metric": "arithmetic"}, "off_policy_correction.sequence_mask_metric"),
    ({"token_tis_ratio_clip_high": 3.0}, "off_policy_correction.token_tis_ratio_clip_high"),  # TIS off: no effect
    ({"tis_ratio_type": "token", "sequence_tis_ratio_clip_high": 3.0}, "off_policy_correction.sequence_tis_ratio_clip_high"),
    ({"geo_mask_high": 1.1}, "off_policy_correction.geo_mask_high"),
    ({"sequence_mask_metric": "geometric", "product_mask_low": 0.1}, "off_policy_correction.product_mask_low"),
    ({"tis_ratio_type": "token", "token_tis_ratio_clip_high": 0.0}, "off_policy_correction.token_tis_ratio_clip_high"),
    ({"sequence_mask_metric": "product", "product_mask_low": 3.0}, "off_policy_correction.product_mask_low"),  # > high
    ({"token_mask_is_threshold_low": 0.5}, "off_policy_correction.token_mask_is_threshold_high"),  # SkyRL needs both
    ({"outlier_token_is_threshold_low": -1.0}, "off_policy_correction.outlier_token_is_threshold_low"),
])
def test_off_policy_correction_refusals_name_the_key(extra: dict, field: str) -> None:
    with pytest.raises(InvalidInput) as err:
        map_loss({**ALGO, "off_policy_correction": extra})
    assert err.value.field == f"trainer.algorithm.{field}"


@pytest.mark.parametrize(("extra", "field"), [
    ({"use_tis": True}, "tis_imp_ratio_cap"),  # the -1 default cap would make every weight -1
    ({"tis_imp_ratio_cap": 2.0}, "tis_imp_ratio_cap"),  # no effect without use_tis
    ({"use_tis": True, "tis_imp_ratio_cap": 2.0, "off_policy_correction": {"tis_ratio_type": "sequence"}}, "use_tis"),
    ({"policy_loss_type": "importance_sampling", "off_policy_correction": {"tis_ratio_type": "token"}}, "off_policy_correction"),
    ({"policy_loss_type": "cross_entropy", "use_tis": True, "tis_imp_ratio_cap": 2.0}, "off_policy_correction"),
    # SkyRL's clip_cov / kl_cov never call apply_off_policy_correction: it would be ignored
    ({"policy_loss_type": "clip_cov", "use_kl_loss": False, "off_policy_correction": {"tis_ratio_type": "token"}},
     "off_policy_correction"),
    ({"policy_loss_type": "kl_cov", "use_kl_loss": False, "off_policy_correction": {"sequence_mask_metric": "geometric"}},
     "off_policy_correction"),
    # cispo's rollout anchor already is the correction: TIS on top double-counts (SkyRL raises); masks alone pass
    ({"policy_loss_type": "cispo", "cispo": {"cispo_anchor": "rollout"}, "off_policy_correction": {"tis_ratio_type": "token"}},
     "off_policy_correction.tis_ratio_type"),
])
def test_deprecated_tis_and_losses_that_ignore_the_correction_are_refused(extra: dict, field: str) -> None:
    with pytest.raises(InvalidInput) as err:
        map_loss({**ALGO, **extra})
    assert err.value.field == f"trainer.algorithm.{field}"


def test_corrected_advantages_reproduce_skyrl_corrected_policy_loss() -> None:
    """SkyRL's ``loss * tis_ratio`` summed over the corrected mask (apply_off_policy_correction +
    reduce_loss, transcribed) equals floe's dual-clip ppo with A·ρ̄·keep, value and gradient."""
    from floe.integrations.skyrl.mapping import corrected_advantages  # noqa: PLC0415

    g = torch.Generator().manual_seed(3)
    rows, width = 5, 6
    mask = torch.ones(rows, width, dtype=torch.float64)
    mask[1, :2] = 0.0
    logp0 = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    old = logp0 + (torch.rand(rows, width, generator=g, dtype=torch.float64) - 0.5) * 0.8
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, width) / 30
    tis = torch.rand(rows, width, generator=g, dtype=torch.float64) * 2  # a token-level ratio, truncated at 2
    corrected = mask.clone()
    corrected[3] = 0.0  # a rejected sequence
    corrected[0, 4] = 0.0  # a rejected token
    logp_a = logp0.clone().requires_grad_()
    ratio = torch.exp(logp_a - old)
    pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    pg = torch.where(adv < 0, torch.minimum(pg, -3.0 * adv), pg)
    expected = (pg * tis * corrected).sum()
    expected.backward()

    m = map_loss({**ALGO, "policy_loss_type": "dual_clip", "clip_ratio_c": 3.0, "use_kl_loss": False,
                  "off_policy_correction": {"tis_ratio_type": "token"}})
    a = floe_advantages(corrected_advantages(adv, tis, mask, corrected), mask, token_weights(mask, m.weighting))
    logp_b = logp0.clone().requires_grad_()
    n = rows * width
    x = TokenInputs(logp=logp_b.reshape(-1), weights=mask.reshape(-1), scale=torch.ones(n, dtype=torch.float64),
                    sample_index=torch.arange(rows).repeat_interleave(width), num_samples=rows,
                    old_logp=old.reshape(-1), advantages=a.reshape(-1))
    got, _ = compute_loss(resolve_loss(m.loss, m.loss_config), x)
    got.backward()
    assert math.isclose(float(got.detach()), float(expected.detach()), rel_tol=1e-9, abs_tol=1e-12)
    assert torch.allclose(logp_b.grad, logp_a.grad, atol=1e-12)
    assert float(logp_b.grad[3].abs().max()) == 0.0 and float(logp_b.grad[0, 4]) == 0.0  # rejected: no policy term


def test_refusals_outside_the_algorithm_block() -> None:
    with pytest.raises(InvalidInput) as err:
        map_loss(ALGO, has_critic=True)
    assert err.value.field == "trainer.critic.model.path"
    with pytest.raises(InvalidInput) as err:
        map_loss({**ALGO, "use_kl_loss": False, "use_entropy_loss": True}, max_tokens_per_microbatch=4096)
    assert err.value.field == "trainer.max_tokens_per_microbatch"


def test_optimizer_mapping() -> None:
    skyrl_default = {"lr": 1e-6, "adam_betas": [0.9, 0.999], "weight_decay": 0.01, "max_grad_norm": 1.0,
                     "offload_after_step": True, "num_warmup_steps": 0, "scheduler": "constant_with_warmup"}
    out = map_optimizer(skyrl_default)
    assert out == {"lr": 1e-6, "betas": (0.9, 0.999), "weight_decay": 0.01, "grad_clip": 1.0, "schedule": "constant"}
    floe.OptimizerConfig(**out)
    # the schedule is SkyRL's own scheduler in the plugin (lr_scheduler); floe's stays constant
    assert map_optimizer({**skyrl_default, "scheduler": "cosine", "num_warmup_steps": 5}, total_steps=12) == out
    for bad, field, total in (({"num_warmup_steps": -1}, "num_warmup_steps", 12), ({"scheduler": "wavy"}, "scheduler", 12),
                              ({"scheduler": "reduce_lr_on_plateau"}, "scheduler", 12),
                              ({"scheduler": "warmup_stable_decay"}, "scheduler", 12),
                              ({"scheduler": "cosine"}, "scheduler", None), ({"momentum": 0.9}, "momentum", 12)):
        with pytest.raises(InvalidInput) as err:
            map_optimizer({**skyrl_default, **bad}, total_steps=total) if total else lr_scheduler({**skyrl_default, **bad}, None)
        assert err.value.field == f"trainer.policy.optimizer_config.{field}"


@pytest.mark.parametrize("name", ["constant_with_warmup", "linear", "cosine", "constant"])
def test_lr_scheduler_is_transformers_schedule_stepped_per_optimizer_step(name: str) -> None:
    """The rate of each optimizer step, stepped as SkyRL's FSDP strategy steps it (optimizer
    step, then scheduler step), against transformers' formulas transcribed from
    transformers.optimization (warm-up k/W from 0; `constant` ignores the warm-up, as it does
    under SkyRL)."""
    lr, warm, total = 2e-3, 3, 10
    scheduler = lr_scheduler({"lr": lr, "num_warmup_steps": warm, "scheduler": name}, total)
    got = []
    for _ in range(total):
        got.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()

    def want(k: int) -> float:
        if name == "constant":
            return lr
        if k < warm:
            return lr * k / warm
        progress = (k - warm) / (total - warm)
        return {"constant_with_warmup": lr, "linear": lr * max(0.0, (total - k) / (total - warm)),
                "cosine": lr * max(0.0, 0.5 * (1 + math.cos(math.pi * progress)))}[name]

    assert got == pytest.approx([want(k) for k in range(total)], rel=1e-12, abs=1e-15)


def test_sampling_mapping() -> None:
    # exactly what SkyRL 0.4.0's get_vllm_sampling_params sends by default
    skyrl = {"min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True, "max_tokens": 16,
             "temperature": 0.8, "top_p": 0.9, "top_k": -1, "min_p": 0.0, "logprobs": 1, "stop": None}
    out = map_sampling(skyrl)
    assert out == {"max_tokens": 16, "temperature": 0.8, "top_p": 0.9, "top_k": 0}
    assert floe.SamplingParams(**out).top_k == 0
    assert map_sampling({**skyrl, "stop": ["####"], "top_k": 5, "seed": 3}) == {**out, "top_k": 5, "stop": ["####"], "seed": 3}
    for bad, field in (({"min_p": 0.1}, "min_p"), ({"min_tokens": 4}, "min_tokens"), ({"logprobs": 5}, "logprobs"),
                       ({"repetition_penalty": 1.1}, "repetition_penalty"), ({"n": 2}, "n")):
        with pytest.raises(InvalidInput) as err:
            map_sampling({**skyrl, **bad})
        assert err.value.field == f"sampling_params.{field}"


# -- the weighting algebra ---------------------------------------------------------------------------


def skyrl_prescale(adv: torch.Tensor, mask: torch.Tensor, reduction: str, max_seq_len: int, prompts: list[tuple[int, int]]) -> torch.Tensor:
    """apply_loss_reduction_to_advantages_minibatch (SkyRL 0.4.0), transcribed."""
    b = adv.shape[0]
    if reduction == "token_mean":
        return adv / mask.sum().clamp(min=1)
    if reduction == "sequence_mean":
        return adv / (b * mask.sum(dim=-1, keepdim=True).clamp(min=1))
    if reduction == "seq_mean_token_sum_norm":
        return adv / (b * max_seq_len)
    out = torch.zeros_like(adv)
    for s, e in prompts:  # prompt_mean
        out[s:e] = adv[s:e] / (len(prompts) * mask[s:e].sum().clamp(min=1))
    return out


def skyrl_loss(logp, old, adv_pre, mask, ref, ent, clip, kl_coef, ent_coef, micro):
    """SkyRL 0.4.0 worker loss for one mini-batch on one DP rank, transcribed: per micro-batch,
    Σ m·ppo(A_pre) + (kl_coef·mean_i(Σ_t m·k3 / Σ_t m) − ent_coef·Σ m·H / Σ m)·(rows_mb / rows);
    and its policy term alone, Σ m·ppo(A_pre) over the micro-batches (SkyRL's summed `policy_loss`)."""
    total = torch.zeros((), dtype=logp.dtype)
    policy = torch.zeros((), dtype=logp.dtype)
    rows = logp.shape[0]
    for s in range(0, rows, micro):
        sl = slice(s, s + micro)
        ratio = torch.exp(logp[sl] - old[sl])
        pg = -torch.minimum(ratio * adv_pre[sl], ratio.clamp(1 - clip[0], 1 + clip[1]) * adv_pre[sl])
        total = total + (pg * mask[sl]).sum()
        policy = policy + (pg * mask[sl]).sum()
        d = ref[sl] - logp[sl]
        k3 = (torch.exp(d) - d - 1) * mask[sl]
        kl = ((k3 * mask[sl]).sum(-1) / mask[sl].sum(-1)).mean()
        entropy = (ent[sl] * mask[sl]).sum() / mask[sl].sum()
        total = total + (kl_coef * kl - ent_coef * entropy) * (logp[sl].shape[0] / rows)
    return total, policy


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean"])
@pytest.mark.parametrize("term", ["kl", "entropy", "mask", "kl+entropy"])
def test_floe_weights_reproduce_skyrl_loss_and_gradient(reduction: str, term: str) -> None:
    """floe's loss as the policy zone computes it (each term's scales from `term_scales` over the
    mini-batch: the KL by seq_mean_token_mean, the rest summed) on the plugin's weights and
    advantages vs SkyRL's transcribed worker loss; KL and entropy together included."""
    g = torch.Generator().manual_seed(hash((reduction, term)) % 2**31)
    rows, width, micro = 6, 7, 4  # micro-batches of 4 and 2 rows: unequal, as in SkyRL
    lengths = [7, 3, 5, 1, 6, 4]
    mask = torch.zeros(rows, width, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, width - n :] = 1.0
    mask[2, width - 2] = 0.0  # a masked token inside a response
    logp0 = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    old = logp0 + (torch.rand(rows, width, generator=g, dtype=torch.float64) - 0.5) * 0.8  # both clip branches
    ref = logp0 + (torch.rand(rows, width, generator=g, dtype=torch.float64) - 0.5)
    ent0 = torch.rand(rows, width, generator=g, dtype=torch.float64) * 2
    adv = (torch.randn(rows, 1, generator=g, dtype=torch.float64)).expand(rows, width).clone()
    adv_pre = skyrl_prescale(adv, mask, reduction, max_seq_len=9, prompts=[(0, 2), (2, 4), (4, 6)])
    clip = (0.2, 0.28)
    kl_coef = 0.05 if "kl" in term else 0.0
    ent_coef = 0.03 if "entropy" in term else 0.0

    logp_a, ent_a = logp0.clone().requires_grad_(), ent0.clone().requires_grad_()
    expected, expected_policy = skyrl_loss(logp_a, old, adv_pre, mask, ref, ent_a, clip, kl_coef, ent_coef, micro)
    expected.backward()

    algo = {**ALGO, "eps_clip_low": clip[0], "eps_clip_high": clip[1], "use_kl_loss": "kl" in term,
            "kl_loss_coef": kl_coef, "use_entropy_loss": "entropy" in term, "entropy_loss_coef": ent_coef}
    m = map_loss(algo)
    assert m.weighting == ("entropy" if "entropy" in term else "mask")
    w = token_weights(mask, m.weighting, micro)
    a = floe_advantages(adv_pre, mask, w)

    def flat(t: torch.Tensor) -> torch.Tensor:  # floe's view: each row's response tokens, concatenated
        return torch.cat([t[i, width - n :] for i, n in enumerate(lengths)])

    spec = resolve_loss(m.loss, m.loss_config)
    scales = term_scales(lengths, [float(w[i].sum()) for i in range(rows)], spec.config)

    def per_token(values: list[float]) -> torch.Tensor:
        return torch.cat([torch.full((n,), v, dtype=torch.float64) for v, n in zip(values, lengths)])

    logp_b, ent_b = logp0.clone().requires_grad_(), ent0.clone().requires_grad_()
    x = TokenInputs(
        logp=flat(logp_b), weights=flat(w), scale=per_token(scales.policy), kl_scale=per_token(scales.kl),
        entropy_scale=per_token(scales.entropy),
        sample_index=torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]), num_samples=rows,
        old_logp=flat(old), advantages=flat(a), ref_logp=flat(ref), entropy=flat(ent_b),
    )
    got, sums = compute_loss(spec, x)
    got.backward()
    assert math.isclose(float(got.detach()), float(expected.detach()), rel_tol=1e-9, abs_tol=1e-12)
    # floe's `policy_loss` metric is SkyRL's policy_loss: the loss less its KL and entropy terms
    assert math.isclose(sums["policy_loss"], float(expected_policy), rel_tol=1e-9, abs_tol=1e-12)
    assert torch.allclose(logp_b.grad, logp_a.grad, atol=1e-12)  # both 0 off the loss mask
    if "entropy" in term:
        assert ent_b.grad is not None and torch.allclose(ent_b.grad, ent_a.grad, atol=1e-12)
