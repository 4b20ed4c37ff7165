"""Same-host weight sync through shared memory: the sender writes, the receivers map and copy.

For sampler replicas on the same host as the sender (the Ray placement's policy rank 0). Not
Ray-specific: the sender returns a plain JSON-able *handle* and any transport that carries JSON
carries it to the receivers (no pickle, nothing that executes code, crosses a process).

Host memory (`SharedSegment.write`, tensors on the CPU, or on a GPU when CUDA IPC is not asked
for): the sender owns one file under /dev/shm (`floe-sync-<pid>-<random>`, mode 0600), created at
the first sync, reused by every later one and replaced by a larger one (the old one unlinked)
when the weights no longer fit; `close()` unlinks it. Each bucket's tensors (already cast to the
replicas' dtypes and checked finite) are copied into it at 64-byte aligned offsets. The handle:

    {"kind": "shm", "segment": name, "size": bytes used,
     "buckets": [[[name, shape, dtype, offset], ...], ...]}

A tied name (the same tensor under two names, `tensor_key`: embed_tokens / lm_head) gets the
offset of the tensor's first name and is written once (it counts once in the bytes).

CUDA (`write(..., cuda_ipc=True)` with the tensors on a GPU): the segment is instead one byte
buffer on the sender's GPU (reused and grown the same way), the tensors are copied into it device
to device, and the handle carries the CUDA IPC handle of that buffer's storage
(`untyped_storage()._share_cuda_()`: device index, handles as hex strings, sizes and offsets as
ints) plus the device's UUID; the receiver opens it (`torch.UntypedStorage._new_shared_cuda`)
and copies device to device into its engine, with no host staging:

    {"kind": "cuda_ipc", "device_uuid": str, "ipc": [...8 fields...], "size": bytes used,
     "buckets": [...as above...]}

Only a receiver on the same GPU (the same UUID: a colocated sampler) may open it; any other is
refused (StateError). This path is written and guarded by device checks but is NOT run by the
CPU CI (tests/backend/test_shared_sync.py runs its host-memory counterpart); run it on a GPU
(benchmarks/bench_sync.py) before relying on it.

Receiver (`receive_shared`): `sampler.begin_receive()`, then the whole handle is validated before
a byte is read: its shape (kinds, types), every name one the sampler holds with the dtype it
holds, every tensor inside the mapped segment (its real size, never the size the handle claims),
the segment name one this module makes (no path can be named). A bad handle is a StateError and
the sampler stays incomplete (it refuses to sample until a sync succeeds). Then each bucket's
tensors are views of the mapping (`torch.frombuffer`; on CUDA, of the opened storage), copied
into the engine bucket by bucket (`receive_bucket`, which also refuses a shape the engine does
not hold), and `end_receive` returns the fingerprints of what the sampler holds, which the
caller verifies against the sender's as for every method. The mapping is closed before return.

The sender must not write again until every receiver has returned (the coordinator holds both
zones for the whole sync). Peak extra memory: the whole weights once in the segment (shared by
every receiver of the host), none on a receiver beyond its page cache of the mapping.

Finite weights: the caller refuses non-finite weights before anything moves; `write` checks
every bucket again (`nonfinite`) before copying it and raises StateError.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from floe.backend.sync.base import check_finite
from floe.errors import StateError
from floe.sampler.engine import Fingerprint, fingerprints, tensor_key

if TYPE_CHECKING:
    from floe.backend.sampler import SamplerZone

__all__ = ["SHM_DIR", "SharedSegment", "apply_shared", "receive_shared"]

SHM_DIR = "/dev/shm"
_ALIGN = 64
_NAME = re.compile(r"^floe-sync-[0-9]+-[0-9a-f]{16}$")
_DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")}
_MAX_DIMS = 16


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise StateError(f"sync_weights: cannot share tensors of dtype {dtype}")
    return name


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class _HostBuffer:
    """A file under /dev/shm mapped read-write: `view` is its bytes as a uint8 tensor."""

    def __init__(self, size: int):
        self.name = f"floe-sync-{os.getpid()}-{secrets.token_hex(8)}"
        self.path = os.path.join(SHM_DIR, self.name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self.size = size
        self.view: torch.Tensor | None = torch.frombuffer(self.map, dtype=torch.uint8)

    def close(self) -> None:
        self.view = None  # the tensor's export of the buffer must go before the map closes
        self.map.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class _CudaBuffer:
    """One byte buffer on a GPU, shared by its CUDA IPC handle."""

    def __init__(self, size: int, device: torch.device):
        self.view: torch.Tensor | None = torch.empty(size, dtype=torch.uint8, device=device)
        self.size = size
        self.device = device

    def close(self) -> None:
        self.view = None


class SharedSegment:
    """The sender's side: one reused segment (module docstring). `write` returns the handle,
    the fingerprints of every tensor written and the bytes written; `close` frees the segment
    (unlinks the /dev/shm file)."""

    def __init__(self) -> None:
        self._buffer: _HostBuffer | _CudaBuffer | None = None

    @property
    def name(self) -> str | None:
        """The /dev/shm file's name while a host segment exists."""
        return self._buffer.name if isinstance(self._buffer, _HostBuffer) else None

    def _room(self, need: int, used: int, device: torch.device | None) -> torch.Tensor:
        """The segment's bytes, at least `need` long, the first `used` bytes kept (a new,
        larger segment when it is too small or of the other kind; the old one freed)."""
        old = self._buffer
        fits = old is not None and old.size >= need and (
            isinstance(old, _CudaBuffer) and old.device == device if device is not None else isinstance(old, _HostBuffer))
        if fits:
            assert old is not None and old.view is not None
            return old.view
        size = max(need, 2 * old.size if old is not None else 0, _ALIGN)
        new = _HostBuffer(size) if device is None else _CudaBuffer(size, device)
        assert new.view is not None
        if old is not None:
            keep = min(used, old.size)  # `used` is aligned: it may pass the old end
            try:
                if keep:
                    assert old.view is not None
                    new.view[:keep].copy_(old.view[:keep])
            except BaseException:
                new.close()  # never a segment nobody owns
                raise
            old.close()
        self._buffer = new
        return new.view

    def write(self, buckets: Iterable[dict[str, torch.Tensor]], cuda_ipc: bool = False
              ) -> tuple[dict[str, Any], dict[str, Fingerprint], int]:
        """Copy `buckets` (name -> full tensor, in the receivers' dtypes) into the segment.
        With `cuda_ipc` and the tensors on a GPU the segment is on that GPU (module docstring);
        otherwise in /dev/shm. StateError (the handle is never returned) when a bucket is not
        finite or has a dtype that cannot be shared."""
        layout: list[list[list[Any]]] = []
        prints: dict[str, Fingerprint] = {}
        used = written = 0
        device: torch.device | None = None
        chosen = False
        for bucket in buckets:
            if not bucket:
                continue
            check_finite(bucket, "the samplers' weights were not changed")
            if not chosen:  # the first bucket decides where the segment lives
                first = next(iter(bucket.values()))
                device = first.device if cuda_ipc and first.device.type == "cuda" else None
                chosen = True
            entries: list[list[Any]] = []
            placed: dict[tuple, int] = {}
            for name, t in bucket.items():
                key = tensor_key(t)
                dtype = _dtype_name(t.dtype)
                if key not in placed:  # a tied name takes its first name's offset: written once
                    nbytes = t.numel() * t.element_size()
                    view = self._room(used + nbytes, used, device)
                    if nbytes:
                        src = _as_bytes(t if device is not None else t.cpu())
                        if device is not None and src.device != device:
                            src = src.to(device)
                        view[used:used + nbytes].copy_(src)
                    placed[key] = used
                    used = _aligned(used + nbytes)
                    written += nbytes
                entries.append([name, list(t.shape), dtype, placed[key]])
            prints.update(fingerprints(bucket))
            layout.append(entries)
        self._room(used, used, device)  # a segment exists even for empty weights
        buffer = self._buffer
        assert buffer is not None and buffer.view is not None
        if isinstance(buffer, _CudaBuffer):
            torch.cuda.current_stream(buffer.device).synchronize()  # every copy done before a receiver reads
            ipc = buffer.view.untyped_storage()._share_cuda_()  # type: ignore[attr-defined]
            handle: dict[str, Any] = {
                "kind": "cuda_ipc", "device_uuid": str(torch.cuda.get_device_properties(buffer.device).uuid),
                "ipc": [v.hex() if isinstance(v, bytes) else v for v in ipc], "size": used, "buckets": layout}
        else:
            handle = {"kind": "shm", "segment": buffer.name, "size": used, "buckets": layout}
        return handle, prints, written

    def close(self) -> None:
        """Free the segment (unlink the /dev/shm file); the next `write` makes a new one."""
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None

    def __del__(self) -> None:  # a sender dropped without close (not a killed process: that leaks the file)
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass


def _bad(why: str) -> StateError:
    return StateError(f"sync_weights: the shared-memory handle is invalid ({why}); the sampler's weights are "
                      "incomplete until a sync succeeds")


def _checked(handle: Any, held: Mapping[str, str], mapped: int) -> list[list[tuple[str, list[int], str, int, int]]]:
    """The handle's buckets as (name, shape, dtype, offset, nbytes), every entry checked
    against what the sampler holds and against the `mapped` bytes; StateError otherwise."""
    buckets = handle.get("buckets")
    if not isinstance(buckets, list):
        raise _bad("no bucket list")
    out = []
    for bucket in buckets:
        if not isinstance(bucket, list):
            raise _bad("a bucket is not a list")
        entries = []
        for entry in bucket:
            if not (isinstance(entry, list) and len(entry) == 4):
                raise _bad(f"entry {str(entry)[:80]} is not [name, shape, dtype, offset]")
            name, shape, dtype, offset = entry
            if not isinstance(name, str) or name not in held:
                raise _bad(f"{str(name)[:80]!r} is not a tensor the sampler holds")
            if dtype != held[name]:
                raise _bad(f"{name} is {str(dtype)[:20]}, the sampler holds {held[name]}")
            if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS
                    and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
                raise _bad(f"{name}'s shape {str(shape)[:80]} is not a list of sizes")
            if not (isinstance(offset, int) and not isinstance(offset, bool) and offset >= 0):
                raise _bad(f"{name}'s offset {str(offset)[:40]} is not a byte offset")
            nbytes = math.prod(shape) * _DTYPES[dtype].itemsize
            if offset + nbytes > mapped:
                raise _bad(f"{name} ({nbytes} bytes at offset {offset}) lies outside the {mapped}-byte segment")
            entries.append((name, shape, dtype, offset, nbytes))
        out.append(entries)
    return out


def _open_host(handle: dict[str, Any]) -> tuple[mmap.mmap, int]:
    name = handle.get("segment")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(f"segment {str(name)[:80]!r} is not a floe sync segment")
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    except OSError as e:
        raise _bad(f"segment {name} cannot be opened: {e.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise _bad(f"segment {name} is empty")
        # Copy-on-write: a writable buffer for torch.frombuffer; nothing is ever written to it.
        return mmap.mmap(fd, size, access=mmap.ACCESS_COPY), size
    finally:
        os.close(fd)


def _open_cuda(handle: dict[str, Any], device: torch.device) -> torch.Tensor:
    """The sender's GPU buffer, opened from its IPC handle (only on the same GPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise _bad(f"a CUDA IPC handle reached a receiver on {device}")
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    if handle.get("device_uuid") != uuid:
        raise _bad(f"the buffer is on GPU {str(handle.get('device_uuid'))[:40]}, this receiver on {uuid}: CUDA IPC needs "
                   'one GPU (a colocated sampler); use placement.sync = "broadcast"')
    ipc = handle.get("ipc")
    if not (isinstance(ipc, list) and len(ipc) == 8):
        raise _bad("the ipc field is not the 8 fields of a CUDA storage handle")
    _, mem, size, offset, ref, ref_offset, event, sync = ipc
    # The sender's device index is its own process's numbering (CUDA_VISIBLE_DEVICES differ per
    # process): the storage opens on this process's index of the same GPU (checked by UUID above).
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        args = (index, bytes.fromhex(mem), int(size), int(offset), bytes.fromhex(ref), int(ref_offset),
                bytes.fromhex(event), bool(sync))
        storage = torch.UntypedStorage._new_shared_cuda(*args)  # type: ignore[attr-defined]
    except (TypeError, ValueError, RuntimeError) as e:
        raise _bad(f"the CUDA IPC handle cannot be opened: {str(e)[:200]}") from None
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def apply_shared(handle: Any, held: Mapping[str, str], apply: Callable[[dict[str, torch.Tensor]], None],
                 device: torch.device | str = "cpu") -> None:
    """Open the segment behind `handle`, validate the whole handle against `held` (name ->
    dtype name of what the receiver holds) and the mapped size, then call `apply(bucket)` for
    each bucket (name -> a view of the mapping, or of the sender's GPU buffer: copy it, do not
    keep it); the mapping is closed before return. StateError for a bad handle (nothing read)."""
    device = torch.device(device)
    if not isinstance(handle, dict) or handle.get("kind") not in ("shm", "cuda_ipc"):
        raise _bad('kind is not "shm" or "cuda_ipc"')
    mapping: mmap.mmap | None = None
    if handle["kind"] == "cuda_ipc":
        data: torch.Tensor | None = _open_cuda(handle, device)
    else:
        mapping, _ = _open_host(handle)
        data = torch.frombuffer(mapping, dtype=torch.uint8)
    bucket: dict[str, torch.Tensor] | None = None
    try:
        buckets = _checked(handle, held, data.numel())  # the whole handle, before a byte is read
        for entries in buckets:
            bucket = {name: data[offset:offset + nbytes].view(_DTYPES[dtype]).view(shape)
                      for name, shape, dtype, offset, nbytes in entries}
            apply(bucket)
            bucket = None
        if data.device.type == "cuda":
            torch.cuda.current_stream(data.device).synchronize()  # the copies out of the sender's buffer are done
    finally:
        bucket = data = None  # every view of the mapping goes before it closes
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:  # a view still referenced (e.g. by a traceback): closed when collected
                pass


def receive_shared(sampler: SamplerZone, handle: Any, device: torch.device | str = "cpu") -> dict[str, Fingerprint]:
    """Receive a `SharedSegment.write` handle into `sampler` (module docstring): validate it,
    copy bucket by bucket (`apply_shared` into `receive_bucket`), return the fingerprints of ALL
    the sampler's tensors (for `verify`). StateError for a bad handle (nothing read) or a bucket
    the engine refuses; the sampler stays incomplete either way."""
    sampler.begin_receive()
    apply_shared(handle, sampler.held_dtypes(), sampler.receive_bucket, device)
    return sampler.end_receive()
