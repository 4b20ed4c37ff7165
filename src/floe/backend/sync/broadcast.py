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
   torch names ("float32", "bfloat16", ...); a name tied to an earlier tensor of the bucket
   (the same tensor, `tensor_key`: embed_tokens / lm_head) is [name, shape, dtype, that
   tensor's name] and sends no bytes;
3. each tensor's bytes, in header order, one broadcast per tensor (as uint8, so every backend
   carries every dtype: gloo has no bfloat16 reduction support; a broadcast of bytes needs
   none).
After the last bucket the length 0 ends the stream; the length -1 aborts it (the sender's
bucket source failed or a bucket was not finite: the receivers raise StateError).
So a bucket of k distinct tensors costs k + 2 broadcasts.

Overlap and memory: the sender broadcasts every tensor of a bucket asynchronously straight
from the tensor's own storage (no staging copy; a tensor is copied only when it is not
contiguous or not on the group's device), so the transfers of a bucket overlap each other; a
receiver posts all of a bucket's broadcasts at once into one reused buffer, which the tensors
it yields are views of until it asks for the bucket after next. The sender checks and
fingerprints bucket k + 1 while bucket k is in flight; a receiver posts bucket k + 1's
broadcasts (into its second buffer) before it hands bucket k to the caller, so applying a
bucket overlaps the next one's transfer. Peak extra memory: two buckets on a receiver (each
≤ bucket_bytes, or the largest single tensor when that is larger), plus one header (≈ 100
bytes per tensor); none on the sender.

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
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from floe.backend.sync.base import check_finite
from floe.errors import StateError
from floe.sampler.engine import Fingerprint, fingerprints, tensor_key

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
    larger than that gets a bucket alone). Names of one tensor (tied weights, `tensor_key`)
    go into the bucket of its first name and count once, so `send_weights` sends it once. The
    tensors are not copied."""
    names: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for name, t in tensors:
        names.setdefault(tensor_key(t), []).append((name, t))
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for group in names.values():
        nbytes = group[0][1].numel() * group[0][1].element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket.update(group)
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
    in_flight: list[tuple[dist.Work, torch.Tensor]] = []  # the previous bucket's broadcasts (and their tensors)

    def drain() -> None:
        for work, _ in in_flight:
            work.wait()
        in_flight.clear()

    try:
        for bucket in buckets:
            if not bucket:
                continue
            # Checked and fingerprinted while the previous bucket is still on the wire.
            check_finite(bucket, "the samplers' weights are incomplete until a sync succeeds")
            prints = fingerprints(bucket)
            header: list[list[Any]] = []
            first: dict[tuple, str] = {}  # tensor_key -> the bucket's first name of that tensor
            unique: list[torch.Tensor] = []
            for name, t in bucket.items():
                key = tensor_key(t)
                if key in first:  # a tied name: sent once, under its first name
                    header.append([name, list(t.shape), _dtype_name(t.dtype), first[key]])
                    continue
                first[key] = name
                header.append([name, list(t.shape), _dtype_name(t.dtype)])
                unique.append(t)
            raw = torch.frombuffer(bytearray(json.dumps({"tensors": header}).encode()), dtype=torch.uint8)
            # Each tensor's own bytes: no staging copy (packing a bucket into one buffer cost
            # more than half the raw transfer time on a 2-core machine: docs/benchmarks.md). A
            # tensor is copied only when it is not contiguous or not on the group's device.
            held = [t.detach().to(device).contiguous().reshape(-1).view(torch.uint8) for t in unique]
            drain()
            _send_length(group, src, raw.numel(), device)
            _broadcast(group, raw.to(device), src)
            in_flight.extend((_broadcast_async(group, piece, src), piece) for piece in held if piece.numel())
            total += sum(piece.numel() for piece in held)
            sent.update(prints)
        drain()
    except BaseException:
        drain()
        _send_length(group, src, _ABORT, device)
        raise
    _send_length(group, src, _END, device)
    return sent, total


def receive_weights(group: dist.ProcessGroup, src: int, device: torch.device | str) -> Iterator[dict[str, torch.Tensor]]:
    """On every member of `group` but `src`: yield each bucket `send_weights` broadcasts, as
    tensors on `device` (views into one of two reused receive buffers, valid until the bucket
    after next is asked for). Ends at the end marker; StateError when the sender aborts. The caller must
    exhaust the iterator (every broadcast is a collective): use `receive_into` to load a
    sampler. Peak extra memory: one bucket (module docstring)."""
    device = torch.device(device)
    comm = _comm_device(group)
    stores: list[torch.Tensor | None] = [None, None]  # bucket k lands in one while k - 1 is being applied

    def post(turn: int) -> tuple[dict[str, torch.Tensor], list[dist.Work]] | None:
        """Read the next bucket's header and post all its broadcasts into `stores[turn]`; None at
        the end marker."""
        length = torch.zeros(1, dtype=torch.int64, device=comm)
        _broadcast(group, length, src)
        n = int(length.item())
        if n == _END:
            return None
        if n == _ABORT:
            raise StateError("sync_weights: the policy aborted the weight broadcast midway; the sampler's weights are "
                             "incomplete until a sync succeeds")
        raw = torch.empty(n, dtype=torch.uint8, device=comm)
        _broadcast(group, raw, src)
        header = json.loads(raw.cpu().numpy().tobytes().decode())["tensors"]
        sent = [(entry[0], entry[1], entry[2], math.prod(entry[1]) * _DTYPES[entry[2]].itemsize)
                for entry in header if len(entry) == 3]
        need = sum(-(-size // 8) * 8 for *_, size in sent)  # each tensor 8-byte aligned in the buffer
        store = stores[turn]
        if store is None or store.numel() < need:  # reused bucket after bucket
            store = stores[turn] = torch.empty(max(need, 8), dtype=torch.uint8, device=comm)
        works, offset, received = [], 0, {}
        for name, shape, dtype, size in sent:  # all of them in flight at once
            piece = store[offset: offset + size]
            if size:
                works.append(_broadcast_async(group, piece, src))
            received[name] = piece.view(_DTYPES[dtype]).view(shape)
            offset += -(-size // 8) * 8
        # In header order; a tied name (4th field: the name it was sent under) is the same tensor.
        bucket = {entry[0]: received[entry[0] if len(entry) == 3 else entry[3]] for entry in header}
        return bucket, works

    turn = 0
    current = post(turn)
    while current is not None:
        bucket, works = current
        for work in works:
            work.wait()
        turn = 1 - turn
        current = post(turn)  # the next bucket arrives while the caller applies this one
        yield bucket if comm == device else {name: t.to(device) for name, t in bucket.items()}
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
