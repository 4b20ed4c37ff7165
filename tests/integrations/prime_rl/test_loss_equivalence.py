"""prime-rl's own loss (src/prime_rl/trainer/rl/loss.py at the pinned commit: `compute_loss` with
`setup_rl_loss_fn` of its `default` DPPO+KL and `ipo` configs) and floe's mapped loss
(loss_mapping.map_loss) through `forward_backward` on the batch `floe prime-trainer` builds from
the same packed micro-batches (batch.to_floe_batch): the same loss and the same parameter
gradients, within 1e-5 (fp32).

The rollouts are sampled at a low temperature, so many tokens have a probability above 0.2 and
prime-rl's trust-region masks (|p − p_inf| beyond 0.2 / the IPO threshold) can fire; the
inference log-probs are the sampler's, shifted per token, so tokens land on both sides of each
mask, for both advantage signs. Some tokens carry rl weights of 0 or 0.5. Runs in prime-rl's
environment (scripts/ci/prime-rl.sh)."""

from __future__ import annotations

import random

import pytest
import torch

import floe
from floe.integrations.prime_rl.batch import to_floe_batch
from floe.integrations.prime_rl.formats import MicroBatch
from floe.integrations.prime_rl.loss_mapping import map_loss
from tests.conftest import backend_of
from tests.integrations.prime_rl.orchestrator import make_samples, pack

pytestmark = pytest.mark.prime_rl

TEMPERATURE = 0.05
CASES = [
    {},  # prime-rl's defaults: DPPO masks at 0.2, kl_tau 1e-3
    {"dppo_mask_low": 0.1, "dppo_mask_high": 0.3, "adv_tau": 0.7, "kl_tau": 0.05},
    {"type": "ipo"},  # ipo_threshold 0.1
    {"type": "ipo", "ipo_threshold": 0.25, "kl_tau": 0.0, "adv_tau": 2.0},
]


def _perturbed(mbs: list[MicroBatch], seed: int) -> list[MicroBatch]:
    """The sampler's log-probs shifted per token (the inference engine's numbers differ from the
    trainer's), and rl weights of 1, 0.5 or 0 on the trainable tokens."""
    rng = random.Random(seed)
    for mb in mbs:
        mb.inference_logprobs = [min(-1e-3, lp + rng.gauss(0.0, 0.6)) if m else lp
                                 for lp, m in zip(mb.inference_logprobs, mb.loss_mask)]
        mb.rl_weights = [rng.choice([1.0, 1.0, 1.0, 0.5, 0.0]) if m else 0.0 for m in mb.loss_mask]
        mb.advantages = [a * rng.choice([1.0, -1.0]) if m else 0.0 for a, m in zip(mb.advantages, mb.loss_mask)]
    return mbs


def _trainer_logprobs(model, ids: list[int], temperature: float) -> torch.Tensor:
    """prime-rl's per-position convention: position t holds log p(ids[t] | ids[<t]), position 0 a pad."""
    logits = model(input_ids=torch.tensor([ids])).logits[0].float() / temperature
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    return torch.cat([torch.zeros(1), logp])


def _prime_rl_loss(model, mbs: list[MicroBatch], table: dict, rl_scale: int) -> tuple[torch.Tensor, dict]:
    """prime-rl's train step over the micro-batches: compute_loss per micro-batch (its samples
    split by sequence_lengths), summed, each already divided by the step's rl_scale."""
    from prime_rl.configs.trainer import DefaultLossConfig, IPOLossConfig  # noqa: PLC0415 - prime-rl's stack
    from prime_rl.trainer.rl.loss import compute_loss, setup_rl_loss_fn  # noqa: PLC0415

    config = IPOLossConfig(**table) if table.get("type") == "ipo" else DefaultLossConfig(**table)
    rl_fn = setup_rl_loss_fn(config)
    total = torch.zeros(())
    metrics: dict = {}
    for mb in mbs:
        cols: dict[str, list] = {k: [] for k in ("trainer", "inference", "adv", "mask", "rl_w")}
        start = 0
        for length in mb.sequence_lengths:
            span = slice(start, start + length)
            cols["trainer"].append(_trainer_logprobs(model, mb.input_ids[span], mb.temperatures[start]))
            cols["inference"].append(torch.tensor(mb.inference_logprobs[span]))
            cols["adv"].append(torch.tensor(mb.advantages[span]))
            cols["mask"].append(torch.tensor(mb.loss_mask[span]))
            cols["rl_w"].append(torch.tensor(mb.rl_weights[span]))  # type: ignore[index]
            start += length
        loss, m = compute_loss(cols["trainer"], cols["inference"], None, cols["adv"], cols["mask"], cols["rl_w"],
                               None, None, rl_fn, rl_scale=rl_scale, ce_scale=1, ref_kl_scale=1)
        total = total + loss
        for k, v in m.items():
            metrics.setdefault(k, []).append(v)
    return total, {k: torch.cat([t.reshape(-1) for t in v]) for k, v in metrics.items()}


@pytest.mark.parametrize("table", CASES, ids=[str(c) or "defaults" for c in CASES])
def test_prime_rl_loss_and_floe_agree_on_loss_and_gradients(make_client, table: dict) -> None:
    client = make_client(seed=0, compute=floe.ComputeConfig(max_tokens_per_microbatch=8))
    policy = backend_of(client).policy
    samples = make_samples(client, seed=3, temperature=TEMPERATURE) + make_samples(client, seed=4, temperature=TEMPERATURE)
    mbs = _perturbed(pack(samples), seed=len(str(table)))
    mapped = map_loss(table)
    step = to_floe_batch(mbs, mapped)
    result = client.forward_backward(step.batch, loss=mapped.name, loss_config=mapped.config)
    floe_grads = [p.grad.detach().clone() for p in policy.params]
    for p in policy.params:
        p.grad = None

    prime, metrics = _prime_rl_loss(policy.model, mbs, table, step.rl_scale)
    prime.backward()
    # The masks bite on some tokens and not on all, for the comparison to mean something.
    assert 0 < float(metrics["is_masked"].mean()) < 0.9, metrics["is_masked"]
    assert abs(float(prime.detach()) - result.metrics["loss"]) < 1e-5, (float(prime.detach()), result.metrics["loss"])
    worst = max(float((p.grad - g).abs().max()) for p, g in zip(policy.params, floe_grads))
    assert worst < 1e-5, worst
    assert max(float(g.abs().max()) for g in floe_grads) > 1e-4  # gradients are not trivially zero
