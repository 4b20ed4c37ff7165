"""Staleness of off-policy samples, from floe's weights versions (shared by the async plugins).

Every floe sample records the ``weights_version`` of the sampler weights that produced it
(DESIGN principle 5). A framework's async trainer trains step g on samples generated earlier;
the staleness of a sample is ``policy_version − weights_version``, the policy version being the
version of the weights the step trains from (the plugin's last ``sync_weights``). The plugins
(SkyRL's fully-async trainer: skyrl/fully_async.py; verl's one-step off-policy trainer:
verl/one_step.py; verl's fully-async trainer: verl/fully_async.py, where a response a sync
interrupted counts from its oldest version) compute it here and report it under their framework's key names, with one
line per sample in a jsonl file.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


def staleness_stats(policy_version: int, versions: Sequence[int], limit: int) -> dict[str, float]:
    """Per-sample staleness ``policy_version − v`` over `versions`: ``mean``, ``max``, ``min``,
    ``ratio`` (the fraction > 0), ``violation_count`` (how many exceed `limit`, the trainer's
    staleness bound) and the versions' range ``weights_version_min`` / ``_max``.

    ValueError when `versions` is empty; RuntimeError when a sample is newer than the policy
    (a version bookkeeping bug: samples cannot come from weights not yet synced)."""
    if not versions:
        raise ValueError("staleness_stats needs at least one sample version")
    stalenesses = [int(policy_version) - int(v) for v in versions]
    if min(stalenesses) < 0:
        raise RuntimeError(f"a sample has weights version {max(versions)}, newer than the policy's {policy_version}")
    return {
        "mean": statistics.fmean(stalenesses),
        "max": max(stalenesses),
        "min": min(stalenesses),
        "ratio": sum(1 for s in stalenesses if s > 0) / len(stalenesses),
        "violation_count": sum(1 for s in stalenesses if s > limit),
        "weights_version_min": min(versions),
        "weights_version_max": max(versions),
    }


def append_samples(path: Path, records: Iterable[Mapping[str, Any]]) -> None:
    """Append one JSON line per record to `path` (an append-only log: each line is whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for record in records:
            f.write(json.dumps(dict(record)) + "\n")
