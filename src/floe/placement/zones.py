"""`Zones`: what a placement hands the Backend (the zones, wherever they run, and their weight sync).

Its own module, below `placement/__init__` (the factory) and the placements (`local`, `ray`)
that build it, so none of them imports another for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: importing floe.backend here would run its package (and
    # floe.backend.backend imports floe.placement) while floe.placement is half initialised
    from floe.backend.sync.base import WeightSync
    from floe.backend.zones import PolicyWorker, ReferenceWorker, SamplerWorker

__all__ = ["Zones"]


@dataclass
class Zones:
    """The zones of one backend, wherever they run.

    `colocated`: policy and sampler share devices, so the Backend (through a
    `backend.locks.ModeLock`) calls `switch_mode(mode)` before operations of another mode:
    "train" (sampler asleep, policy on its devices), "sync" (both on their devices) and
    "sample" (policy offloaded, sampler awake). Never called when not colocated.
    `describe()` is `info().capabilities["placement"]`; `memory()` says, per zone, where its
    weights are (`info().capabilities["zones_memory"]`); `engine_start_seconds()` how long the
    sampler engine took to start (the slowest replica; None when unknown). `policy_devices`: how many
    devices the policy computes on (its ranks), the denominator of MFU. `close()` releases every
    worker and is idempotent."""

    policy: PolicyWorker
    sampler: SamplerWorker
    reference: ReferenceWorker | None
    weight_sync: WeightSync
    vocab_size: int
    max_context: int
    colocated: bool = False
    policy_devices: int = 1
    describe: Callable[[], dict[str, Any]] = field(default=lambda: {"kind": "local"})
    memory: Callable[[], dict[str, Any]] = field(default=dict)
    engine_start_seconds: Callable[[], float | None] = field(default=lambda: None)
    switch_mode: Callable[[str], None] = field(default=lambda mode: None)
    _close: Callable[[], None] = field(default=lambda: None)
    _closed: bool = False

    def close(self) -> None:
        """Release the zones' resources (engines, actors, a cluster this backend started). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._close()
