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

from typing import TYPE_CHECKING

from floe.config import BackendConfig, LocalPlacement
from floe.placement.zones import Zones

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Zones", "build_zones"]


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
