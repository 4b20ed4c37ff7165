"""The processes of the Ray placement: one actor class per zone kind, hosting the zone objects.

Each actor is a plain class here, turned into a Ray actor class by `remote_class` (so importing
this module needs no Ray). An actor receives the BackendConfig as JSON values, loads its model
from `config.model` itself (no model crosses a process boundary), and keeps torch to
`config.num_threads or 1` intra-op threads (several actors share a node's cores).

torch.distributed: the policy ranks and the sampler replicas form one world (global ranks:
policy 0..P-1, then replicas P..P+R-1; gloo on CPU, NCCL on GPU), created by
`init_distributed` on all of them at once, with two subgroups: the policy group (FSDP2 over
the P ranks, `backend.policy_sharded.ShardedPolicyZone`) and the sync group (policy rank 0 and
every replica: the weight broadcast, `backend.sync.broadcast`). When policy and sampler share
GPUs (colocation) the sync group is gloo: NCCL cannot have two ranks on one device. The
collectives' timeout is `placement.call_timeout_s`, so a dead peer ends a collective with an
error instead of a hang. The reference actor is not part of the world.

Zone calls arrive as `call(method, *args)`: the zone's own method (the protocols of
`backend.zones` / the rank contract of `ShardedPolicyZone`), so the proxies choose what runs.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from floe.config import BackendConfig
from floe.models import load_model, load_tokenizer
from floe.models.loading import context_length

__all__ = ["PolicyRankHost", "ReferenceHost", "SamplerHost", "remote_class"]


def remote_class(cls: type, **options: Any) -> Any:
    """`cls` as a Ray actor class (Ray imported here, only when a Ray placement is built)."""
    import ray  # noqa: PLC0415 - Ray only in a Ray placement

    return ray.remote(**options)(cls) if options else ray.remote(cls)


class _Host:
    """What every zone actor shares: config, threads, seed, device, and the zone call."""

    zone: Any = None

    def __init__(self, config: dict[str, Any]):
        self.config = BackendConfig.model_validate(config)
        torch.set_num_threads(self.config.num_threads or 1)
        torch.manual_seed(self.config.seed)
        device = self.config.device
        self.device = torch.device("cuda", 0) if device.startswith("cuda") else torch.device(device)

    def _load(self, source: str) -> Any:
        c = self.config
        return load_model(source, c.dtype, str(self.device), c.trust_remote_code, c.attn_implementation)

    def call(self, method: str, *args: Any) -> Any:
        """The hosted zone's `method(*args)`."""
        return getattr(self.zone, method)(*args)

    def get(self, *names: str) -> tuple[Any, ...]:
        """The hosted zone's attributes `names` (e.g. step, pending_calls)."""
        return tuple(getattr(self.zone, name) for name in names)

    def pid(self) -> int:
        return os.getpid()


class _WorldMember(_Host):
    """An actor that joins the policy/sampler torch.distributed world."""

    def rendezvous(self) -> tuple[str, int]:
        """(this node's address, a free TCP port on it): the world's store, asked of global rank 0."""
        import ray  # noqa: PLC0415

        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def init_distributed(
        self, address: str, port: int, world_size: int, rank: int, policy_ranks: list[int], sync_ranks: list[int],
        sync_backend: str, timeout_s: float,
    ) -> None:
        """Join the world and create both subgroups (collective over the whole world)."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", world_size=world_size, rank=rank,
                                timeout=timeout)
        policy_group = dist.new_group(policy_ranks, backend=backend, timeout=timeout)
        sync_group = dist.new_group(sync_ranks, backend=sync_backend, timeout=timeout)
        self.sync_backend = sync_backend
        self._joined(policy_group, sync_group)

    def _joined(self, policy_group: Any, sync_group: Any) -> None:
        raise NotImplementedError


class PolicyRankHost(_WorldMember):
    """One policy rank (`ShardedPolicyZone`), plus the reference model in rank 0 when
    `placement.reference.colocate_with_policy`."""

    def __init__(self, config: dict[str, Any], rank: int, with_reference: bool):
        super().__init__(config)
        self.rank = rank
        self.model = self._load(self.config.model)
        self.reference = None
        if with_reference:
            from floe.backend.reference import ReferenceZone  # noqa: PLC0415

            source = self.config.reference.checkpoint or self.config.model
            self.reference = ReferenceZone(self._load(source), self.config.compute, source)

    def shape(self) -> dict[str, int]:
        """vocab_size and max_context of the model (the Backend validates requests with them)."""
        return {"vocab_size": int(self.model.config.vocab_size), "max_context": context_length(self.model.config)}

    def _joined(self, policy_group: Any, sync_group: Any) -> None:
        from floe.backend.policy_sharded import ShardedPolicyZone  # noqa: PLC0415

        self.zone = ShardedPolicyZone(self.model, self.config.optimizer, self.config.compute, policy_group, self.device)
        self.sync_group = sync_group
        del self.model

    def reference_forward(self, *args: Any) -> Any:
        assert self.reference is not None
        return self.reference.forward(*args)

    def _buckets(self, bucket_bytes: int) -> Any:
        for bucket in self.zone.full_tensor_buckets(bucket_bytes):
            if self.sync_backend == "gloo":
                bucket = {k: v.cpu() for k, v in bucket.items()}
            yield bucket

    def send_weights(self, bucket_bytes: int) -> tuple[dict[str, Any], int] | None:
        """Broadcast sync, policy side (collective over the policy group; rank 0 also over the
        sync group): the full tensors, bucket by bucket. Rank 0 returns (fingerprints, bytes)."""
        from floe.backend.sync.broadcast import send_weights  # noqa: PLC0415

        if self.rank == 0:
            return send_weights(self.sync_group, 0, self._buckets(bucket_bytes))
        for _ in self.zone.full_tensor_buckets(bucket_bytes):
            pass  # the other ranks take part in every gather
        return None

    def put_weights(self, bucket_bytes: int) -> tuple[list[Any], dict[str, Any], int] | None:
        """Object-store sync, policy side (collective): rank 0 puts each bucket (plain CPU
        tensors) into Ray's object store and returns (object refs, fingerprints, bytes)."""
        import ray  # noqa: PLC0415

        from floe.backend.sync.base import fingerprints  # noqa: PLC0415

        refs, prints, size = [], {}, 0
        for bucket in self.zone.full_tensor_buckets(bucket_bytes):
            if self.rank == 0:
                bucket = {k: v.detach().cpu().contiguous() for k, v in bucket.items()}
                prints.update(fingerprints(bucket))
                size += sum(t.numel() * t.element_size() for t in bucket.values())
                refs.append(ray.put(bucket))
        return (refs, prints, size) if self.rank == 0 else None


class SamplerHost(_WorldMember):
    """One sampler replica (`backend.sampler.SamplerZone` around the configured engine)."""

    def __init__(self, config: dict[str, Any], replica: int):
        super().__init__(config)
        from floe.backend.sampler import SamplerZone  # noqa: PLC0415
        from floe.sampler import EngineSource, build_engine  # noqa: PLC0415
        from floe.sampler.registry import engine_start_seconds  # noqa: PLC0415

        c = self.config
        self.replica = replica
        tokenizer = load_tokenizer(c.tokenizer or c.model, c.trust_remote_code)
        engine = build_engine(c.sampler.engine, EngineSource(self._load(c.model), c.model, tokenizer, c.trust_remote_code))
        self.zone = SamplerZone(engine, c.sampler.engine.name, c.seed)
        self.start_seconds = engine_start_seconds(engine)

    def engine_start_seconds(self) -> float | None:
        return self.start_seconds

    def _joined(self, policy_group: Any, sync_group: Any) -> None:
        self.sync_group = sync_group

    def receive_weights(self) -> dict[str, Any]:
        """Broadcast sync, replica side: every bucket from policy rank 0 into the engine; the
        fingerprints of everything it holds afterwards (StateError, weights incomplete, when a
        tensor is missing)."""
        from floe.backend.sync.broadcast import receive_into  # noqa: PLC0415

        where = torch.device("cpu") if self.sync_backend == "gloo" else self.device
        return receive_into(self.zone, self.sync_group, 0, where)

    def take_weights(self, refs: list[Any], timeout_s: float) -> dict[str, Any]:
        """Object-store sync, replica side: the buckets behind `refs`, one at a time."""
        from floe.placement.ray.calls import fetch  # noqa: PLC0415

        self.zone.begin_receive()
        for ref in refs:
            (bucket,) = fetch([ref], "sampler", self.replica, timeout_s)
            self.zone.receive_bucket(bucket)
        return self.zone.end_receive()


class ReferenceHost(_Host):
    """The reference zone on its own worker."""

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        from floe.backend.reference import ReferenceZone  # noqa: PLC0415

        source = self.config.reference.checkpoint or self.config.model
        self.zone = ReferenceZone(self._load(source), self.config.compute, source)

