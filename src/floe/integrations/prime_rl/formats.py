"""prime-rl's trainer-side wire formats and run-directory layout, pinned to `PRIME_RL_COMMIT`.

Rollouts (orchestrator -> trainer): `<run_dir>/rollouts/step_{N}/rank_{R}.bin`, a msgspec
msgpack encoding of `list[MicroBatch]`, written to `rank_{R}.bin.tmp` and renamed (prime-rl's
`FileSystemMicroBatchSender`). Weights (trainer -> orchestrator): `<run_dir>/broadcasts/step_{N}/`
with an empty `STABLE` file written last (`FileSystemWeightBroadcast`); the orchestrator's
watcher polls for it and then calls the inference server's `/update_weights` with that
directory. floe's trainer puts `floe.json` (`BroadcastMarker`: the sampler's weights version
for that step) in the directory, which `floe serve`'s `/update_weights` reads.

The structs below copy prime-rl's field names, order and options (`array_like=True`,
`omit_defaults=True`), so the bytes are interchangeable with prime-rl's own.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec

from floe.atomic import atomic_write_bytes, atomic_write_text
from floe.errors import InvalidInput

STABLE = "STABLE"
MARKER = "floe.json"


class EncodedTensor(msgspec.Struct, array_like=True, gc=False):
    dtype: str
    shape: list[int]
    data: bytes


class RoutedExperts(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    data: bytes
    shape: list[int]
    dtype: str


class TrainingSample(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """One rollout branch as a flat token sequence; every per-token list has len(token_ids)."""

    token_ids: list[int]
    mask: list[bool]
    logprobs: list[float]
    temperatures: list[float]
    env_name: str
    ref_logprobs: list[float] | None = None
    mm_kwargs: dict[str, EncodedTensor] | None = None
    routed_experts: RoutedExperts | None = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None
    advantages: list[float] | None = None


class MicroBatch(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """Packed samples (orchestrator -> trainer). Per-token lists have len(input_ids);
    `sequence_lengths` (and `seq_lens`) split them into samples; `position_ids` restart at 0
    for each sample; padding is appended to the last sample with `loss_mask` False."""

    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    position_ids: list[int]
    sequence_lengths: list[int]
    temperatures: list[float]
    env_names: list[str]
    seq_lens: list[int]
    ref_logprobs: list[float] | None = None
    routed_experts: RoutedExperts | None = None
    mm_kwargs: dict[str, EncodedTensor] | None = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None


_DECODER = msgspec.msgpack.Decoder(type=list[MicroBatch])
_ENCODER = msgspec.msgpack.Encoder()


def rollout_path(run_dir: Path, step: int, rank: int) -> Path:
    """`<run_dir>/rollouts/step_{step}/rank_{rank}.bin`."""
    return Path(run_dir) / "rollouts" / f"step_{step}" / f"rank_{rank}.bin"


def broadcast_dir(run_dir: Path, step: int) -> Path:
    """`<run_dir>/broadcasts/step_{step}` (its `STABLE` file marks it complete)."""
    return Path(run_dir) / "broadcasts" / f"step_{step}"


def encode_micro_batches(batches: list[MicroBatch]) -> bytes:
    return _ENCODER.encode(batches)


def decode_micro_batches(data: bytes, where: str = "rollout file") -> list[MicroBatch]:
    """`list[MicroBatch]` from msgpack bytes; InvalidInput naming `where` when they are not."""
    try:
        return _DECODER.decode(data)
    except msgspec.DecodeError as e:
        raise InvalidInput(where, f"not a prime-rl list[MicroBatch] msgpack file: {e}") from None


def write_micro_batches(run_dir: Path, step: int, rank: int, batches: list[MicroBatch]) -> Path:
    """Write one rank's micro-batches for `step` as the orchestrator does (temp file, rename)."""
    path = rollout_path(run_dir, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, encode_micro_batches(batches))
    return path


def read_micro_batches(path: Path) -> list[MicroBatch]:
    return decode_micro_batches(Path(path).read_bytes(), where=str(path))


@dataclass
class BroadcastMarker:
    """What `broadcasts/step_N/floe.json` says: the floe sampler serves `weights_version`
    (policy optimizer step `policy_step`) for prime-rl step `step`."""

    step: int
    weights_version: int
    policy_step: int
    model: str


def publish(run_dir: Path, marker: BroadcastMarker) -> Path:
    """Write `broadcasts/step_N/floe.json`, then `STABLE` (each atomically; STABLE last)."""
    out = broadcast_dir(run_dir, marker.step)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / MARKER, json.dumps(asdict(marker), indent=1) + "\n")
    atomic_write_text(out / STABLE, "")
    return out


def unpublish(run_dir: Path, step: int) -> None:
    """Remove `broadcasts/step_N/STABLE` (if any): on resume the step's marker is re-published once
    the trainer has loaded its state, and until then the orchestrator must not take the old one."""
    (broadcast_dir(run_dir, step) / STABLE).unlink(missing_ok=True)


def read_marker(weight_dir: Path, field: str = "weight_dir") -> BroadcastMarker:
    """The marker of a published broadcast directory; InvalidInput naming `field` otherwise."""
    if "\x00" in str(weight_dir):
        raise InvalidInput(field, "must be a directory path (no NUL)")
    path = Path(weight_dir) / MARKER
    try:
        if not (Path(weight_dir) / STABLE).is_file():
            raise InvalidInput(field, f"{weight_dir} is not a published broadcast (no {STABLE} file)")
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidInput(field, f"{weight_dir} has no {MARKER}: floe serves the weights its trainer "
                           "synced (`floe prime-trainer`), not checkpoints from another trainer") from None
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise InvalidInput(field, f"{path} is not a floe broadcast marker: {e}") from None
    types = {"step": int, "weights_version": int, "policy_step": int, "model": str}
    if not isinstance(data, dict) or set(data) != set(types) or any(
            type(data[k]) is not t for k, t in types.items()):
        raise InvalidInput(field, f"{path} is not a floe broadcast marker: expected an object with "
                           f"{', '.join(f'{k} ({t.__name__})' for k, t in types.items())}")
    return BroadcastMarker(**data)
