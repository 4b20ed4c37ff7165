"""Weight sync methods (policy → sampler), all fingerprint-verified: `base.WeightSync`,
`local.InPlaceCopy` for one process, and `broadcast` (bucketed torch.distributed broadcast
primitives a cross-process placement builds its method on)."""

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

__all__ = [
    "Fingerprint",
    "InPlaceCopy",
    "SyncReport",
    "WeightSync",
    "WeightsSnapshot",
    "bucketed",
    "cast_for",
    "cast_tensors",
    "check_publishable",
    "fingerprint",
    "fingerprints",
    "receive_into",
    "receive_weights",
    "send_weights",
    "verify",
]
