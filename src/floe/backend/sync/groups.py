"""Standalone torch.distributed process groups: a group with its own rendezvous that never
touches torch.distributed's default (WORLD) process group.

Why: an inference engine in a sampler process owns that process's default group. vLLM's
in-process engine calls `torch.distributed.init_process_group` itself (a world of one) when it
starts, so a sampler replica cannot also join a floe world through `init_process_group`
("trying to initialize the default process group twice"). Floe's weight-sync group (the
policy's rank 0 and every sampler replica) is therefore built here from its own TCPStore and
used only through the group object's own methods (`ProcessGroup.broadcast`, as
`backend.sync.broadcast` does), never through `torch.distributed`'s module-level registry:
it is not in `torch.distributed`'s list of groups, and `torch.distributed.get_rank()` and the
like know nothing of it. The same pattern is how vLLM's own `StatelessProcessGroup` helpers
and RL trainers (OpenRLHF, verl) push weights into vLLM.

Backends: "gloo" (CPU tensors: CPU hosts, and GPUs that share devices) and "nccl" (CUDA
tensors on the current CUDA device, one device per rank).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from floe.errors import InvalidInput

__all__ = ["standalone_group"]


def standalone_group(backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroup:
    """Join the group of `world_size` processes whose rendezvous store rank 0 serves at
    `host:port` (a TCPStore: rank 0 listens on `port`, the others connect), as `rank`
    (0 .. world_size - 1), and return it. Collective: every rank calls it; it returns once all
    `world_size` have joined, or raises (torch's DistStoreError / RuntimeError) after
    `timeout_s` seconds. Every later collective on the group fails after `timeout_s` seconds
    instead of hanging when a peer is gone.

    Use the returned `ProcessGroup` through its own methods (ranks are ranks in this group);
    the default process group is neither needed nor touched (module docstring).
    InvalidInput ("backend") for a backend other than "gloo" or "nccl" (or "nccl" where torch
    has no NCCL); InvalidInput ("rank") when rank is not in 0 .. world_size - 1.
    """
    if backend not in ("gloo", "nccl"):
        raise InvalidInput("backend", f"standalone groups use 'gloo' or 'nccl', not {backend!r}")
    if backend == "nccl" and not dist.is_nccl_available():
        raise InvalidInput("backend", "this torch build has no NCCL: use 'gloo'")
    if not 0 <= rank < world_size:
        raise InvalidInput("rank", f"rank {rank} is outside 0 .. {world_size - 1} (world_size {world_size})")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    group = dist.ProcessGroup(store, rank, world_size)
    if backend == "gloo":
        impl: Any = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        kind, device = dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        impl = dist.ProcessGroupNCCL(store, rank, world_size, options)
        kind, device = dist.ProcessGroup.BackendType.NCCL, torch.device("cuda")
    group._set_default_backend(kind)
    impl._set_sequence_number_for_group()
    group._register_backend(device, kind, impl)
    return group
