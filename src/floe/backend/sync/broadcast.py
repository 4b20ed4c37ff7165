"""Cross-process weight broadcast over a torch.distributed group (gloo on CPU, NCCL on GPU).

The policy's rank 0 (`src`) streams the full weights, bucket by bucket, to every other member
of `group` (the sampler replicas); each replica copies a bucket into its engine before the
next arrives. Not Ray-specific: any placement that has built such a group uses it.

`group` is used only through its own methods (`ProcessGroup.broadcast`; `src` is a rank in
`group`), so it may be a standalone group (`backend.sync.groups.standalone_group`, which the
Ray placement uses because an engine such as vLLM owns the sampler's default group) or any
group torch.distributed made.

Wire protocol, per bucket (all broadcasts from `src`):
1. the header's length in bytes, an int64 tensor [1];
2. the header, a uint8 tensor: JSON {"tensors": [[name, shape, dtype], ...]}, dtypes as
   torch names ("float32", "bfloat16", ...); the tensors are grouped by dtype in order of
   first appearance;
3. one contiguous buffer per dtype (the bucket's tensors of that dtype flattened and
   concatenated in header order), sent as its uint8 bytes, so every backend carries every
   dtype (gloo has no bfloat16 reduction support; a broadcast of bytes needs none).
After the last bucket the length 0 ends the stream; the length -1 aborts it (the sender's
bucket source failed or a bucket was not finite: the receivers raise StateError).
So a bucket of k dtypes costs k + 2 broadcasts, whatever its number of tensors.

Overlap and memory: the sender packs each dtype buffer into one of two reused staging
buffers and broadcasts it asynchronously (`async_op` work), so packing the next buffer overlaps
the previous one's transfer (double buffering; a staging buffer is refilled only after its
broadcast ended). A receiver posts all of a bucket's dtype broadcasts at once into one reused
buffer, which the tensors it yields are views of until it asks for the next bucket. Peak extra
memory: two staging buffers on the sender, one bucket on a receiver (each ≤ bucket_bytes, or
the largest single tensor when that is larger), plus one header (≈ 100 bytes per tensor).

Finite weights: the caller must refuse non-finite weights *before* anything is sent (the
sharded policy's collective `all_finite()`, or `check_publishable` of a snapshot). As a last
guard `send_weights` also checks every bucket's finiteness (`nonfinite`) before sending it and aborts the
stream (StateError) if one is not finite; receivers then raise and their sampler stays
incomplete (`SamplerZone.weights_complete`), so the Backend's version does not move.

A receiver that cannot apply a bucket must still take part in every later broadcast of the
stream (they are collectives): `receive_into` drains the stream after a failure before raising.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from floe.errors import StateError
from floe.sampler.engine import Fingerprint, fingerprints, nonfinite

if TYPE_CHECKING:
    from floe.backend.sampler import SamplerZone

__all__ = ["bucketed", "receive_into", "receive_weights", "send_weights"]

_END, _ABORT = 0, -1
_DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")}


def _comm_device(group: dist.ProcessGroup) -> torch.device:
    """Where the group's collectives need their tensors: the current CUDA device for NCCL,
    the CPU otherwise."""
    if group.name() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int) -> None:
    """`tensor` from `group`'s rank `src` to all its ranks, in place; waits for it (the
    group's timeout bounds the wait). Through the group's own method: works on standalone
    groups, which torch.distributed's module functions do not know."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    group.broadcast([tensor], opts).wait()


def _broadcast_async(group: dist.ProcessGroup, tensor: torch.Tensor, src: int) -> dist.Work:
    """`_broadcast` without the wait: the returned work's `wait()` ends it (the tensor must not
    change until then)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    return group.broadcast([tensor], opts)


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise StateError(f"sync_weights: cannot broadcast tensors of dtype {dtype}")
    return name


def _send_length(group: dist.ProcessGroup, src: int, length: int, device: torch.device) -> None:
    _broadcast(group, torch.tensor([length], dtype=torch.int64, device=device), src)


def bucketed(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Group named tensors into buckets of at most `bucket_bytes` bytes, in order (a tensor
    larger than that gets a bucket alone). The tensors are not copied."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket


def send_weights(
    group: dist.ProcessGroup, src: int, buckets: Iterable[dict[str, torch.Tensor]]
) -> tuple[dict[str, Fingerprint], int]:
    """Broadcast `buckets` (name -> full tensor) from this rank (`src`, its rank in `group`) to the rest of `group`
    (the protocol is in the module docstring). Empty buckets are skipped. Returns the
    fingerprints of every tensor sent (`floe.sampler.engine.fingerprint`, of the full tensors)
    and the bytes sent (tensor data; headers excluded).

    StateError (after broadcasting the abort marker, so receivers do not hang) when a bucket is
    not finite or has an unsupported dtype; an exception raised by `buckets` itself also aborts
    the stream before it propagates. Peak extra memory: one bucket (module docstring)."""
    device = _comm_device(group)
    sent: dict[str, Fingerprint] = {}
    total = 0
    buffers: list[torch.Tensor | None] = [None, None]  # double buffering: pack one while the other is in flight
    works: list[dist.Work | None] = [None, None]
    turn = 0
    try:
        for bucket in buckets:
            if not bucket:
                continue
            broken = nonfinite(bucket)
            if broken:
                raise StateError(f"sync_weights: policy weights are not finite in {broken[:5]}; the samplers' weights "
                                 "are incomplete until a sync succeeds")
            prints = fingerprints(bucket)
            order: dict[str, list[str]] = {}  # dtype name -> tensor names, in first-appearance order
            for name, t in bucket.items():
                order.setdefault(_dtype_name(t.dtype), []).append(name)
            header = [[name, list(bucket[name].shape), dtype] for dtype, names in order.items() for name in names]
            raw = torch.frombuffer(bytearray(json.dumps({"tensors": header}).encode()), dtype=torch.uint8)
            _send_length(group, src, raw.numel(), device)
            _broadcast(group, raw.to(device), src)
            for names in order.values():
                parts = [bucket[name].detach().reshape(-1) for name in names]
                numel = sum(p.numel() for p in parts)
                nbytes = numel * parts[0].element_size()
                work = works[turn]
                if work is not None:  # this buffer's previous broadcast must be done before it is refilled
                    work.wait()
                buf = buffers[turn]
                if buf is None or buf.numel() < nbytes:
                    buf = buffers[turn] = torch.empty(max(nbytes, 8), dtype=torch.uint8, device=device)
                flat = buf[:nbytes].view(parts[0].dtype)
                torch.cat(parts, out=flat)
                works[turn] = _broadcast_async(group, buf[:nbytes], src)
                turn = 1 - turn
                total += nbytes
            sent.update(prints)
        for work in works:
            if work is not None:
                work.wait()
    except BaseException:
        for work in works:
            if work is not None:
                work.wait()
        _send_length(group, src, _ABORT, device)
        raise
    _send_length(group, src, _END, device)
    return sent, total


def receive_weights(group: dist.ProcessGroup, src: int, device: torch.device | str) -> Iterator[dict[str, torch.Tensor]]:
    """On every member of `group` but `src`: yield each bucket `send_weights` broadcasts, as
    tensors on `device` (views into the bucket's received buffers, valid until the next bucket
    is asked for). Ends at the end marker; StateError when the sender aborts. The caller must
    exhaust the iterator (every broadcast is a collective): use `receive_into` to load a
    sampler. Peak extra memory: one bucket (module docstring)."""
    device = torch.device(device)
    comm = _comm_device(group)
    store: torch.Tensor | None = None
    while True:
        length = torch.zeros(1, dtype=torch.int64, device=comm)
        _broadcast(group, length, src)
        n = int(length.item())
        if n == _END:
            return
        if n == _ABORT:
            raise StateError("sync_weights: the policy aborted the weight broadcast midway; the sampler's weights are "
                             "incomplete until a sync succeeds")
        raw = torch.empty(n, dtype=torch.uint8, device=comm)
        _broadcast(group, raw, src)
        header = json.loads(raw.cpu().numpy().tobytes().decode())["tensors"]
        bucket: dict[str, torch.Tensor] = {}
        groups: dict[str, list[tuple[str, list[int]]]] = {}
        for name, shape, dtype in header:
            groups.setdefault(dtype, []).append((name, shape))
        sizes = {dtype: sum(math.prod(shape) for _, shape in members) * _DTYPES[dtype].itemsize
                 for dtype, members in groups.items()}
        need = sum(-(-n // 8) * 8 for n in sizes.values())
        if store is None or store.numel() < need:  # one buffer, reused bucket after bucket
            store = torch.empty(max(need, 8), dtype=torch.uint8, device=comm)
        works, offset, flats = [], 0, {}
        for dtype, n in sizes.items():  # every dtype's broadcast in flight at once
            piece = store[offset: offset + n]
            works.append(_broadcast_async(group, piece, src))
            flats[dtype] = piece
            offset += -(-n // 8) * 8
        for work in works:
            work.wait()
        for dtype, members in groups.items():
            numels = [math.prod(shape) for _, shape in members]
            flat = flats[dtype].view(_DTYPES[dtype]).to(device)
            for (name, shape), part in zip(members, torch.split(flat, numels), strict=True):
                bucket[name] = part.view(shape)
            del flat
        yield bucket
        del bucket


def receive_into(sampler: SamplerZone, group: dist.ProcessGroup, src: int, device: torch.device | str) -> dict[str, Fingerprint]:
    """Receive a whole broadcast into `sampler`: `begin_receive`, `receive_bucket` per
    bucket, `end_receive`; returns the fingerprints of ALL the sampler's tensors (for
    `verify`). When a bucket cannot be applied, the rest of the stream is still received (and
    dropped) so the sender and the other receivers finish, then the error is raised; the
    sampler stays incomplete (it refuses to sample until a sync succeeds)."""
    sampler.begin_receive()
    failure: BaseException | None = None
    for bucket in receive_weights(group, src, device):
        if failure is None:
            try:
                sampler.receive_bucket(bucket)
            except Exception as e:  # noqa: BLE001 - re-raised below, after the collectives end
                failure = e
    if failure is not None:
        raise failure
    return sampler.end_receive()
