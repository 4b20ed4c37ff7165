"""BackendConfig.placement: local by default (numbers unchanged), Ray keys validated, and
combinations that cannot work refused naming the key, before anything loads. The Ray placement
itself runs in tests/ray (marker `ray`); the core suite never imports Ray."""

from __future__ import annotations

import sys

import pytest

import floe
from floe.config import LocalPlacement, RayPlacement
from floe.errors import InvalidInput


def test_local_is_the_default_and_info_says_so(make_client) -> None:
    assert isinstance(floe.BackendConfig(model="m").placement, LocalPlacement)
    info = make_client().info()
    assert info.capabilities["placement"] == {"kind": "local", "device": "cpu"}
    assert info.capabilities["zones_memory"]["policy"] == {"where": "cpu"}


def test_ray_keys_are_parsed_with_documented_defaults() -> None:
    cfg = floe.BackendConfig(model="m", placement={"kind": "ray", "policy": {"workers": 2}, "sampler": {"workers": 3}})
    p = cfg.placement
    assert isinstance(p, RayPlacement)
    assert (p.address, p.sync, p.colocate, p.policy.workers, p.sampler.workers) == ("local", "broadcast", False, 2, 3)
    assert p.reference.colocate_with_policy is False
    for sync in ("broadcast", "object_store", "shared_memory"):
        assert floe.BackendConfig(model="m", placement={"kind": "ray", "sync": sync}).placement.sync == sync  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("placement", "field", "words"),
    [
        ({"kind": "ray", "polcy": {}}, "placement.polcy", "unknown key"),
        ({"kind": "ray", "policy": {"workers": 0}}, "placement.policy.workers", "greater than or equal to 1"),
        ({"kind": "ray", "address": "10.0.0.1:6379"}, "placement.address", "ray://host:port"),
        ({"kind": "ray", "sync": "nccl"}, "placement.sync", "broadcast"),
        ({"kind": "ray", "colocate": True, "policy": {"workers": 2}}, "placement", "policy.workers (2) must equal sampler.workers (1)"),
        ({"kind": "ray", "sampler": {"gpus": 1}}, "BackendConfig", "placement.sampler.gpus = 1.0 with device = 'cpu'"),
        ({"kind": "local", "policy": {"workers": 2}}, "placement.policy", "unknown key"),
        ({"kind": "mars"}, "placement", "'local', 'ray'"),
        # strict types: no quoted numbers or words for booleans
        ({"kind": "ray", "colocate": "yes"}, "placement.colocate", "got 'yes'; write true or false"),
        ({"kind": "ray", "policy": {"workers": "2"}}, "placement.policy.workers", "got '2'; write a whole number"),
        ({"kind": "ray", "policy": {"cpus": "0.5"}}, "placement.policy.cpus", "got '0.5'; write a number"),
        ({"kind": "ray", "call_timeout_s": "1e9"}, "placement.call_timeout_s", "got '1e9'"),
        ({"kind": "ray", "sync_bucket_mb": 1e-9}, "placement.sync_bucket_mb", "greater than or equal to 1"),
        ({"kind": "ray", "reference": {"colocate_with_policy": True, "cpus": 8}}, "placement.reference",
         "reference.cpus has no effect with colocate_with_policy = true"),
        ({"kind": "ray", "address": "ray://"}, "placement.address", "is not \"ray://host:port\""),
        ({"kind": "ray", "address": "ray://head"}, "placement.address", "is not \"ray://host:port\""),
        ({"kind": "ray", "address": "ray://head:0"}, "placement.address", "is not \"ray://host:port\""),
    ],
)
def test_bad_placements_name_the_key(placement: dict, field: str, words: str) -> None:
    with pytest.raises(InvalidInput) as e:
        floe.BackendConfig(model="m", placement=placement)
    assert e.value.field in (f"BackendConfig.{field}", field)
    assert words in e.value.message


def test_a_cuda_device_needs_policy_gpus() -> None:
    with pytest.raises(InvalidInput, match="placement.policy.gpus = 0 with a cuda device"):
        floe.BackendConfig(model="m", device="cuda", placement={"kind": "ray"})


@pytest.mark.parametrize(
    ("placement", "extra", "words"),
    [
        ({"policy": {"gpus": 1}}, {}, "placement.sampler.gpus = 0 with a cuda device"),
        ({"policy": {"gpus": 1}, "sampler": {"gpus": 1}}, {}, "placement.reference.gpus = 0 with a cuda device"),
        ({"colocate": True, "policy": {"gpus": 1}, "sampler": {"gpus": 1}, "reference": {"colocate_with_policy": True}},
         {}, "policy.gpus + sampler.gpus (1 + 1) must be at most 1"),
    ],
)
def test_gpu_combinations_that_cannot_work_are_refused(placement: dict, extra: dict, words: str) -> None:
    with pytest.raises(InvalidInput) as e:
        floe.BackendConfig(model="m", device="cuda", placement={"kind": "ray", **placement}, **extra)
    assert words in e.value.message


def test_gpu_combinations_that_work_are_accepted() -> None:
    ok = [
        ({"policy": {"gpus": 1}, "sampler": {"gpus": 1}, "reference": {"colocate_with_policy": True}}, {}),
        ({"policy": {"gpus": 1}, "sampler": {"gpus": 0.5}}, {"reference": {"enabled": False}}),  # no reference actor
        ({"colocate": True, "policy": {"gpus": 0.5}, "sampler": {"gpus": 0.5}, "reference": {"gpus": 1}}, {}),
    ]
    for placement, extra in ok:
        cfg = floe.BackendConfig(model="m", device="cuda", placement={"kind": "ray", **placement}, **extra)
        assert isinstance(cfg.placement, RayPlacement)
    p = floe.BackendConfig(model="m", placement={"kind": "ray", "address": "ray://10.0.0.1:10001",
                                                  "sync_bucket_mb": 1, "policy": {"cpus": 1}}).placement
    assert isinstance(p, RayPlacement) and (p.address, p.sync_bucket_mb, p.policy.cpus) == ("ray://10.0.0.1:10001", 1, 1)


def test_the_core_suite_does_not_import_ray() -> None:
    import floe.backend
    import floe.placement  # noqa: F401

    assert "ray" not in sys.modules
