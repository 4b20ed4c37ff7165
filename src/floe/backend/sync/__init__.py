"""Weight sync methods (policy → sampler), all fingerprint-verified: `base.WeightSync`,
`local.InPlaceCopy` for one process, `broadcast` (bucketed torch.distributed broadcast
primitives a cross-process placement builds its method on) and `shared` (same host: a reused
shared-memory segment, or a GPU buffer by CUDA IPC, behind a JSON handle)."""

from floe.backend.sync.base import (
    Fingerprint,
    SyncReport,
    WeightsSnapshot,
    WeightSync,
    cast_for,
    cast_tensors,
    check_publishable,
    fingerprint,
    fingerprints,
    verify,
)
from floe.backend.sync.broadcast import bucketed, receive_into, receive_weights, send_weights
from floe.backend.sync.local import InPlaceCopy
from floe.backend.sync.shared import SharedSegment, apply_shared, receive_shared

__all__ = [
    "Fingerprint",
    "InPlaceCopy",
    "SharedSegment",
    "SyncReport",
    "WeightSync",
    "WeightsSnapshot",
    "apply_shared",
    "bucketed",
    "cast_for",
    "cast_tensors",
    "check_publishable",
    "fingerprint",
    "fingerprints",
    "receive_into",
    "receive_shared",
    "receive_weights",
    "send_weights",
    "verify",
]
