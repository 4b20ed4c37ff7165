"""prime-rl's [trainer.loss] -> floe loss: mapped exactly where floe can, refused by name elsewhere."""

from __future__ import annotations

import pytest

from floe.compute.losses import resolve_loss
from floe.errors import InvalidInput
from floe.integrations.prime_rl.loss_mapping import map_loss, native_loss


def test_unmasked_default_loss_maps_to_importance_sampling_with_k2_kl() -> None:
    m = map_loss({"dppo_mask_low": 1.0, "dppo_mask_high": 1.0, "adv_tau": 0.5, "kl_tau": 0.01})
    assert m.name == "importance_sampling"
    assert m.config == {"aggregation": "sum", "kl": {"coef": 0.02, "estimator": "k2"}}
    assert m.advantage_scale == 0.5 and m.ref_is_inference
    resolve_loss(m.name, m.config)  # floe accepts it as is


def test_ipo_without_mask_and_without_kl() -> None:
    m = map_loss({"type": "ipo", "ipo_threshold": 1.5, "kl_tau": 0})
    assert m.config == {"aggregation": "sum"} and not m.ref_is_inference and m.advantage_scale == 1.0


@pytest.mark.parametrize(("table", "field"), [
    (None, "trainer.loss.dppo_mask_low"),  # prime-rl's default masks at 0.2
    ({"dppo_mask_low": 1, "dppo_mask_high": 0.5}, "trainer.loss.dppo_mask_high"),
    ({"type": "ipo"}, "trainer.loss.ipo_threshold"),
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
