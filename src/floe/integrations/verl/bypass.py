"""verl 0.9.1's `bypass_mode` policy loss (core_algos.compute_policy_loss_bypass_mode) on floe.

With `algorithm.rollout_correction.bypass_mode=true` verl's trainer puts the sampler's log-probs
in `old_log_probs` and skips its own correction; with `actor.policy_loss.loss_mode=bypass_mode`
the loss then computes the rollout correction itself, in every micro-batch, from the log-probs
of the policy being updated (π_θ, under no_grad) against the sampler's (π_rollout), with
`actor.policy_loss.rollout_correction`:

    w, m' = compute_rollout_correction_and_rejection_mask(old=logp_θ, rollout=old_log_probs, mask)
    ppo_clip:  vanilla PPO (ratio π_θ / π_rollout, dual clip) on mask m', no IS weights
    reinforce: −A·logp_θ·w on mask m' (compute_policy_loss_reinforce)

and aggregates that policy term with `agg_loss(…, m', …)` under the mini-batch's original
denominators (`batch_num_tokens`, `global_batch_size` from the original mask), while the KL and
entropy terms keep the original mask. The parameters do not move inside a mini-batch, so floe's
`forward` of the mini-batch at the current weights gives logp_θ exactly; this module runs verl's
own helper on it and returns floe's advantages: A'_t = A_t·m'_t·w_t·c_i, with the floe weights
left at the original mask. c_i = n_i / n'_i (token counts of row i under m and m') for
seq-mean-token-mean, whose policy term divides each row by its own m' count; 1 otherwise. Both
losses are positively homogeneous in A (ppo with dual clip; floe's `dro` with β = 0 is
−A·logp), so the fold is exact. Costs one policy forward per mini-batch, as verl's own bypass
loss needs its π_θ log-probs.
"""

from __future__ import annotations

import torch
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

from floe.convert import pad_rows
from floe.integrations.verl.loss_mapping import RolloutCorrection


def bypass_advantages(correction: RolloutCorrection, aggregation: str, current: list[list[float]],
                      rollout: list[list[float]], masks: list[list[float]], advantages: list[list[float]],
                      ) -> tuple[list[list[float]], dict[str, float]]:
    """floe's advantages for verl's bypass_mode loss on one mini-batch, and verl's rollout_corr/* metrics.

    Rows are ragged per-token lists over each response: `current` = the policy's log-probs now
    (floe forward), `rollout` = the sampler's (verl's `old_log_probs` in bypass mode), `masks` =
    verl's response_mask, `advantages` = verl's. `aggregation` is floe's (seq_mean_token_mean
    rescales rows, see the module doc). Returns A' rows (same shapes) and the metrics verl's
    loss adds to its own (`rollout_corr/…`).
    """
    lengths = [len(r) for r in masks]
    mask = pad_rows(masks)
    weights, kept, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=pad_rows(current), rollout_log_prob=pad_rows(rollout), response_mask=mask,
        rollout_is=correction.rollout_is, rollout_is_threshold=correction.rollout_is_threshold,
        rollout_is_batch_normalize=correction.rollout_is_batch_normalize, rollout_rs=correction.rollout_rs,
        rollout_rs_threshold=correction.rollout_rs_threshold)
    scale = kept.to(torch.float64)
    if correction.loss_type == "reinforce" and weights is not None:
        scale = scale * weights.batch["rollout_is_weights"].to(torch.float64)
    if aggregation == "seq_mean_token_mean":
        n, n_kept = mask.to(torch.float64).sum(-1, keepdim=True), kept.to(torch.float64).sum(-1, keepdim=True)
        scale = torch.where(n_kept > 0, scale * n / n_kept.clamp_min(1.0), torch.zeros_like(scale))
    out = [[a * float(c) for a, c in zip(row, scale[i, : lengths[i]])] for i, row in enumerate(advantages)]
    return out, {k: float(v) for k, v in metrics.items()}
