"""The Ray placement: zones as Ray actors in one placement group (docs/scale.md).

`build_ray(config, tokenizer)` connects to Ray (`cluster.connect`), reserves the bundles
(`cluster.place`), starts the actors (`actors.py`: P policy ranks, R sampler replicas, the
reference on its own actor or in policy rank 0), joins the policy ranks into their policy
group and policy rank 0 and the replicas into the standalone sync group (`actors.py`), and
returns `placement.Zones` whose zones are driver-side proxies (`proxies.py`) and whose weight
sync is `sync.RayBroadcastSync`, `sync.RayObjectStoreSync` or `sync.RaySharedMemorySync` (which
needs every replica on policy rank 0's node: checked once the actors run, InvalidInput
"placement.sync" otherwise). Every wait is bounded: start-up
by placement.start_timeout_s, every zone call by placement.call_timeout_s (`calls.py`: a dead
or hung worker becomes WorkerFailed naming the zone and rank). `Zones.close()` kills the
actors, gives the bundles back and, when this backend started the cluster ("local"), stops it.

Importing this package imports Ray: the core of floe imports it only from `build_zones`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from floe.config import BackendConfig, RayPlacement

__all__ = ["build_ray"]


def build_ray(config: BackendConfig, tokenizer: PreTrainedTokenizerBase) -> Any:
    """`placement.Zones` for a Ray placement (see the module docstring). InvalidInput
    ("placement.address") when Ray cannot be reached; WorkerFailed when a worker does not start."""
    try:
        import ray  # noqa: PLC0415 - the optional stack, only when a Ray placement is built
    except ImportError:
        from floe.errors import InvalidInput  # noqa: PLC0415

        raise InvalidInput("placement.kind", "the Ray placement needs Ray: pip install 'floe-rl[ray]'") from None
    from floe.placement.ray import cluster  # noqa: PLC0415
    from floe.placement.ray.actors import PolicyRankHost, ReferenceHost, SamplerHost, remote_class  # noqa: PLC0415
    from floe.placement.ray.calls import PING_GROUPS, Call, gather, track, untrack  # noqa: PLC0415
    from floe.placement.ray.proxies import RayPolicy, RayReference, RaySamplerGroup  # noqa: PLC0415
    from floe.placement.ray.sync import RayBroadcastSync, RayObjectStoreSync, RaySharedMemorySync  # noqa: PLC0415
    from floe.placement.zones import Zones  # noqa: PLC0415

    placement = config.placement
    assert isinstance(placement, RayPlacement)
    began = time.monotonic()

    def left() -> float:
        """What is left of start_timeout_s: one bound for the whole start, connect included."""
        return max(placement.start_timeout_s - (time.monotonic() - began), 1.0)

    started = cluster.connect(placement)
    layout = None
    actors: list[Any] = []

    def close() -> None:
        untrack(actors)
        if placement.sync == "shared_memory" and actors:  # rank 0 unlinks its /dev/shm segment first
            with contextlib.suppress(Exception):  # a rank 0 already gone cannot (its segment outlives it)
                ray.get(actors[0].close_shared.remote(), timeout=10)
        for actor in actors:
            with contextlib.suppress(Exception):  # an actor already gone is closed
                ray.kill(actor)
        cluster.release(layout)
        cluster.disconnect(started)

    try:
        ref_cfg = placement.reference
        reference_actor = config.reference.enabled and not ref_cfg.colocate_with_policy
        layout = cluster.place(placement, reference_actor, left())
        values = config.model_dump(mode="json")
        gpu = config.device.startswith("cuda")
        p, s = placement.policy, placement.sampler
        # A "ping" concurrency group on every actor: at a deadline `calls.gather` asks each pending
        # worker for its pid on that thread, so a peer blocked in a collective answers and the
        # worker that hangs is the one named.
        policy_cls = remote_class(PolicyRankHost, concurrency_groups=PING_GROUPS)
        sampler_cls = remote_class(SamplerHost, concurrency_groups=PING_GROUPS)
        policy_actors = [
            policy_cls.options(num_cpus=p.cpus, num_gpus=p.gpus, scheduling_strategy=cluster.strategy(layout, b)).remote(
                values, i, config.reference.enabled and ref_cfg.colocate_with_policy and i == 0)
            for i, b in enumerate(layout.policy)
        ]
        actors += policy_actors
        sampler_actors = [
            sampler_cls.options(num_cpus=s.cpus, num_gpus=s.gpus, scheduling_strategy=cluster.strategy(layout, b)).remote(values, r)
            for r, b in enumerate(layout.sampler)
        ]
        actors += sampler_actors
        reference_host = None
        if reference_actor:
            assert layout.reference is not None
            reference_host = remote_class(ReferenceHost, concurrency_groups=PING_GROUPS).options(
                num_cpus=ref_cfg.cpus, num_gpus=ref_cfg.gpus, scheduling_strategy=cluster.strategy(layout, layout.reference)
            ).remote(values)
            actors.append(reference_host)
        for i, actor in enumerate(policy_actors):
            track("policy", i, actor)
        for r, actor in enumerate(sampler_actors):
            track("sampler", r, actor)
        if reference_host is not None:
            track("reference", 0, reference_host)
        # Every actor loaded its model (constructor errors surface here, naming the zone and rank).
        ready = [Call("policy", i, a.pid.remote()) for i, a in enumerate(policy_actors)]
        ready += [Call("sampler", r, a.pid.remote()) for r, a in enumerate(sampler_actors)]
        ready += [Call("reference", 0, reference_host.pid.remote())] if reference_host is not None else []
        gather(ready, left())
        if placement.sync == "shared_memory":
            nodes = gather([Call("policy", 0, policy_actors[0].node_id.remote()),
                            *(Call("sampler", r, a.node_id.remote()) for r, a in enumerate(sampler_actors))], left())
            away = [r for r, node in enumerate(nodes[1:]) if node != nodes[0]]
            if away:
                from floe.errors import InvalidInput  # noqa: PLC0415

                raise InvalidInput("placement.sync", f'"shared_memory" needs every sampler replica on policy rank 0\'s '
                                   f"node; replicas {away} run on other nodes: use \"broadcast\" (or place them on "
                                   "one node)")
        shape = gather([Call("policy", 0, policy_actors[0].shape.remote())], left())[0]
        address, policy_port, sync_port = gather([Call("policy", 0, policy_actors[0].rendezvous.remote())], left())[0]
        sync_world = 1 + len(sampler_actors)
        sync_backend = "nccl" if gpu and not placement.colocate else "gloo"
        timeout = placement.call_timeout_s
        gather([
            *(Call("policy", i, a.join_groups.remote(address, policy_port, len(policy_actors), sync_port, sync_world,
                                                      sync_backend, timeout)) for i, a in enumerate(policy_actors)),
            *(Call("sampler", r, a.join_groups.remote(address, sync_port, sync_world, sync_backend, timeout))
              for r, a in enumerate(sampler_actors)),
        ], left())
        policy = RayPolicy(policy_actors, timeout)
        sampler = RaySamplerGroup(sampler_actors, config.sampler.engine.name, config.seed, timeout)
        reference = None
        if config.reference.enabled:
            reference = RayReference(reference_host if reference_host is not None else policy_actors[0],
                                     reference_host is None, timeout)
        bucket_bytes = int(placement.sync_bucket_mb * 2**20)
        if placement.sync == "shared_memory":
            weight_sync: Any = RaySharedMemorySync(bucket_bytes, timeout, cuda_ipc=gpu and placement.colocate)
        else:
            weight_sync = (RayBroadcastSync if placement.sync == "broadcast" else RayObjectStoreSync)(bucket_bytes, timeout)
        modes = _Colocation(policy, sampler)
    except BaseException:
        close()
        raise

    def describe() -> dict[str, Any]:
        return {
            "kind": "ray", "address": placement.address, "namespace": placement.namespace,
            "policy_ranks": len(policy_actors), "sampler_replicas": len(sampler_actors),
            "reference": "off" if reference is None else ("policy rank 0" if reference_host is None else "own worker"),
            "colocate": placement.colocate, "sync": placement.sync, "sync_bucket_mb": placement.sync_bucket_mb,
            "call_timeout_s": placement.call_timeout_s, "device": config.device,
        }

    def memory() -> dict[str, Any]:
        out: dict[str, Any] = {"policy": policy.memory(), "sampler": sampler.memory()}
        if reference is not None:
            out["reference"] = {"where": config.device, "worker": "policy rank 0" if reference_host is None else "own"}
        return out

    def start_seconds() -> float | None:
        got = gather([Call("sampler", r, a.engine_start_seconds.remote()) for r, a in enumerate(sampler_actors)], timeout)
        known = [g for g in got if g is not None]
        return max(known) if known else None

    return Zones(
        policy=policy, sampler=sampler, reference=reference, weight_sync=weight_sync,
        vocab_size=int(shape["vocab_size"]), max_context=int(shape["max_context"]), colocated=placement.colocate,
        policy_devices=len(policy_actors), describe=describe, memory=memory, engine_start_seconds=start_seconds, switch_mode=modes.switch, _close=close,
    )


class _Colocation:
    """Sleep/wake of colocated zones: which of policy and sampler hold their devices per mode
    ("train": policy only; "sync": both; "sample": sampler only). A switch releases first
    (offload / sleep), then acquires (onload / wake), so the peak is the larger of the two."""

    WANT: ClassVar[dict[str, tuple[bool, bool]]] = {"train": (True, False), "sync": (True, True), "sample": (False, True)}

    def __init__(self, policy: Any, sampler: Any):
        self.policy = policy
        self.sampler = sampler
        self.policy_on = True
        self.sampler_awake = True

    def switch(self, mode: str) -> None:
        policy_on, sampler_awake = self.WANT[mode]
        if not policy_on and self.policy_on:
            self.policy.offload()
            self.policy_on = False
        if not sampler_awake and self.sampler_awake:
            self.sampler.sleep()
            self.sampler_awake = False
        if policy_on and not self.policy_on:
            self.policy.onload()
            self.policy_on = True
        if sampler_awake and not self.sampler_awake:
            self.sampler.wake()
            self.sampler_awake = True
