"""The zones' interfaces: what the Backend may ask of the policy, sampler and reference.

These are the seams a placement implements (today: `policy.PolicyZone`, `sampler.SamplerZone`
and `reference.ReferenceZone` in this process; a Ray placement will put each behind an actor).
Everything crossing them is plain data: floe.types requests and results, tensors by name,
ints, paths, and the dataclasses `WeightsSnapshot` and `ZoneState`; never a model or an optimizer.

Each zone owns its state and saves/loads it itself:
* policy: weights, optimizer, step, torch's RNG, written as files into the state directory
  (so a sharded policy writes its own shards; `state.py` has the layouts);
* sampler: weights version and the generator that seeds unseeded calls (its weights are the
  policy's, restored by a sync);
* reference: nothing (frozen).
Loading is two-phase: `check_state` raises before anything changes, `load_state` applies; the
Backend checks every zone first, so a bad state changes no zone.

Concurrency (the Backend's locks): a zone never sees two calls at once except the sampler's
`sample`, which may run concurrently with other `sample` calls; `receive` and `load_state`
of the sampler are never concurrent with anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from floe.backend.state import ZoneState
from floe.backend.weights import Fingerprint, WeightsSnapshot
from floe.compute.losses import LossSpec
from floe.sampler.engine import OnStep
from floe.types import Batch, ForwardBackwardResult, ForwardResult, OptimStepResult, SampleResult, SamplingParams


@runtime_checkable
class PolicyWorker(Protocol):
    """The model being trained, its optimizer and step."""

    @property
    def step(self) -> int:
        """Optimizer steps applied so far (the policy's weights version)."""
        ...

    @property
    def pending_calls(self) -> int:
        """forward_backward calls whose gradients wait for optim_step."""
        ...

    def forward(self, batch: Batch, temperature: float, with_entropy: bool) -> ForwardResult: ...

    def forward_backward(self, batch: Batch, spec: LossSpec, temperature: float) -> ForwardBackwardResult: ...

    def optim_step(self, lr: float | None = None) -> OptimStepResult:
        """Apply the pending gradients at learning rate `lr` (validated), or when None at the
        configured schedule's rate for this step; step + 1."""
        ...

    def publish(self) -> WeightsSnapshot:
        """The current weights (state-dict names) and their fingerprints, for a sync."""
        ...

    def save_state(self, directory: Path) -> dict[str, Any]:
        """Write the policy's files (weights — the fp32 masters under mixed precision —,
        optimizer moments, torch RNG) into `directory` (the Backend's temp state directory; a
        sharded policy's ranks write their own shards there) and return its state.json keys
        (step, param_groups, optimizer_scalars, policy_layout; layouts in `state.py`).
        StateError while gradients wait for optim_step (nothing written)."""
        ...

    def check_state(self, directory: Path, meta: dict[str, Any]) -> None:
        """StateError when the policy saved in `directory` (either layout, saved by any number
        of ranks) does not fit this policy (model, optimizer); changes nothing."""
        ...

    def load_state(self, directory: Path, meta: dict[str, Any]) -> None:
        """Apply a checked state; gradients not yet applied are discarded. Optimizer
        hyper-parameters are not restored: the policy's configured values win, for every key."""
        ...

    def export_hf(self, directory: Path) -> None:
        """Write the weights and model config as an HF model directory into `directory`."""
        ...

    def describe(self) -> dict[str, str]:
        """{"dtype": ..., "device": ..., "device_name": ...} of the weights (device_name: the
        hardware it computes on, floe.devices.device_name)."""
        ...


@runtime_checkable
class SamplerWorker(Protocol):
    """Generation with the last weights received, stamped with their version."""

    @property
    def version(self) -> int:
        """Syncs received since the start (or the version restored by load_state)."""
        ...

    @property
    def engine_name(self) -> str: ...

    def validate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> None:
        """The engine's own limits (InvalidInput); reads nothing that changes."""
        ...

    @property
    def streams_tokens(self) -> bool:
        """True when `sample`'s `on_step` is called while the engine decodes; False when the
        steps are replayed from the finished samples (`floe.sampler.engine.replay_steps`)."""
        ...

    def sample(self, prompts: list[list[int]], n: int, params: SamplingParams,
               on_step: OnStep | None = None) -> SampleResult:
        """n samples per prompt; `on_step` gets every decode step's tokens (`floe.sampler.engine`:
        rows gi * n + k), live or replayed; what it raises (`StopGeneration`) ends the call."""
        ...

    def held_dtypes(self) -> dict[str, str]:
        """The dtype name ("float32", "bfloat16", ...) the engine holds each weight in, by
        state-dict name; a sync casts the published tensors to these (`sync.cast_for`)."""
        ...

    def receive(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, Fingerprint]:
        """Take new weights; returns the fingerprints of what the sampler now holds. From here
        until `set_version` the sampler refuses to sample (its weights are not its version's)."""
        ...

    def set_version(self, version: int) -> None:
        """Record that the weights now held are version `version` (after a verified sync); the
        sampler samples again."""
        ...

    def save_state(self) -> ZoneState:
        """Version and generator state."""
        ...

    def check_state(self, state: ZoneState) -> None: ...

    def load_state(self, state: ZoneState) -> None:
        """Restore version and generator (weights arrive by a sync from the restored policy)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class ReferenceWorker(Protocol):
    """A frozen model for KL terms: log-probs only."""

    def forward(self, batch: Batch, temperature: float, with_entropy: bool) -> ForwardResult: ...
