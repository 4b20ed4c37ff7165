"""One batch in verl's layout through verl's own actor loss (verl.workers.utils.losses.ppo_loss:
the core_algos policy loss of actor.policy_loss.loss_mode, agg_loss, kl_penalty, entropy) and
through floe's forward_backward with the loss floe.integrations.verl maps from the same actor
config: the same loss and the same parameter gradients, within 1e-5 (fp32). Every verl 0.9.1
loss_mode has cases whose inputs take its clip / mask / selection branches. verl computes the
whole mini-batch as one micro-batch (the setting under which verl's per-micro-batch statistics
of clip_cov, kl_cov and geo_mean equal floe's per-call ones); floe splits it into micro-batches
of at most 8 tokens.

With rollout correction (decoupled), verl's own rollout_corr_helper.
compute_rollout_correction_and_rejection_mask (what verl's trainer runs) makes the IS weights and
the rejection mask from old vs rollout log-probs; verl's loss gets them as `rollout_is_weights` +
the modified `response_mask`, floe the same mask and A·w (loss_mapping.weighted_advantages, what
the plugin sends), for vanilla PPO and every other loss_mode the fold is exact for
(loss_mapping.IS_FOLD_EXACT). verl's bypass_mode loss (correction from the current policy inside
the loss) vs the plugin's forward at the current weights + bypass.bypass_advantages. Runs in
verl's environment (scripts/ci/verl.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import floe
from floe.convert import pad_rows, verl_to_batch
from floe.integrations.verl.loss_mapping import IS_FOLD_EXACT, verl_loss, weighted_advantages
from tests.conftest import backend_of

pytestmark = pytest.mark.verl

TEMPERATURE = 0.8
PROMPTS = [[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6], [7, 8, 9], [7, 8, 9], [10, 11, 12, 13, 14]]
RESPONSES = [[20, 21, 22], [23, 24], [25, 26, 27, 28, 29], [30], [31, 32, 33, 34], [35, 36]]
UIDS = ["a", "a", "a", "b", "b", "c"]


def _rows(seed: int):
    g = torch.Generator().manual_seed(seed)
    masks, olds, advs, refs = [], [], [], []
    for r in RESPONSES:
        k = len(r)
        mask = (torch.rand(k, generator=g) > 0.2).float()
        mask[0] = 1.0
        masks.append(mask.tolist())
        olds.append((-3.5 + 0.6 * torch.randn(k, generator=g)).tolist())
        advs.append([float(torch.randn(1, generator=g))] * k)  # GRPO: one advantage per response
        refs.append((-3.5 + 0.6 * torch.randn(k, generator=g)).tolist())
    return masks, olds, advs, refs


def _full_sequence_outputs(model, temperature: float):
    """verl's model output for ppo_loss: log-probs and entropies over every whole sequence
    (position j = next token j+1), concatenated over rows (verl's no-padding layout)."""
    logps, ents = [], []
    for p, r in zip(PROMPTS, RESPONSES):
        ids = torch.tensor([p + r])
        logits = model(input_ids=ids).logits[0].float() / temperature
        logprobs = torch.log_softmax(logits, dim=-1)
        next_ids = ids[0, 1:]
        lp = logprobs[:-1].gather(-1, next_ids[:, None])[:, 0]
        ent = -(logprobs.exp() * logprobs).sum(-1)[:-1]
        logps.append(torch.cat([lp, lp.new_zeros(1)]))
        ents.append(torch.cat([ent, ent.new_zeros(1)]))
    return torch.cat(logps), torch.cat(ents)


def _nested(rows, dtype=torch.float32):
    return torch.nested.as_nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)


def _verl_loss(model, actor_kwargs: dict, masks, olds, advs, refs, is_weights=None):
    from tensordict import TensorDict  # noqa: PLC0415 - verl's stack
    from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: PLC0415
    from verl.utils import tensordict_utils as tu  # noqa: PLC0415
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: PLC0415
    from verl.workers.utils.losses import ppo_loss  # noqa: PLC0415

    kwargs = dict(actor_kwargs)
    policy_loss = dict(kwargs.pop("policy_loss", {"loss_mode": "vanilla"}))
    if "rollout_correction" in policy_loss:
        policy_loss["rollout_correction"] = RolloutCorrectionConfig(**policy_loss["rollout_correction"])
    config = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=len(PROMPTS), ppo_micro_batch_size_per_gpu=len(PROMPTS),
                             rollout_n=1, policy_loss=PolicyLossConfig(**policy_loss), **kwargs)
    data = TensorDict({
        "prompts": _nested(PROMPTS, torch.long), "responses": _nested(RESPONSES, torch.long),
        "response_mask": _nested(masks), "old_log_probs": _nested(olds), "advantages": _nested(advs),
        "ref_log_prob": _nested(refs),
        **({"rollout_is_weights": _nested(is_weights)} if is_weights is not None else {}),
    }, batch_size=[len(PROMPTS)])
    total_mask = sum(sum(m) for m in masks)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(total_mask), global_batch_size=len(PROMPTS))
    log_probs, entropy = _full_sequence_outputs(model, TEMPERATURE)
    loss, _ = ppo_loss(config, {"log_probs": log_probs, "entropy": entropy}, data)
    return loss


CASES = [
    {"loss_agg_mode": "token-mean"},
    {"loss_agg_mode": "token-mean", "use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl",
     "entropy_coeff": 0.01, "clip_ratio_low": 0.1, "clip_ratio_high": 0.28, "clip_ratio_c": 2.0},
    {"loss_agg_mode": "token-sum", "use_kl_loss": True, "kl_loss_coef": 0.05, "kl_loss_type": "k1"},
    {"loss_agg_mode": "seq-mean-token-mean", "use_kl_loss": True, "kl_loss_coef": 0.2, "kl_loss_type": "mse"},
    {"loss_agg_mode": "seq-mean-token-sum", "entropy_coeff": 0.02},
    {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 16, "use_kl_loss": True, "kl_loss_coef": 0.1},
    # dppo: thresholds on probability moves (TV) / binary KL small enough to mask tokens, a
    # truncation C that bites.
    {"policy_loss": {"loss_mode": "dppo_tv"}, "loss_agg_mode": "token-mean", "clip_ratio_low": 0.002,
     "clip_ratio_high": 0.003, "clip_ratio_c": 1.1, "use_kl_loss": True, "kl_loss_coef": 0.1},
    {"policy_loss": {"loss_mode": "dppo_kl"}, "loss_agg_mode": "seq-mean-token-mean", "clip_ratio_low": 1e-4,
     "clip_ratio_high": 2e-4, "clip_ratio_c": 1.2},
    {"policy_loss": {"loss_mode": "gspo"}, "loss_agg_mode": "seq-mean-token-mean", "clip_ratio_low": 0.01,
     "clip_ratio_high": 0.02},
    {"policy_loss": {"loss_mode": "gspo"}, "loss_agg_mode": "token-mean", "clip_ratio_low": 0.01, "clip_ratio_high": 0.02,
     "entropy_coeff": 0.01},
    {"policy_loss": {"loss_mode": "sapo"}, "loss_agg_mode": "seq-mean-token-mean", "tau_pos": 1.0, "tau_neg": 1.05,
     "use_kl_loss": True, "kl_loss_coef": 0.1},
    {"policy_loss": {"loss_mode": "sapo"}, "loss_agg_mode": "token-mean", "tau_pos": 2.0, "tau_neg": 3.0},
    {"policy_loss": {"loss_mode": "gpg"}, "loss_agg_mode": "token-sum", "use_kl_loss": True, "kl_loss_coef": 0.05},
    # clip_cov: more candidates than the one token it drops, so the draw matters (a different seed fails).
    {"policy_loss": {"loss_mode": "clip_cov", "clip_cov_ratio": 0.1, "clip_cov_lb": -5.0, "clip_cov_ub": 5.0},
     "loss_agg_mode": "token-mean", "clip_ratio_low": 0.1, "clip_ratio_high": 0.1},
    {"policy_loss": {"loss_mode": "kl_cov", "kl_cov_ratio": 0.2, "ppo_kl_coef": 0.5}, "loss_agg_mode": "seq-mean-token-mean"},
    {"policy_loss": {"loss_mode": "geo_mean"}, "loss_agg_mode": "seq-mean-token-mean", "clip_ratio_low": 0.05,
     "clip_ratio_high": 0.08, "use_kl_loss": True, "kl_loss_coef": 0.1},
    {"policy_loss": {"loss_mode": "geo_mean"}, "loss_agg_mode": "token-mean", "clip_ratio_low": 0.05, "clip_ratio_high": 0.08},
    # sapo / geo_mean: the policy term by sequence mean, KL and entropy by loss_agg_mode (floe's
    # kl.aggregation / entropy.aggregation); the gmpo recipe's combination (token-mean, k3 KL) first.
    {"policy_loss": {"loss_mode": "geo_mean"}, "loss_agg_mode": "token-mean", "clip_ratio_low": 0.05,
     "clip_ratio_high": 0.08, "use_kl_loss": True, "kl_loss_coef": 0.3, "kl_loss_type": "low_var_kl"},
    {"policy_loss": {"loss_mode": "geo_mean"}, "loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 4,
     "clip_ratio_low": 0.05, "clip_ratio_high": 0.08, "use_kl_loss": True, "kl_loss_coef": 0.2, "kl_loss_type": "mse",
     "entropy_coeff": 0.05},
    {"policy_loss": {"loss_mode": "sapo"}, "loss_agg_mode": "token-sum", "tau_pos": 1.0, "tau_neg": 1.05,
     "use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "k1", "entropy_coeff": 0.02},
    {"policy_loss": {"loss_mode": "sapo"}, "loss_agg_mode": "token-mean", "tau_pos": 2.0, "tau_neg": 3.0,
     "entropy_coeff": 0.05},
    {"policy_loss": {"loss_mode": "dro", "dro_beta": 0.3}, "loss_agg_mode": "token-mean"},
    {"policy_loss": {"loss_mode": "cispo"}, "loss_agg_mode": "token-mean", "clip_ratio_low": 0.1, "clip_ratio_high": 0.15},
]
# floe losses that never clip (sapo's gate is smooth; dro is gpg's and REINFORCE's -A·logp).
NO_CLIP = ("sapo", "dro")
SEED = 2024  # torch's default generator before each side (clip_cov draws the tokens it drops)




# algorithm.rollout_correction cases (verl's presets and each threshold form), each with an actor config.
RC_CASES = [
    ({"rollout_is": "token", "rollout_is_threshold": 1.3}, CASES[1]),  # Token-TIS, KL + entropy
    ({"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True}, CASES[3]),
    ({"rollout_is": "token", "rollout_is_threshold": "0.8_1.25"}, CASES[2]),  # token IcePop
    ({"rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": "0.7_1.5,0.2"}, CASES[4]),
    ({"rollout_is": "sequence", "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.7_1.4"}, CASES[5]),  # Seq-MIS
    ({"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.8_1.25"},
     CASES[0]),  # Geo-RS + Token-TIS
    ({"rollout_rs": "token_k3,seq_mean_k2", "rollout_rs_threshold": "0.05,0.04"}, CASES[0]),  # K3-RS
]
# Decoupled IS (+ rejection) on top of every other loss_mode whose policy term is positively homogeneous in A
# (loss_mapping.IS_FOLD_EXACT): the fold A·w is exact for each. (clip_cov, kl_cov, geo_mean, dro: refused.)
RC_CASES += [
    ({"rollout_is": "token", "rollout_is_threshold": 1.4, "rollout_rs": "token_k1", "rollout_rs_threshold": "0.6_1.6"}, c)
    for c in CASES if c.get("policy_loss", {}).get("loss_mode", "vanilla") in IS_FOLD_EXACT
    and c.get("policy_loss", {}).get("loss_mode", "vanilla") != "vanilla"
] + [({"rollout_is": "sequence", "rollout_is_threshold": 3.0}, c) for c in CASES
     if c.get("policy_loss", {}).get("loss_mode") in ("gspo", "sapo")]


def _rollout_correction(rc: dict, masks, olds, rollouts):
    """verl's own trainer-side step: IS weights (or None) and the rejected mask, as rows."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask  # noqa: PLC0415

    weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
        pad_rows(olds), pad_rows(rollouts), pad_rows(masks), rollout_is=rc.get("rollout_is"),
        rollout_is_threshold=rc.get("rollout_is_threshold", 2.0),
        rollout_is_batch_normalize=rc.get("rollout_is_batch_normalize", False),
        rollout_rs=rc.get("rollout_rs"), rollout_rs_threshold=rc.get("rollout_rs_threshold"))
    lengths = [len(r) for r in RESPONSES]
    w = None if weights is None else [weights.batch["rollout_is_weights"][i, :k].tolist() for i, k in enumerate(lengths)]
    return w, [mask[i, :k].tolist() for i, k in enumerate(lengths)], metrics


def _near_policy(policy, olds, refs, spread=0.3):
    """Old (and ref) log-probs near the policy's own so ratios land on both sides of the clips."""
    with torch.no_grad():
        current, _ = _full_sequence_outputs(policy.model, TEMPERATURE)
    offset = 0
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        start = offset + len(p) - 1
        cur = current[start : start + len(r)].tolist()
        olds[i] = [c + spread * (o + 3.5) for c, o in zip(cur, olds[i])]
        refs[i] = [c + 0.2 * (x + 3.5) for c, x in zip(cur, refs[i])]
        offset += len(p) + len(r)


def _case_id(i: int, case: dict) -> str:
    mode = case.get("policy_loss", {}).get("loss_mode", "vanilla")
    return f"{mode}-{case['loss_agg_mode']}-{i}"


def _client(make_client):
    client = make_client(compute=floe.ComputeConfig(max_tokens_per_microbatch=8))
    return client, backend_of(client).policy


@pytest.mark.parametrize("actor_kwargs", CASES, ids=[_case_id(i, c) for i, c in enumerate(CASES)])
def test_verl_ppo_loss_and_floe_agree_on_loss_and_gradients(make_client, actor_kwargs):
    client, policy = _client(make_client)
    masks, olds, advs, refs = _rows(seed=len(str(actor_kwargs)))
    _near_policy(policy, olds, refs)
    _compare(client, policy, actor_kwargs, masks, olds, advs, refs, clip_within=True)


@pytest.mark.parametrize(("rc", "actor_kwargs"), RC_CASES, ids=[f"rc{i}-{_case_id(i, c).rsplit('-', 1)[0]}-" + "+".join(
    str(rc.get(k)) for k in ("rollout_is", "rollout_rs") if rc.get(k)) for i, (rc, c) in enumerate(RC_CASES)])
def test_verl_rollout_correction_and_floe_agree_on_loss_and_gradients(make_client, rc, actor_kwargs):
    client, policy = _client(make_client)
    masks, olds, advs, refs = _rows(seed=len(str(rc)))
    _near_policy(policy, olds, refs, spread=0.6)
    g = torch.Generator().manual_seed(len(str(actor_kwargs)))
    rollouts = [[o + 0.35 * float(torch.randn(1, generator=g)) for o in row] for row in olds]
    weights, rs_masks, metrics = _rollout_correction(rc, masks, olds, rollouts)
    assert "rollout_corr/kl" in metrics  # verl's trainer logs these itself
    if rc.get("rollout_rs"):
        assert sum(map(sum, rs_masks)) < sum(map(sum, masks))  # some tokens are rejected ...
        assert sum(map(sum, rs_masks)) > 0  # ... not all
    if rc.get("rollout_is"):
        flat = [x for row, m in zip(weights, rs_masks) for x, k in zip(row, m) if k]
        assert max(flat) > 1.01 and min(flat) < 0.99  # weights that change the loss
    _compare(client, policy, actor_kwargs, rs_masks, olds, advs, refs, rc=rc, is_weights=weights)


# actor.policy_loss.rollout_correction for verl's bypass_mode loss (algorithm.rollout_correction.bypass_mode=true).
BYPASS_CASES = [
    ({"rollout_is": None, "rollout_rs": "token_k1", "rollout_rs_threshold": "0.7_1.4"}, CASES[1]),  # ppo_clip + RS
    ({"rollout_is": None, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.045}, CASES[3]),  # bypass_ppo_clip_k3_rs
    # token-level rejection under seq-mean-token-mean: verl divides each row's policy term by its kept tokens
    ({"rollout_is": None, "rollout_rs": "token_k2", "rollout_rs_threshold": 0.03}, CASES[3]),
    ({"loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": 2.0}, CASES[2]),  # bypass_pg_is
    ({"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": "0.8_1.25",  # token IcePop + Geo-RS
      "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.85_1.15"}, CASES[3]),
    ({"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 1.3, "rollout_rs": "token_k2",
      "rollout_rs_threshold": 0.05}, CASES[5]),
    # the losses branch's bypass cases: ppo_clip with the dataclass's sequence IS (metrics only), plain
    # REINFORCE (no IS), token TIS under token-mean
    ({"loss_type": "ppo_clip"}, {"loss_agg_mode": "token-mean", "clip_ratio_low": 0.1, "clip_ratio_high": 0.15,
                                 "clip_ratio_c": 2.0}),
    ({"loss_type": "reinforce", "rollout_is": None}, {"loss_agg_mode": "seq-mean-token-sum"}),
    ({"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 1.1}, {"loss_agg_mode": "token-mean"}),
]


@pytest.mark.parametrize(("bypass", "actor_kwargs"), BYPASS_CASES, ids=[f"bypass{i}-{b.get('loss_type', 'ppo_clip')}"
                                                                        for i, (b, _) in enumerate(BYPASS_CASES)])
def test_verl_bypass_mode_loss_and_floe_agree_on_loss_and_gradients(make_client, bypass, actor_kwargs):
    """verl's bypass_mode loss (old log-probs = the sampler's; correction from the current policy
    inside the loss) vs floe: the plugin's forward at the current weights + bypass.bypass_advantages."""
    from floe.integrations.verl.bypass import bypass_advantages  # noqa: PLC0415 - imports verl

    client, policy = _client(make_client)
    masks, rollouts, advs, refs = _rows(seed=len(str(bypass)))
    _near_policy(policy, rollouts, refs, spread=0.6)
    actor_kwargs = {"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": bypass}, **actor_kwargs}
    algorithm = {"rollout_correction": {"bypass_mode": True}}
    mapped = verl_loss(actor_kwargs, algorithm)
    assert mapped.loss == ("dro" if bypass.get("loss_type") == "reinforce" else "ppo")
    layout = verl_to_batch(PROMPTS, RESPONSES, UIDS)
    current = layout.per_row(client.forward(layout.batch, temperature=TEMPERATURE).logprobs)
    floe_advs, metrics = bypass_advantages(mapped.bypass, mapped.loss_config["aggregation"], current, rollouts, masks, advs)
    assert "rollout_corr/kl" in metrics
    if bypass.get("rollout_rs"):  # the rejection bites, not everywhere
        rejected = metrics[f"rollout_corr/rollout_rs_{bypass['rollout_rs']}_masked_fraction"]
        assert 0 < rejected < 1, rejected
    _compare(client, policy, actor_kwargs, masks, rollouts, advs, refs, floe_advs=floe_advs, algorithm=algorithm)


def _compare(client, policy, actor_kwargs, masks, olds, advs, refs, rc=None, is_weights=None, floe_advs=None,
             algorithm=None, clip_within=False):
    """floe's forward_backward (the mapped loss; A·w with IS weights, or `floe_advs`) vs verl's
    ppo_loss on the same rows: loss and every parameter gradient within 1e-5."""
    actor_kwargs = {"policy_loss": {"loss_mode": "vanilla"}, **actor_kwargs}
    mapped = verl_loss(actor_kwargs, algorithm if rc is None else {"rollout_correction": rc})
    assert mapped.rollout_is_weights == (is_weights is not None)
    if floe_advs is None:
        floe_advs = weighted_advantages(advs, is_weights) if mapped.rollout_is_weights else advs
    layout = verl_to_batch(PROMPTS, RESPONSES, UIDS, response_mask=masks, old_log_probs=olds, advantages=floe_advs,
                           ref_log_probs=refs)
    assert [len(g.samples) for g in layout.batch.groups] == [3, 2, 1]
    torch.manual_seed(SEED)
    result = client.forward_backward(layout.batch, mapped.loss, mapped.loss_config, temperature=TEMPERATURE)
    floe_grads = [p.grad.detach().clone() for p in policy.params]
    if clip_within and mapped.loss not in NO_CLIP:
        assert 0 < result.metrics["clip_fraction"] < 1  # the clip / mask / selection is exercised, not everywhere
    elif mapped.loss == "ppo":
        assert result.metrics["clip_fraction"] > 0  # the clip is exercised
    for p in policy.params:
        p.grad = None

    torch.manual_seed(SEED)
    verl = _verl_loss(policy.model, actor_kwargs, masks, olds, advs, refs, is_weights)
    verl.backward()
    assert abs(float(verl.detach()) - result.metrics["loss"]) < 1e-5, (float(verl.detach()), result.metrics["loss"])
    worst = max(float((p.grad - g).abs().max()) for p, g in zip(policy.params, floe_grads))
    assert worst < 1e-5, worst
    assert max(float(g.abs().max()) for g in floe_grads) > 1e-4  # gradients are not trivially zero


def test_floes_rollout_correction_tables_are_verls():
    """The keys, YAML defaults and rejection options loss_mapping validates against are verl's own."""
    from dataclasses import fields  # noqa: PLC0415

    from omegaconf import OmegaConf  # noqa: PLC0415
    from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: PLC0415
    from verl.trainer.ppo import rollout_corr_helper  # noqa: PLC0415

    from floe.integrations.verl.loss_mapping import ROLLOUT_CORRECTION_DEFAULTS, ROLLOUT_RS_OPTIONS  # noqa: PLC0415

    assert {f.name for f in fields(RolloutCorrectionConfig)} - {"_target_"} == set(ROLLOUT_CORRECTION_DEFAULTS)
    assert rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS == ROLLOUT_RS_OPTIONS
    yaml = Path(rollout_corr_helper.__file__).parents[1] / "config" / "_generated_ppo_trainer.yaml"
    block = OmegaConf.to_container(OmegaConf.load(yaml).algorithm.rollout_correction)
    assert block == ROLLOUT_CORRECTION_DEFAULTS
