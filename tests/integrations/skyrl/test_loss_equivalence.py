"""One mini-batch in SkyRL's layout through SkyRL's own loss code and through floe: same loss,
same gradients (relative error < 1e-5).

SkyRL side (SkyRL 0.4.0's functions, in the SkyRL environment): the HF model scores the
left-padded `sequences` as SkyRL's model wrapper does (position ids = cumsum(mask) - 1,
temperature-scaled logits, the last R positions); the advantages are pre-scaled by
`apply_loss_reduction_to_advantages_minibatch`; the loss is `PolicyLossRegistry`'s function
plus `compute_approx_kl` + `masked_mean` (KL) and the masked entropy mean, as the worker adds
them (KL and entropy together included; clip_cov and kl_cov with the KL); with `off_policy_correction.*` set, the policy loss function itself applies SkyRL's
correction to the rollout log-probs it is given (every loss that calls it: regular, dual_clip,
gspo, sapo, cispo, rollout_is, dppo). floe side: the plugin's own `FloeDispatch.forward_backward` on an embedded backend built
from the same model, whose policy gradients are then compared parameter by parameter.
One case per SkyRL 0.4.0 PolicyLossType (and per variant: dppo's divergences, cispo's rollout
anchor), with inputs that take the clips / masks / selections (checked through the clip ratio);
the losses that read the rollout log-probs get rollout log-probs distinct from the old ones.
SkyRL runs the mini-batch as one micro-batch (micro_train_batch_size_per_gpu = 4 rows), the
setting under which clip_cov's and kl_cov's per-micro-batch statistics equal floe's per-call ones.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

import floe
from floe.models import make_tiny
from tests.conftest import backend_of

pytestmark = pytest.mark.skyrl

ROWS = [([11, 12, 13, 14], [20, 21, 22, 23, 24]), ([11, 12, 13, 14], [25, 26]), ([30, 31], [32, 33, 34, 35, 36, 37]),
        ([30, 31], [38, 39, 40])]  # two prompts, two samples each, ragged
CASES = [
    ("regular", "token_mean", {"use_kl_loss": True, "kl_loss_coef": 0.1}),
    ("dual_clip", "sequence_mean", {"use_kl_loss": True, "kl_loss_coef": 0.05, "kl_estimator_type": "k2"}),
    ("gspo", "sequence_mean", {"use_kl_loss": False}),
    ("cispo", "seq_mean_token_sum_norm", {"use_kl_loss": False}),
    ("regular", "prompt_mean", {"use_kl_loss": False, "use_entropy_loss": True, "entropy_loss_coef": 0.05}),
    ("gspo", "token_mean", {"use_kl_loss": True, "kl_loss_coef": 0.1, "eps_clip_low": 0.02, "eps_clip_high": 0.03,
                            "clips": True}),
    ("sapo", "sequence_mean", {"use_kl_loss": True, "kl_loss_coef": 0.1}),
    ("sapo", "token_mean", {"use_kl_loss": False, "sapo.tau_pos": 2.0, "sapo.tau_neg": 3.0}),
    ("dppo", "token_mean", {"use_kl_loss": True, "kl_loss_coef": 0.1, "dppo.delta_low": 0.0005, "dppo.delta_high": 0.0005,
                            "clips": True}),
    ("dppo", "sequence_mean", {"use_kl_loss": False, "dppo.dppo_type": "binary_kl", "dppo.delta_low": 1e-5,
                               "dppo.delta_high": 1e-5, "rollout": True, "clips": True}),
    ("rollout_is", "token_mean", {"use_kl_loss": False, "rollout": True, "clips": True}),
    ("cispo", "sequence_mean", {"use_kl_loss": True, "kl_loss_coef": 0.1, "cispo.cispo_anchor": "rollout", "rollout": True,
                                "cispo.cispo_eps_clip_low": 0.1, "cispo.cispo_eps_clip_high": 0.1, "clips": True}),
    ("importance_sampling", "token_mean", {"use_kl_loss": False}),
    # clip_cov: more candidates than tokens it drops, so the draw matters (same seed on both sides).
    ("clip_cov", "token_mean", {"use_kl_loss": False, "clip_cov.clip_ratio": 0.1, "clip_cov.clip_cov_lb": -5.0,
                                "clip_cov.clip_cov_ub": 5.0, "clips": True}),
    ("kl_cov", "sequence_mean", {"use_kl_loss": False, "kl_cov.kl_cov_frac": 0.2, "kl_cov.ppo_kl_coef": 0.5}),
    # with SkyRL's KL loss (its clip_cov / kl_cov recipes): floe's kl.aggregation seq_mean_token_mean
    ("clip_cov", "token_mean", {"use_kl_loss": True, "kl_loss_coef": 0.2, "clip_cov.clip_ratio": 0.1,
                                "clip_cov.clip_cov_lb": -5.0, "clip_cov.clip_cov_ub": 5.0, "clips": True}),
    ("kl_cov", "sequence_mean", {"use_kl_loss": True, "kl_loss_coef": 0.2, "kl_estimator_type": "k1",
                                 "kl_cov.kl_cov_frac": 0.2, "kl_cov.ppo_kl_coef": 0.5}),
    # KL and entropy together: the KL by its own aggregation, the entropy in the weights
    ("regular", "sequence_mean", {"use_kl_loss": True, "kl_loss_coef": 0.2, "use_entropy_loss": True,
                                  "entropy_loss_coef": 0.05}),
    ("gspo", "prompt_mean", {"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_estimator_type": "k2",
                             "use_entropy_loss": True, "entropy_loss_coef": 0.05}),
]
SEED = 2024  # torch's default generator before each side (clip_cov draws the tokens it drops)
OPC = "off_policy_correction."
# Off-policy correction (SkyRL's compute_off_policy_correction inside its policy losses): each mode once.
OFF_POLICY_CASES = [
    ("regular", "token_mean", {"use_kl_loss": True, "kl_loss_coef": 0.1, OPC + "tis_ratio_type": "token",
                               OPC + "token_tis_ratio_clip_high": 1.2}),
    ("dual_clip", "sequence_mean", {"use_kl_loss": True, "kl_loss_coef": 0.05, "kl_estimator_type": "k2",
                                    OPC + "tis_ratio_type": "sequence", OPC + "sequence_tis_ratio_clip_high": 1.5,
                                    OPC + "sequence_mask_metric": "geometric", OPC + "geo_mask_low": 0.9,
                                    OPC + "geo_mask_high": 1.1}),
    ("gspo", "sequence_mean", {"use_kl_loss": False, OPC + "tis_ratio_type": "token", OPC + "token_tis_ratio_clip_high": 1.3,
                               OPC + "token_mask_is_threshold_low": 0.8, OPC + "token_mask_is_threshold_high": 1.25}),
    ("cispo", "seq_mean_token_sum_norm", {"use_kl_loss": False, OPC + "sequence_mask_metric": "product",
                                          OPC + "product_mask_low": 0.6, OPC + "product_mask_high": 1.6,
                                          OPC + "outlier_token_is_threshold_high": 1.5}),
    ("regular", "prompt_mean", {"use_kl_loss": False, "use_entropy_loss": True, "entropy_loss_coef": 0.05,
                                OPC + "outlier_token_is_threshold_low": 0.7, OPC + "tis_ratio_type": "token"}),
    # the losses branch's losses that call apply_off_policy_correction too (mapping.OFF_POLICY_LOSSES)
    ("sapo", "sequence_mean", {"use_kl_loss": True, "kl_loss_coef": 0.1, OPC + "tis_ratio_type": "token",
                               OPC + "token_tis_ratio_clip_high": 1.2, OPC + "outlier_token_is_threshold_high": 1.5}),
    ("dppo", "token_mean", {"use_kl_loss": False, "dppo.delta_low": 0.05, "dppo.delta_high": 0.05,
                            OPC + "tis_ratio_type": "sequence", OPC + "sequence_tis_ratio_clip_high": 1.5,
                            OPC + "sequence_mask_metric": "geometric", OPC + "geo_mask_low": 0.9, OPC + "geo_mask_high": 1.1}),
    ("rollout_is", "token_mean", {"use_kl_loss": False, "eps_clip_low": 0.5, "eps_clip_high": 0.5,
                                  OPC + "tis_ratio_type": "token", OPC + "token_tis_ratio_clip_high": 1.3,
                                  OPC + "token_mask_is_threshold_low": 0.8, OPC + "token_mask_is_threshold_high": 1.25}),
    # cispo's rollout anchor is its own correction: masks only (TIS is refused, as SkyRL raises)
    ("cispo", "sequence_mean", {"use_kl_loss": False, "cispo.cispo_anchor": "rollout", OPC + "sequence_mask_metric": "product",
                                OPC + "product_mask_low": 0.6, OPC + "product_mask_high": 1.6}),
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("skyrl-eq") / "tiny", hidden_size=64, num_hidden_layers=2)


def skyrl_cfg(loss_type: str, reduction: str, extra: dict):
    from skyrl.train.config import SkyRLTrainConfig  # noqa: PLC0415 - SkyRL only exists in its own environment

    args = [f"trainer.algorithm.policy_loss_type={loss_type}", f"trainer.algorithm.loss_reduction={reduction}",
            "trainer.algorithm.eps_clip_low=0.1", "trainer.algorithm.eps_clip_high=0.15", "trainer.algorithm.clip_ratio_c=2.0",
            "trainer.algorithm.max_seq_len=9", "trainer.algorithm.temperature=0.9", "trainer.micro_train_batch_size_per_gpu=4",
            "trainer.algorithm.cispo.cispo_eps_clip_low=0.5", "trainer.algorithm.cispo.cispo_eps_clip_high=0.5"]
    args += [f"trainer.algorithm.{k}={v}" for k, v in extra.items() if k not in ("rollout", "clips")]
    return SkyRLTrainConfig.from_cli_overrides(args)


@pytest.mark.parametrize(("loss_type", "reduction", "extra"), CASES + OFF_POLICY_CASES,
                         ids=[f"{c[0]}-{c[1]}" + ("-opc" if any(k.startswith(OPC) for k in c[2]) else "")
                              for c in CASES + OFF_POLICY_CASES])
def test_skyrl_loss_and_gradients_match_floe(model_path: Path, loss_type: str, reduction: str, extra: dict) -> None:
    # imports marked PLC0415: SkyRL only exists in its own environment (marker skyrl)
    from dataclasses import asdict  # noqa: PLC0415

    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch  # noqa: PLC0415
    from skyrl.backends.skyrl_train.utils.ppo_utils import (  # noqa: PLC0415
        PolicyLossRegistry,
        apply_loss_reduction_to_advantages_minibatch,
        compute_approx_kl,
    )
    from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean  # noqa: PLC0415
    from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from floe.integrations.skyrl.dispatch import FloeDispatch  # noqa: PLC0415
    from floe.integrations.skyrl.mapping import map_loss  # noqa: PLC0415

    cfg = skyrl_cfg(loss_type, reduction, extra)
    algo = cfg.trainer.algorithm
    g = torch.Generator().manual_seed(7)
    seq, att, resp, _, loss_mask, _, _, _ = convert_prompts_responses_to_batch_tensors(
        0, [p for p, _ in ROWS], [r for _, r in ROWS], [[0.0] * len(r) for _, r in ROWS],
        [[1] * len(r) for _, r in ROWS])
    loss_mask = loss_mask.float()
    loss_mask[0, -2] = 0.0  # one masked token inside a response
    width = resp.shape[1]

    # -- SkyRL: its model-wrapper scoring and its loss functions ----------------------------------
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    model.eval()
    pos = att.long().cumsum(-1) - 1
    pos.masked_fill_(att == 0, 1)
    logits = model(seq, attention_mask=att, position_ids=pos).logits.float() / algo.temperature
    logsm = torch.log_softmax(logits[:, :-1], dim=-1)
    logp = logsm.gather(-1, seq[:, 1:, None])[..., 0][:, -width:]
    entropy = -(logsm.exp() * logsm).sum(-1)[:, -width:]
    with torch.no_grad():
        old = (logp + (torch.rand(logp.shape, generator=g) - 0.5) * 0.4) * resp
        ref = (logp + (torch.rand(logp.shape, generator=g) - 0.5) * 0.6) * resp
        if any(k.startswith(OPC) for k in extra):
            rollout = (old + torch.randn(old.shape, generator=g) * 0.3) * resp  # the sampler's log-probs
        elif extra.get("rollout"):  # rollout log-probs apart from the old ones: a loss that reads the wrong one fails
            rollout = (logp + (torch.rand(logp.shape, generator=g) - 0.5) * 0.5) * resp
        else:
            rollout = None
    adv = torch.tensor([[1.3], [-0.7], [0.4], [-1.1]]).expand(-1, width) * resp
    if any(k.startswith(OPC) for k in extra):  # the correction bites: weights != 1 and/or rejected tokens
        from skyrl.backends.skyrl_train.utils.off_policy_correction_utils import (  # noqa: PLC0415
            compute_off_policy_correction,
        )
        tis, _, corrected = compute_off_policy_correction(old, rollout, loss_mask, algo.off_policy_correction)
        assert tis is not None or bool((corrected < loss_mask).any())
        assert tis is None or bool(((tis - 1).abs() > 0.01).any())
        assert corrected.sum() > 0
    adv_pre = apply_loss_reduction_to_advantages_minibatch(adv, loss_mask, reduction, micro_batch_size=4, max_seq_len=9,
                                                           prompt_boundaries=[(0, 2), (2, 4)])
    torch.manual_seed(SEED)
    policy_loss, _ = PolicyLossRegistry.get(loss_type)(logp, old, adv_pre, config=algo, loss_mask=loss_mask,
                                                       rollout_logprobs=rollout)
    total = policy_loss
    if algo.use_kl_loss:
        kl = compute_approx_kl(logp, ref, loss_mask=loss_mask, kl_estimator_type=algo.kl_estimator_type)
        total = total + masked_mean(kl, loss_mask, dim=-1).mean() * algo.kl_loss_coef
    if algo.use_entropy_loss:
        total = total - masked_mean(entropy, loss_mask) * algo.entropy_loss_coef
    total.backward()
    skyrl_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    # -- floe through the plugin's dispatch ---------------------------------------------------------
    data = TrainingInputBatch({"sequences": seq, "attention_mask": att, "response_mask": resp, "loss_mask": loss_mask,
                               "advantages": adv_pre, "action_log_probs": old, "base_action_log_probs": ref,
                               **({"rollout_logprobs": rollout} if rollout is not None else {})})
    data.metadata = {"response_length": width}
    client = floe.connect(floe.BackendConfig(model=str(model_path), state_dir=str(model_path.parent / "states")))
    try:
        dispatch = FloeDispatch(cfg, client, map_loss(asdict(algo)), Counter(), None, None, None)  # type: ignore[arg-type]
        torch.manual_seed(SEED)
        out = dispatch.forward_backward("policy", data)
        if extra.get("clips"):  # the clip / mask / selection is exercised, not everywhere
            assert 0 < out.metrics["loss_metrics/clip_ratio"] < 1
        assert out.metrics["final_loss"] == pytest.approx(float(total.detach()), rel=1e-5, abs=1e-6)  # fp32 noise ~1e-7
        policy = backend_of(client).policy.model
        floe_grads = {n: p.grad for n, p in policy.named_parameters()}
    finally:
        client.close()
    assert floe_grads.keys() == skyrl_grads.keys()
    diff = torch.sqrt(sum(((floe_grads[n] - skyrl_grads[n]) ** 2).sum() for n in skyrl_grads))
    norm = torch.sqrt(sum((skyrl_grads[n] ** 2).sum() for n in skyrl_grads))
    assert norm > 0 and float(diff / norm) < 1e-5, (float(diff), float(norm))


def test_floes_off_policy_table_is_skyrls() -> None:
    """The keys and defaults mapping.off_policy_correction validates against are SkyRL's own."""
    from dataclasses import asdict  # noqa: PLC0415

    from skyrl.train.config.config import AlgorithmConfig, OffPolicyCorrectionConfig  # noqa: PLC0415

    from floe.integrations.skyrl.mapping import DEPRECATED_TIS, OFF_POLICY_DEFAULTS  # noqa: PLC0415

    assert asdict(OffPolicyCorrectionConfig()) == OFF_POLICY_DEFAULTS
    algo = asdict(AlgorithmConfig())
    assert {k: algo[k] for k in DEPRECATED_TIS} == DEPRECATED_TIS
