"""prime-rl's [trainer.loss] -> floe loss: mapped exactly where floe can, refused by name elsewhere."""

from __future__ import annotations

import pytest

from floe.compute.losses import resolve_loss
from floe.errors import InvalidInput
from floe.integrations.prime_rl.loss_mapping import map_loss, native_loss


def test_default_loss_maps_to_dppo_with_its_trust_region_and_k2_kl() -> None:
    m = map_loss(None)  # prime-rl's defaults: masks 0.2, adv_tau 1, kl_tau 1e-3
    assert m.name == "dppo"
    assert m.config == {"divergence": "binary_tv", "delta_low": 0.2, "delta_high": 0.2, "surrogate": "ratio",
                        "aggregation": "sum", "kl": {"coef": 2e-3, "estimator": "k2"}}
    assert m.advantage_scale == 1.0 and m.ref_is_inference
    m = map_loss({"dppo_mask_low": 0.1, "dppo_mask_high": 0.3, "adv_tau": 0.5, "kl_tau": 0.01})
    assert (m.config["delta_low"], m.config["delta_high"], m.config["kl"]["coef"], m.advantage_scale) == (0.1, 0.3, 0.02, 0.5)
    resolve_loss(m.name, m.config)  # floe accepts it as is


def test_ipo_maps_to_a_symmetric_mask() -> None:
    m = map_loss({"type": "ipo", "ipo_threshold": 0.15, "kl_tau": 0})
    assert m.config == {"divergence": "tv", "delta_low": 0.15, "delta_high": 0.15, "surrogate": "ratio",
                        "aggregation": "sum"}
    assert not m.ref_is_inference and m.advantage_scale == 1.0
    resolve_loss(m.name, m.config)


@pytest.mark.parametrize(("table", "field"), [
    ({"dppo_mask_high": -0.5}, "trainer.loss.dppo_mask_high"),
    ({"type": "ipo", "ipo_threshold": True}, "trainer.loss.ipo_threshold"),
    ({"type": "ipo", "dppo_mask_low": 0.2}, "trainer.loss.dppo_mask_low"),
    ({"type": "custom", "import_path": "x.y"}, "trainer.loss.type"),
    ({"type": "grpo"}, "trainer.loss.type"),
    ({"dppo_mask_low": 1, "dppo_mask_high": 1, "clip": 0.2}, "trainer.loss.clip"),
    ({"dppo_mask_low": 1, "dppo_mask_high": 1, "kl_tau": -1}, "trainer.loss.kl_tau"),
])
def test_refusals_name_the_key(table, field) -> None:
    with pytest.raises(InvalidInput) as e:
        map_loss(table)
    assert e.value.field == field


def test_native_floe_loss() -> None:
    m = native_loss({"name": "ppo", "config": {"clip_low": 0.1}})
    assert (m.name, m.config) == ("ppo", {"clip_low": 0.1, "aggregation": "sum"})
    with pytest.raises(InvalidInput) as e:
        native_loss({"name": "no_such_loss"})  # not a registered floe loss
    assert e.value.field == "floe.loss.name"
    with pytest.raises(InvalidInput) as e:
        native_loss({"name": "ppo", "config": {"aggregation": "token_mean"}})
    assert e.value.field == "floe.loss.config.aggregation"
