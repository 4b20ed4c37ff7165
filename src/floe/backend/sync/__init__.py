"""Weight sync methods (policy → sampler), all fingerprint-verified: `base.WeightSync`, and
`local.InPlaceCopy` for one process."""

from floe.backend.sync.base import (
    Fingerprint,
    SyncReport,
    WeightsSnapshot,
    WeightSync,
    check_publishable,
    fingerprint,
    fingerprints,
    verify,
)
from floe.backend.sync.local import InPlaceCopy

__all__ = [
    "Fingerprint", "InPlaceCopy", "SyncReport", "WeightSync", "WeightsSnapshot", "check_publishable",
    "fingerprint", "fingerprints", "verify",
]
