"""Placement: where the zones run. The one factory is `build_zones(config, tokenizer)`.

`BackendConfig.placement` chooses: `local` (every zone in this process, `placement.local`) or
`ray` (zones as Ray actors in placement groups, `placement.ray`). The Backend only sees the
`Zones` this returns: the zone protocols of `backend.zones`, a `WeightSync` that knows how
weights travel between them, and the few placement-specific actions (close, where memory is,
sleep/wake when policy and sampler share devices) as methods. floe's core imports Ray only
here, and `placement.ray` only when a Ray placement is built (the verl and SkyRL integrations,
which run on Ray themselves, import it on their own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from floe.config import BackendConfig, LocalPlacement

if TYPE_CHECKING:  # floe.backend imports this package: no import cycle at run time
    from transformers import PreTrainedTokenizerBase

    from floe.backend.sync import WeightSync
    from floe.backend.zones import PolicyWorker, ReferenceWorker, SamplerWorker

__all__ = ["Zones", "build_zones"]


@dataclass
class Zones:
    """The zones of one backend, wherever they run.

    `colocated`: policy and sampler share devices, so the Backend (through a
    `backend.locks.ModeLock`) calls `switch_mode(mode)` before operations of another mode:
    "train" (sampler asleep, policy on its devices), "sync" (both on their devices) and
    "sample" (policy offloaded, sampler awake). Never called when not colocated.
    `describe()` is `info().capabilities["placement"]`; `memory()` says, per zone, where its
    weights are (`info().capabilities["zones_memory"]`); `engine_start_seconds()` how long the
    sampler engine took to start (the slowest replica; None when unknown). `close()` releases every worker and
    is idempotent."""

    policy: PolicyWorker
    sampler: SamplerWorker
    reference: ReferenceWorker | None
    weight_sync: WeightSync
    vocab_size: int
    max_context: int
    colocated: bool = False
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


def build_zones(config: BackendConfig, tokenizer: PreTrainedTokenizerBase) -> Zones:
    """Build (load) every zone `config` asks for where `config.placement` says.

    Local: exactly today's in-process construction (`placement.local.build_local`). Ray:
    `placement.ray.build_ray` (needs the `ray` extra: InvalidInput("placement.kind") without it;
    WorkerFailed when a worker does not start within placement.start_timeout_s)."""
    if isinstance(config.placement, LocalPlacement):
        from floe.placement.local import build_local  # noqa: PLC0415 - one placement per backend

        return build_local(config, tokenizer)
    from floe.placement.ray import build_ray  # noqa: PLC0415 - Ray only when asked for

    return build_ray(config, tokenizer)
