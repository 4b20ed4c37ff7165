"""Connecting to Ray and reserving the zones' resources as placement-group bundles.

`connect`: "local" starts a Ray cluster inside this process (unless this process is already
connected, e.g. by a test session or a script that called `ray.init`), its workers not niced; "auto" joins the
cluster `ray start --head` started on this node; "ray://host:port" connects a Ray client, within
start_timeout_s. A process already connected keeps its connection, but a configured address or
namespace that contradicts it is refused (InvalidInput naming the key), never silently ignored.

`place` first compares the bundles with the cluster's resources (`ray.cluster_resources()`,
per node `ray.nodes()`): a demand that can never fit is refused at once, naming the keys and the
totals (InvalidInput("placement")); one that fits waits for free resources, logging while it
waits, until its deadline (StateError).

Bundles (one placement group, strategy PACK: as few nodes as fit, spread when they must):
* not colocated: one bundle per policy rank {CPU: policy.cpus, GPU: policy.gpus}, then one per
  sampler replica, then the reference's (unless it lives in policy rank 0's actor);
* colocated: bundle i holds policy rank i AND sampler replica i (their CPUs and GPUs added), so
  the two share node and devices (fractional GPUs, e.g. 0.5 + 0.5 of one GPU);
`Layout` records which bundle each actor goes to.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from floe.config import RayPlacement
from floe.errors import InvalidInput, StateError

__all__ = ["Layout", "connect", "disconnect", "place", "release", "strategy"]

log = logging.getLogger(__name__)


def connect(placement: RayPlacement) -> bool:
    """Connect this process to Ray as `placement.address` says; True when this call started
    the connection (so `disconnect` ends it), False when it was connected already (after checking
    that the connection is the one the config names: `_check_connection`). A Ray client or
    "auto" connection that does not succeed within start_timeout_s is InvalidInput
    ("placement.address"); starting a "local" cluster is bounded by Ray itself (seconds)."""
    if ray.is_initialized():
        _check_connection(placement)
        return False
    kwargs: dict[str, Any] = {"namespace": placement.namespace, "log_to_driver": True}
    if placement.address == "local":
        kwargs["include_dashboard"] = False
        # Ray starts its workers niced (15) by default: here they ARE the backend, and a busy
        # machine would starve them behind the driver.
        os.environ.setdefault("RAY_worker_niceness", "0")
        try:
            ray.init(**kwargs)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise InvalidInput("placement.address", f"cannot start a local Ray cluster: {_first_line(e)}") from None
        return True
    kwargs["address"] = placement.address
    _bounded_init(kwargs, placement)
    return True


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _bounded_init(kwargs: dict[str, Any], placement: RayPlacement) -> None:
    """`ray.init(**kwargs)` within start_timeout_s: Ray's client retries its connection for about
    30 s on its own, so the call runs in a daemon thread; one that gives up leaves that thread to
    end the connection should it succeed later."""
    outcome: dict[str, Any] = {}
    abandoned = threading.Event()

    def init() -> None:
        try:
            ray.init(**kwargs)
            outcome["ok"] = True
            if abandoned.is_set():
                ray.shutdown()
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            outcome["error"] = e

    thread = threading.Thread(target=init, name="floe-ray-connect", daemon=True)
    thread.start()
    thread.join(placement.start_timeout_s)
    if thread.is_alive():
        abandoned.set()
        raise InvalidInput("placement.address", f"cannot connect to Ray at {placement.address!r} within "
                           f"start_timeout_s = {placement.start_timeout_s:g} s; check the address and that "
                           "the cluster (its Ray client server, for ray://) is up")
    if "error" in outcome:
        raise InvalidInput("placement.address",
                           f"cannot connect to Ray at {placement.address!r}: {_first_line(outcome['error'])}")


def _check_connection(placement: RayPlacement) -> None:
    """InvalidInput naming the key when this process's Ray connection is not the one the config
    names: a namespace set in the config that differs (an unset namespace takes the
    connection's), or address = "ray://..." / "auto" while connected elsewhere. "local" reuses
    any connection (docs/scale.md)."""
    context = ray.get_runtime_context()
    current = context.namespace
    if "namespace" in placement.model_fields_set and placement.namespace != current:
        raise InvalidInput("placement.namespace", f"this process is already connected to Ray in namespace "
                           f"{current!r}, not {placement.namespace!r}; remove the key or connect with that namespace")
    address = placement.address
    client = bool(ray.util.client.ray.is_connected())
    if address.startswith("ray://") and not client:
        raise InvalidInput("placement.address", f"this process is already connected to a Ray cluster directly "
                           f"(not through a Ray client), so {address!r} cannot be used; use address = \"local\" "
                           "to reuse that connection, or run in a process that did not call ray.init")
    if address == "auto" and not client:
        wanted = None
        with contextlib.suppress(Exception):  # no `ray start` cluster on this node: nothing to compare
            from ray._private.services import canonicalize_bootstrap_address  # noqa: PLC0415

            wanted = canonicalize_bootstrap_address("auto")
        have = context.gcs_address
        if wanted and have and wanted != have:
            raise InvalidInput("placement.address", f"this process is connected to the Ray cluster at {have}, "
                               f"not to this node's `ray start` cluster at {wanted} (\"auto\"); use "
                               "address = \"local\" to reuse the connection")


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


def place(placement: RayPlacement, reference_actor: bool, timeout_s: float | None = None) -> Layout:
    """Reserve the bundles (module docstring) within `timeout_s` (default start_timeout_s).
    InvalidInput("placement") at once when the cluster can never provide them (`check_fits`);
    StateError when it has them but not free within the bound (the message says what was asked for)."""
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
    check_fits(placement, reference_actor, ray.cluster_resources(), _node_resources())
    bound = placement.start_timeout_s if timeout_s is None else timeout_s
    group = placement_group(bundles, strategy="PACK")
    deadline = time.monotonic() + bound
    ready: list[Any] = []
    while not ready:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _ = ray.wait([group.ready()], timeout=min(left, 10.0))
        if not ready and deadline - time.monotonic() > 0:
            log.info("waiting for the cluster to free %s for the zones (%.0f s left of start_timeout_s; free now: %s)",
                     _total(bundles), deadline - time.monotonic(), _short(ray.available_resources()))
    if not ready:
        remove_placement_group(group)
        raise StateError(
            f"placement: the cluster did not free {_total(bundles)} for the zones within start_timeout_s = "
            f"{placement.start_timeout_s:g} s (it has {_short(ray.cluster_resources())}, free "
            f"{_short(ray.available_resources())}: other work holds the rest); wait for it, or lower the "
            "workers/cpus/gpus per zone",
        )
    return Layout(group, policy_idx, sampler_idx, reference_idx)


def _node_resources() -> list[dict[str, float]]:
    with contextlib.suppress(Exception):  # a Ray client may not see the nodes: the totals still count
        return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
    return []


def _total(bundles: list[dict[str, float]]) -> str:
    keys = sorted({k for b in bundles for k in b})
    return ", ".join(f"{k} {sum(b.get(k, 0.0) for b in bundles):g}" for k in keys)


def _short(resources: dict[str, float]) -> str:
    return ", ".join(f"{k} {resources.get(k, 0.0):g}" for k in ("CPU", "GPU"))


def check_fits(placement: RayPlacement, reference_actor: bool, cluster: dict[str, float],
               nodes: list[dict[str, float]]) -> None:
    """InvalidInput("placement") when the zones' demand can never fit the cluster: its total CPUs
    or GPUs (`cluster`, as `ray.cluster_resources()`) are fewer than the bundles ask for, or one
    bundle is larger than every node (`nodes`, each node's resources; [] skips that check). The
    message names each zone's keys and both totals."""
    p, s, r = placement.policy, placement.sampler, placement.reference
    parts: dict[str, list[tuple[str, float]]] = {"CPU": [], "GPU": []}
    per_node: list[tuple[str, float, float]] = []
    if placement.colocate:
        parts["CPU"].append((f"{p.workers} × (policy.cpus {p.cpus:g} + sampler.cpus {s.cpus:g})", p.workers * (p.cpus + s.cpus)))
        parts["GPU"].append((f"{p.workers} × (policy.gpus {p.gpus:g} + sampler.gpus {s.gpus:g})", p.workers * (p.gpus + s.gpus)))
        per_node.append(("policy + sampler (colocated)", p.cpus + s.cpus, p.gpus + s.gpus))
    else:
        parts["CPU"] += [(f"policy.workers {p.workers} × policy.cpus {p.cpus:g}", p.workers * p.cpus),
                         (f"sampler.workers {s.workers} × sampler.cpus {s.cpus:g}", s.workers * s.cpus)]
        parts["GPU"] += [(f"policy.workers {p.workers} × policy.gpus {p.gpus:g}", p.workers * p.gpus),
                         (f"sampler.workers {s.workers} × sampler.gpus {s.gpus:g}", s.workers * s.gpus)]
        per_node += [("policy", p.cpus, p.gpus), ("sampler", s.cpus, s.gpus)]
    if reference_actor:
        parts["CPU"].append((f"reference.cpus {r.cpus:g}", r.cpus))
        parts["GPU"].append((f"reference.gpus {r.gpus:g}", r.gpus))
        per_node.append(("reference", r.cpus, r.gpus))
    for key, terms in parts.items():
        need = sum(v for _, v in terms)
        have = float(cluster.get(key, 0.0))
        if need > have + 1e-9:
            shown = " + ".join(t for t, v in terms if v > 0)
            raise InvalidInput("placement", f"the zones need {key} {need:g} ({shown}) but the Ray cluster has {key} "
                               f"{have:g} in all; lower the per-zone {key.lower()}s or workers, or add nodes")
    if nodes:
        for zone, cpus, gpus in per_node:
            if not any(n.get("CPU", 0.0) + 1e-9 >= cpus and n.get("GPU", 0.0) + 1e-9 >= gpus for n in nodes):
                raise InvalidInput("placement", f"one {zone} worker needs CPU {cpus:g}, GPU {gpus:g} on one node, but no "
                                   f"node of the Ray cluster has that much; lower its cpus/gpus or add a larger node")


def strategy(layout: Layout, bundle: int) -> PlacementGroupSchedulingStrategy:
    """The scheduling strategy that puts an actor into `bundle` of the layout's group."""
    return PlacementGroupSchedulingStrategy(placement_group=layout.group, placement_group_bundle_index=bundle)


def release(layout: Layout | None) -> None:
    """Give the bundles back to the cluster."""
    if layout is not None:
        with contextlib.suppress(Exception):  # a cluster already gone has nothing to give back
            remove_placement_group(layout.group)
