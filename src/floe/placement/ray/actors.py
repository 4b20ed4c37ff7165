"""The processes of the Ray placement: one actor class per zone kind, hosting the zone objects.

Each actor is a plain class here, turned into a Ray actor class by `remote_class` (so importing
this module needs no Ray). An actor receives the BackendConfig as JSON values, loads its model
from `config.model` itself (no model crosses a process boundary), and keeps torch to
`config.num_threads or 1` intra-op threads (several actors share a node's cores).

torch.distributed: two groups, joined by `join_groups` on every policy rank and replica at once.
* The policy group: the P policy ranks' own default (WORLD) process group (ranks 0..P-1;
  gloo on CPU, NCCL on GPU), over which FSDP2 shards the model
  (`backend.policy_sharded.ShardedPolicyZone`).
* The sync group: policy rank 0 (sync rank 0) and every replica r (sync rank 1 + r), the
  weight broadcast (`backend.sync.broadcast`). It is a standalone group on its own TCPStore
  (`backend.sync.groups.standalone_group`), never a default group: a sampler's engine may own
  its process's default group (vLLM's in-process engine initialises one, a world of 1), so a
  replica joins no default group at all. When policy and sampler share GPUs (colocation) the
  sync group is gloo: NCCL cannot have two ranks on one device.
Both rendezvous at policy rank 0's node (`rendezvous`: two free ports). The collectives'
timeout is `placement.call_timeout_s`, so a dead peer ends a collective with an error instead
of a hang. The reference actor is in neither group.

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

    def node_id(self) -> str:
        """The Ray node this actor runs on (placement.sync = "shared_memory" needs one node)."""
        import ray  # noqa: PLC0415

        return str(ray.get_runtime_context().get_node_id())


class _GroupMember(_Host):
    """An actor that joins the sync group (and, on a policy rank, the policy group)."""

    sync_group: Any = None
    sync_backend: str = "gloo"

    def rendezvous(self) -> tuple[str, int, int]:
        """(this node's address, two distinct free TCP ports on it): where the policy group's
        and the sync group's stores listen, asked of policy rank 0."""
        import ray  # noqa: PLC0415

        with socket.socket() as a, socket.socket() as b:
            a.bind(("", 0))
            b.bind(("", 0))
            ports = int(a.getsockname()[1]), int(b.getsockname()[1])
        return ray.util.get_node_ip_address(), *ports

    def _join_sync(self, address: str, port: int, sync_rank: int, sync_world: int, sync_backend: str,
                   timeout_s: float) -> None:
        from floe.backend.sync.groups import standalone_group  # noqa: PLC0415

        self.sync_group = standalone_group(sync_backend, address, port, sync_rank, sync_world, timeout_s)
        self.sync_backend = sync_backend


class PolicyRankHost(_GroupMember):
    """One policy rank (`ShardedPolicyZone`; `ShardedLoraPolicyZone` with `[lora]`), plus the reference model in rank 0 when
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

    def join_groups(self, address: str, policy_port: int, policy_world: int, sync_port: int, sync_world: int,
                    sync_backend: str, timeout_s: float) -> None:
        """Collective over every policy rank and replica: join the policy group (this process's
        default group, `policy_world` ranks) and, on rank 0, the sync group (as sync rank 0 of
        `sync_world`); then shard the model over the policy group."""
        from floe.backend.policy_sharded import ShardedPolicyZone  # noqa: PLC0415

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{address}:{policy_port}", world_size=policy_world,
                                rank=self.rank, timeout=timedelta(seconds=timeout_s))
        if self.rank == 0:
            self._join_sync(address, sync_port, 0, sync_world, sync_backend, timeout_s)
        c = self.config
        if c.lora is not None:  # the base frozen, a peft adapter trained (the reference and samplers load the base)
            from floe.backend.policy_sharded_lora import ShardedLoraPolicyZone  # noqa: PLC0415
            from floe.models.lora import AdapterHost  # noqa: PLC0415

            self.zone = ShardedLoraPolicyZone(AdapterHost(self.model, c.model), c.lora, c.seed, c.optimizer, c.compute,
                                              dist.group.WORLD, self.device)
        else:
            self.zone = ShardedPolicyZone(self.model, c.optimizer, c.compute, dist.group.WORLD, self.device)
        del self.model

    def reference_forward(self, *args: Any) -> Any:
        assert self.reference is not None
        return self.reference.forward(*args)

    def _buckets(self, bucket_bytes: int, dtypes: dict[str, str] | None) -> Any:
        from floe.backend.sync.base import cast_tensors, on_cpu  # noqa: PLC0415

        for bucket in self.zone.full_tensor_buckets(bucket_bytes):
            bucket = cast_tensors(bucket, dtypes or {})  # the dtypes the replicas hold
            if self.sync_backend == "gloo":
                bucket = on_cpu(bucket)
            yield bucket

    def send_weights(self, bucket_bytes: int, dtypes: dict[str, str] | None = None) -> tuple[dict[str, Any], int] | None:
        """Broadcast sync, policy side (collective over the policy group; rank 0 also over the
        sync group): the full tensors, cast to `dtypes` (what the replicas hold), bucket by
        bucket. Rank 0 returns (fingerprints of the cast tensors, bytes)."""
        from floe.backend.sync.broadcast import send_weights  # noqa: PLC0415

        if self.rank == 0:
            return send_weights(self.sync_group, 0, self._buckets(bucket_bytes, dtypes))
        for _ in self.zone.full_tensor_buckets(bucket_bytes):
            pass  # the other ranks take part in every gather
        return None

    def put_weights(self, bucket_bytes: int, dtypes: dict[str, str] | None = None
                    ) -> tuple[list[Any], dict[str, Any], int] | None:
        """Object-store sync, policy side (collective): rank 0 puts each bucket (plain CPU
        tensors, cast to `dtypes`: what the replicas hold) into Ray's object store and returns
        (object refs, fingerprints of the cast tensors, bytes)."""
        import ray  # noqa: PLC0415

        from floe.backend.sync.base import cast_tensors  # noqa: PLC0415
        from floe.backend.weights import fingerprints  # noqa: PLC0415

        refs, prints, size = [], {}, 0
        for bucket in self.zone.full_tensor_buckets(bucket_bytes):
            if self.rank == 0:
                bucket = {k: v.detach().cpu().contiguous() for k, v in cast_tensors(bucket, dtypes or {}).items()}
                prints.update(fingerprints(bucket))
                size += sum(t.numel() * t.element_size() for t in bucket.values())
                refs.append(ray.put(bucket))
        return (refs, prints, size) if self.rank == 0 else None

    segment: Any = None  # rank 0's shared-memory segment (placement.sync = "shared_memory")

    def write_shared(self, bucket_bytes: int, dtypes: dict[str, str] | None = None, cuda_ipc: bool = False
                     ) -> tuple[str, dict[str, Any], int] | None:
        """Shared-memory sync, policy side (collective): rank 0 writes every bucket, cast to
        `dtypes` (what the replicas hold), into its segment (`backend.sync.shared`; on the GPU
        with CUDA IPC when `cuda_ipc`) and returns (the handle as a JSON string, fingerprints of
        the cast tensors, bytes written)."""
        import json  # noqa: PLC0415

        from floe.backend.sync.base import cast_tensors  # noqa: PLC0415
        from floe.backend.sync.shared import SharedSegment  # noqa: PLC0415

        source = self.zone.full_tensor_buckets(bucket_bytes)
        if self.rank != 0:
            for _ in source:
                pass  # the other ranks take part in every gather
            return None
        if self.segment is None:
            self.segment = SharedSegment()
        try:
            handle, prints, size = self.segment.write((cast_tensors(b, dtypes or {}) for b in source), cuda_ipc)
        except BaseException:
            for _ in source:
                pass  # finish the gathers the other ranks are in, then fail
            raise
        return json.dumps(handle), prints, size

    def close_shared(self) -> None:
        """Unlink the shared-memory segment (the placement's close, before the actor is killed)."""
        if self.segment is not None:
            self.segment.close()
            self.segment = None


class SamplerHost(_GroupMember):
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

    def join_groups(self, address: str, sync_port: int, sync_world: int, sync_backend: str, timeout_s: float) -> None:
        """Collective with policy rank 0 and the other replicas: join the sync group as sync
        rank 1 + replica (a standalone group: the engine may own the default group)."""
        self._join_sync(address, sync_port, 1 + self.replica, sync_world, sync_backend, timeout_s)

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

    def take_shared(self, handle: str) -> dict[str, Any]:
        """Shared-memory sync, replica side: the segment behind `handle` (JSON, from policy rank
        0's `write_shared`) into the engine (`backend.sync.shared.receive_shared`)."""
        import json  # noqa: PLC0415

        from floe.backend.sync.shared import receive_shared  # noqa: PLC0415
        from floe.errors import StateError  # noqa: PLC0415

        try:
            parsed = json.loads(handle)
        except (TypeError, ValueError):
            self.zone.begin_receive()
            raise StateError("sync_weights: the shared-memory handle is not JSON; the sampler's weights are incomplete "
                             "until a sync succeeds") from None
        return receive_shared(self.zone, parsed, self.device)


class ReferenceHost(_Host):
    """The reference zone on its own worker."""

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        from floe.backend.reference import ReferenceZone  # noqa: PLC0415

        source = self.config.reference.checkpoint or self.config.model
        self.zone = ReferenceZone(self._load(source), self.config.compute, source)

