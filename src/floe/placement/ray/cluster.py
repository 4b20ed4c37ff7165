"""Connecting to Ray and reserving the zones' resources as placement-group bundles.

`connect`: "local" starts a Ray cluster inside this process (unless this process is already
connected, e.g. by a test session or a script that called `ray.init`), its workers not niced; "auto" joins the
cluster `ray start --head` started on this node; "ray://host:port" connects a Ray client.

Bundles (one placement group, strategy PACK: as few nodes as fit, spread when they must):
* not colocated: one bundle per policy rank {CPU: policy.cpus, GPU: policy.gpus}, then one per
  sampler replica, then the reference's (unless it lives in policy rank 0's actor);
* colocated: bundle i holds policy rank i AND sampler replica i (their CPUs and GPUs added), so
  the two share node and devices (fractional GPUs, e.g. 0.5 + 0.5 of one GPU);
`Layout` records which bundle each actor goes to.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from floe.config import RayPlacement
from floe.errors import InvalidInput, WorkerFailed

__all__ = ["Layout", "connect", "disconnect", "place", "release", "strategy"]


def connect(placement: RayPlacement) -> bool:
    """Connect this process to Ray as `placement.address` says; True when this call started
    the connection (so `disconnect` ends it), False when it was connected already."""
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"namespace": placement.namespace, "log_to_driver": True}
    if placement.address == "local":
        kwargs["include_dashboard"] = False
        # Ray starts its workers niced (15) by default: here they ARE the backend, and a busy
        # machine would starve them behind the driver.
        os.environ.setdefault("RAY_worker_niceness", "0")
    else:
        kwargs["address"] = placement.address
    try:
        ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise InvalidInput("placement.address", f"cannot connect to Ray at {placement.address!r}: {e}") from None
    return True


def disconnect(started: bool) -> None:
    """End the connection `connect` started (a cluster started in this process stops with it)."""
    if started and ray.is_initialized():
        ray.shutdown()


@dataclass
class Layout:
    """Bundle index of every actor: policy rank i → policy[i], sampler replica r → sampler[r],
    the reference actor → reference (None: it lives in policy rank 0's actor or is disabled)."""

    group: PlacementGroup
    policy: list[int] = field(default_factory=list)
    sampler: list[int] = field(default_factory=list)
    reference: int | None = None


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, **({"GPU": gpus} if gpus > 0 else {})}


def place(placement: RayPlacement, reference_actor: bool) -> Layout:
    """Reserve the bundles (module docstring); WorkerFailed("placement", 0) when the cluster
    cannot provide them within start_timeout_s (the message says what was asked for)."""
    p, s, r = placement.policy, placement.sampler, placement.reference
    bundles: list[dict[str, float]] = []
    policy_idx: list[int] = []
    sampler_idx: list[int] = []
    if placement.colocate:
        for _ in range(p.workers):
            policy_idx.append(len(bundles))
            sampler_idx.append(len(bundles))
            bundles.append(_bundle(p.cpus + s.cpus, p.gpus + s.gpus))
    else:
        for _ in range(p.workers):
            policy_idx.append(len(bundles))
            bundles.append(_bundle(p.cpus, p.gpus))
        for _ in range(s.workers):
            sampler_idx.append(len(bundles))
            bundles.append(_bundle(s.cpus, s.gpus))
    reference_idx = None
    if reference_actor:
        reference_idx = len(bundles)
        bundles.append(_bundle(r.cpus, r.gpus))
    group = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=placement.start_timeout_s)
    if not ready:
        remove_placement_group(group)
        raise WorkerFailed(
            "placement", 0,
            f"the cluster did not provide the bundles {bundles} within start_timeout_s = {placement.start_timeout_s:g} s "
            f"(it has {ray.cluster_resources()}); lower the workers/cpus/gpus per zone or add nodes",
        )
    return Layout(group, policy_idx, sampler_idx, reference_idx)


def strategy(layout: Layout, bundle: int) -> PlacementGroupSchedulingStrategy:
    """The scheduling strategy that puts an actor into `bundle` of the layout's group."""
    return PlacementGroupSchedulingStrategy(placement_group=layout.group, placement_group_bundle_index=bundle)


def release(layout: Layout | None) -> None:
    """Give the bundles back to the cluster."""
    if layout is not None:
        with contextlib.suppress(Exception):  # a cluster already gone has nothing to give back
            remove_placement_group(layout.group)
