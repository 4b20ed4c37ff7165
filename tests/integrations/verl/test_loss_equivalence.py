"""One batch in verl's layout through verl's own actor loss (verl.workers.utils.losses.ppo_loss:
the core_algos policy loss of actor.policy_loss.loss_mode, agg_loss, kl_penalty, entropy) and
through floe's forward_backward with the loss floe.integrations.verl maps from the same actor
config: the same loss and the same parameter gradients, within 1e-5 (fp32). Every verl 0.9.1
loss_mode has cases whose inputs take its clip / mask / selection branches. verl computes the
whole mini-batch as one micro-batch (the setting under which verl's per-micro-batch statistics
of clip_cov, kl_cov and geo_mean equal floe's per-call ones); floe splits it into micro-batches
of at most 8 tokens. Runs in verl's environment (scripts/ci/verl.sh)."""

from __future__ import annotations

import pytest
import torch

import floe
from floe.convert import verl_to_batch
from floe.integrations.verl.loss_mapping import verl_loss
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


def _verl_loss(model, actor_kwargs: dict, masks, olds, advs, refs):
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
    {"policy_loss": {"loss_mode": "dro", "dro_beta": 0.3}, "loss_agg_mode": "token-mean"},
    {"policy_loss": {"loss_mode": "cispo"}, "loss_agg_mode": "token-mean", "clip_ratio_low": 0.1, "clip_ratio_high": 0.15},
    {"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": {"loss_type": "ppo_clip"}},
     "loss_agg_mode": "token-mean", "clip_ratio_low": 0.1, "clip_ratio_high": 0.15, "clip_ratio_c": 2.0},
    {"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": {"loss_type": "reinforce", "rollout_is": None}},
     "loss_agg_mode": "seq-mean-token-sum"},
    {"policy_loss": {"loss_mode": "bypass_mode",
                     "rollout_correction": {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 1.1}},
     "loss_agg_mode": "token-mean"},
]
# floe losses that never clip (sapo's gate is smooth; dro is gpg's and REINFORCE's -A·logp).
NO_CLIP = ("sapo", "dro")
SEED = 2024  # torch's default generator before each side (clip_cov draws the tokens it drops)


def _case_id(i: int, case: dict) -> str:
    mode = case.get("policy_loss", {}).get("loss_mode", "vanilla")
    return f"{mode}-{case['loss_agg_mode']}-{i}"


@pytest.mark.parametrize("actor_kwargs", CASES, ids=[_case_id(i, c) for i, c in enumerate(CASES)])
def test_verl_ppo_loss_and_floe_agree_on_loss_and_gradients(make_client, actor_kwargs):
    client = make_client(compute=floe.ComputeConfig(max_tokens_per_microbatch=8))
    policy = backend_of(client).policy
    masks, olds, advs, refs = _rows(seed=len(str(actor_kwargs)))
    # Old log-probs near the policy's own so ratios land on both sides of the clips.
    with torch.no_grad():
        current, _ = _full_sequence_outputs(policy.model, TEMPERATURE)
    offset = 0
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        start = offset + len(p) - 1
        cur = current[start : start + len(r)].tolist()
        olds[i] = [c + 0.3 * (o + 3.5) for c, o in zip(cur, olds[i])]
        refs[i] = [c + 0.2 * (x + 3.5) for c, x in zip(cur, refs[i])]
        offset += len(p) + len(r)

    mapped = verl_loss({"policy_loss": {"loss_mode": "vanilla"}, **actor_kwargs})
    layout = verl_to_batch(PROMPTS, RESPONSES, UIDS, response_mask=masks, old_log_probs=olds, advantages=advs,
                           ref_log_probs=refs)
    assert [len(g.samples) for g in layout.batch.groups] == [3, 2, 1]
    torch.manual_seed(SEED)
    result = client.forward_backward(layout.batch, mapped.loss, mapped.loss_config, temperature=TEMPERATURE)
    floe_grads = [p.grad.detach().clone() for p in policy.params]
    if mapped.loss not in NO_CLIP:
        assert 0 < result.metrics["clip_fraction"] < 1  # the clip / mask / selection is exercised, not everywhere
    for p in policy.params:
        p.grad = None

    torch.manual_seed(SEED)
    verl = _verl_loss(policy.model, actor_kwargs, masks, olds, advs, refs)
    verl.backward()
    assert abs(float(verl.detach()) - result.metrics["loss"]) < 1e-5, (float(verl.detach()), result.metrics["loss"])
    worst = max(float((p.grad - g).abs().max()) for p, g in zip(policy.params, floe_grads))
    assert worst < 1e-5, worst
    assert max(float(g.abs().max()) for g in floe_grads) > 1e-4  # gradients are not trivially zero
