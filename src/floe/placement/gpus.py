"""A framework's GPU layout as a floe placement: the one place the integrations decide it.

verl and SkyRL describe their hardware as "G GPUs; training and generation share them and take
turns (the hybrid engine / `colocate_all`), or each keeps its memory". floe's placements cover
both (docs/scale.md):

* one GPU, nothing offloaded: every zone in one process on `cuda` (`LocalPlacement`): policy,
  reference and sampler stay resident and the sync is an in-place copy;
* otherwise: Ray actors (`RayPlacement`, `colocate = true`): policy rank i (FSDP2) and sampler
  replica i share GPU i, half a GPU each in Ray's accounting; the sampler sleeps while the policy
  trains and the policy offloads while the sampler generates; the reference lives in policy rank
  0's actor. `address = "auto"` joins the Ray cluster the framework already runs.

On the CPU there is nothing to place: the CPU is every zone's device and host memory is where
offloaded state would go anyway, so the layout is always local.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from floe.errors import InvalidInput

__all__ = ["GpuLayout", "check_cluster_gpus", "needs_gpu_process", "placement_for"]


@dataclass(frozen=True)
class GpuLayout:
    """What a framework asks of the hardware.

    `gpus`: GPUs of the run (0 = CPU only); `switching`: training and generation take turns
    on the same GPUs, each releasing its memory while the other runs (verl's param/optimizer
    offload and `free_cache_engine`, SkyRL's `colocate_all` and `cpu_offload`)."""

    gpus: int
    switching: bool


def placement_for(layout: GpuLayout) -> dict[str, Any]:
    """The `BackendConfig.placement` dict for `layout` (module docstring).

    Raises ValueError for a negative GPU count (callers name their own keys)."""
    if layout.gpus < 0:
        raise ValueError(f"gpus must be >= 0, got {layout.gpus}")
    if layout.gpus == 0 or (layout.gpus == 1 and not layout.switching):
        return {"kind": "local"}
    return {
        "kind": "ray", "address": "auto", "colocate": True,
        "policy": {"workers": layout.gpus, "gpus": 0.5},
        "sampler": {"workers": layout.gpus, "gpus": 0.5},
        "reference": {"colocate_with_policy": True},
    }


def needs_gpu_process(backend: Mapping[str, Any]) -> bool:
    """True when `backend` (a BackendConfig dict) runs every zone in one process on a GPU: that
    process must be one Ray gave the GPU to (Ray hides GPUs from tasks and actors it gave none;
    a Ray placement's own actors take theirs)."""
    kind = (backend.get("placement") or {}).get("kind", "local")
    return kind == "local" and str(backend.get("device", "cpu")).startswith("cuda")


def check_cluster_gpus(gpus: int, field: str, hint: str) -> None:
    """InvalidInput(`field`) when the connected Ray cluster has fewer than `gpus` GPUs (checked
    before any model loads; `hint` says how the user trains on the CPU instead)."""
    if not gpus:
        return
    import ray  # noqa: PLC0415 - only the integrations, which run on Ray, call this

    have = int(ray.cluster_resources().get("GPU", 0))
    if have < gpus:
        raise InvalidInput(field, f"the run asks for {gpus} GPUs but the Ray cluster has {have}; {hint}")
