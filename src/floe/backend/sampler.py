"""The sampler zone: an engine's generation, stamped with the weights version it ran on.

The zone owns the version (syncs received) and the generator that seeds calls without a seed;
generation itself is the engine's (`floe.sampler`). Several `sample` calls may run at once
(the Backend holds the sampler shared for them): each reads the version once, draws its seed
under a small lock, and the engine keeps all per-call state local.

Seeds: a call has one seed (`params.seed`, or one drawn from the zone's generator); it becomes
one seed per prompt (`prompt_seeds`), and the engine draws prompt i's samples from seeds[i]
alone. So `sample` = `generate(prompts, n, params, prompt_seeds(seed, len(prompts)))`, and a
driver with several replicas (placement) draws the call seed itself, splits the prompts
(`split_prompts`), calls each replica's `generate` with its prompts and their seeds, and
joins the answers (`merge_results`): the same samples as one zone would give.

Weights arrive whole (`receive`, one process) or streamed in buckets (`begin_receive`,
`receive_bucket`..., `end_receive`, across processes: `floe.backend.sync.broadcast`). Until a
streamed receive has ended with every tensor received, the zone's weights are incomplete
(`weights_complete` is False). Either way, from the first tensor a receive changes until the
Backend has verified the sync and called `set_version` (or `load_state`, after the verified
push of a restored policy), the weights are not the ones the version names
(`weights_match_version` is False) and the zone refuses to sample: after ANY failed sync (a
transfer cut short, a fingerprint mismatch, a dead replica) no sample is ever stamped with a
version its weights are not, until a sync succeeds. A sync refused before anything moved (e.g.
non-finite policy weights) leaves the zone as it was.

Dtypes: `held_dtypes()` says what the engine holds each weight in; the sync methods cast the
policy's tensors to those before sending (`backend.sync.cast_for`), so an fp32 policy syncs into
a bf16 engine (and the other way round) and the fingerprints compared are those of the same,
cast, tensors.

Sleep / wake (colocation): `sleep()` releases the engine's device memory, `wake()` brings it
back (`SamplerEngine.sleep`); sampling while asleep raises StateError. `memory()` says where
the weights are.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from floe.backend.state import ZoneState
from floe.backend.validation import VERSION_LIMIT
from floe.backend.weights import Fingerprint
from floe.errors import InvalidInput, StateError
from floe.sampler.engine import OnStep, SamplerEngine, seeds_match_prompts
from floe.sampler.noise import derive
from floe.types import SampleResult, SamplingParams


def prompt_seeds(seed: int, num_prompts: int) -> list[int]:
    """One seed per prompt of a call seeded `seed` (any int): seeds[i] = derive(seed, i)
    (`floe.sampler.noise.derive`, SplitMix64 of the seed and the prompt index), in [0, 2^63).
    Deterministic and well mixed; prompt i's seed does not depend on the number of prompts."""
    return [derive(seed, i) for i in range(num_prompts)]


def split_prompts(num_prompts: int, n: int, replicas: int) -> list[range]:
    """`replicas` contiguous ranges of prompt indices covering range(num_prompts) in order,
    balanced (sizes differ by at most one, larger first). Every prompt has n samples, so
    rows (prompts × n) are balanced too. Ranges past the number of prompts are empty: give
    those replicas nothing. InvalidInput for n < 1, replicas < 1 or num_prompts < 0."""
    if replicas < 1:
        raise InvalidInput("replicas", f"must be at least 1, got {replicas}")
    if n < 1:
        raise InvalidInput("n", f"must be at least 1, got {n}")
    if num_prompts < 0:
        raise InvalidInput("num_prompts", f"must be >= 0, got {num_prompts}")
    base, extra = divmod(num_prompts, replicas)
    ranges, start = [], 0
    for r in range(replicas):
        size = base + (1 if r < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def merge_results(parts: list[SampleResult]) -> SampleResult:
    """One `SampleResult` from the replicas' parts, given in prompt order (as `split_prompts`
    cut them): groups concatenated, tokens summed, seconds the longest part's (the replicas
    run at the same time). StateError unless every part ran on the same weights version;
    InvalidInput when there are no parts."""
    if not parts:
        raise InvalidInput("parts", "no results to merge: give at least one replica's SampleResult")
    versions = sorted({p.weights_version for p in parts})
    if len(versions) != 1:
        raise StateError(f"sample: sampler replicas answered with different weights versions {versions}; "
                         "sync_weights must reach every replica before it samples")
    return SampleResult([g for p in parts for g in p.groups], versions[0], sum(p.num_tokens for p in parts),
                        max(p.seconds for p in parts))


class SamplerZone:
    """Implements `zones.SamplerWorker` around one `SamplerEngine`."""

    def __init__(self, engine: SamplerEngine, engine_name: str, seed: int):
        self.engine = engine
        self.engine_name = engine_name
        self._version = 0
        self._generator = torch.Generator(device="cpu").manual_seed(seed)  # seeds unseeded calls
        self._seed_lock = threading.Lock()
        self._received: set[str] | None = None  # names received by the streamed receive under way
        self._complete = True  # False from begin_receive until end_receive succeeds
        self._matches_version = True  # False from a receive's first change until set_version / load_state

    @property
    def version(self) -> int:
        return self._version

    @property
    def model(self) -> Any:
        """The engine's model, for tests and benchmarks that inspect the sampler's weights
        directly (engines that hold a torch module in this process have one)."""
        return self.engine.model  # type: ignore[attr-defined]

    def validate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> None:
        self.engine.validate(prompts, n, params)

    @property
    def streams_tokens(self) -> bool:
        """Whether `sample(..., on_step)` reports steps while decoding (the engine's
        `streams_tokens`) rather than replaying them from the finished samples."""
        return self.engine.streams_tokens

    def sample(self, prompts: list[list[int]], n: int, params: SamplingParams,
               on_step: OnStep | None = None) -> SampleResult:
        """`generate` with `prompt_seeds` of the call seed: `params.seed`, or (None) one drawn
        from the zone's generator. `on_step`: the engine's step callback (`floe.sampler.engine`)."""
        seed = params.seed
        if seed is None:
            with self._seed_lock:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._generator))
        return self.generate(prompts, n, params, prompt_seeds(seed, len(prompts)), on_step)

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams, seeds: list[int],
                 on_step: OnStep | None = None) -> SampleResult:
        """n samples of each prompt, prompt i's drawn from `seeds[i]` alone (the replica entry
        point; `params.seed` is not read). InvalidInput("seeds") unless one seed per prompt;
        StateError while asleep or while the weights are incomplete (a streamed receive not
        ended). `on_step` goes to the engine (what it raises propagates)."""
        start = time.perf_counter()
        seeds_match_prompts(prompts, seeds)
        self.check_weights()
        version = self._version
        groups = self.engine.generate(prompts, n, params, seeds, version, on_step) if on_step is not None else \
            self.engine.generate(prompts, n, params, seeds, version)
        num_tokens = sum(len(s.tokens) for g in groups for s in g.samples)
        return SampleResult(groups, version, num_tokens, time.perf_counter() - start)

    def check_weights(self) -> None:
        """StateError unless the weights held are complete and the ones the version names."""
        if not self._complete:
            raise StateError("sample: the sampler's weights are incomplete (a weight sync failed midway or has not "
                             "ended); run sync_weights again")
        if not self._matches_version:
            raise StateError(f"sample: the sampler's weights are not those of its version {self._version} (a weight "
                             "sync changed them and then failed, or has not been verified); run sync_weights again")

    def held_dtypes(self) -> dict[str, str]:
        """The dtype name of every weight the engine holds (`SamplerEngine.dtypes`)."""
        return self.engine.dtypes()

    def held_fingerprints(self) -> dict[str, Fingerprint]:
        """Fingerprints of the weights the engine holds now (`SamplerEngine.fingerprints`)."""
        return self.engine.fingerprints()

    def receive(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, Fingerprint]:
        """Take every tensor at once (StateError before any change when names or shapes
        differ); returns the fingerprints the engine now holds. The weights no longer match the
        version until `set_version` (module docstring)."""
        self._matches_version = False  # load_weights checks first: a refused receive changes nothing but this
        self.engine.load_weights(tensors)
        self._received, self._complete = None, True
        return self.engine.fingerprints()

    @property
    def weights_complete(self) -> bool:
        """False from `begin_receive` until an `end_receive` that found every tensor received."""
        return self._complete

    @property
    def weights_match_version(self) -> bool:
        """False from a receive until the Backend's `set_version` (or `load_state`) after a verified sync."""
        return self._matches_version

    def begin_receive(self) -> None:
        """Start a streamed receive: the weights count as incomplete until `end_receive`, and
        as not matching the version until `set_version`."""
        self._received, self._complete, self._matches_version = set(), False, False

    def receive_bucket(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy one bucket (any subset of the names) into the engine's weights in place.
        StateError (bucket not copied) for unknown names or wrong shapes, or without
        `begin_receive`. Extra memory: none beyond the bucket itself."""
        if self._received is None:
            raise StateError("receive_bucket: no streamed receive under way; call begin_receive first")
        self.engine.load_weights(tensors, partial=True)
        self._received.update(tensors)

    def end_receive(self) -> dict[str, Fingerprint]:
        """End a streamed receive: StateError (weights stay incomplete) unless every tensor
        arrived; else the fingerprints of ALL the engine's tensors (for `verify`)."""
        if self._received is None:
            raise StateError("end_receive: no streamed receive under way; call begin_receive first")
        held = self.engine.fingerprints()
        missing = sorted(set(held) - self._received)
        if missing:
            self._received = None
            raise StateError(f"sync_weights: the streamed weights missed {len(missing)} tensors, e.g. {missing[:5]}; "
                             "the sampler's weights are incomplete until a full sync")
        self._received, self._complete = None, True
        return held

    @property
    def asleep(self) -> bool:
        return self.engine.asleep

    def sleep(self) -> None:
        """Release the engine's device memory (`SamplerEngine.sleep`; on a CPU engine nothing
        moves and only the state is recorded). StateError when the engine cannot sleep."""
        self.engine.sleep()

    def wake(self) -> None:
        """Bring the engine's weights and caches back (`SamplerEngine.wake`)."""
        self.engine.wake()

    def memory(self) -> dict[str, str | int | bool]:
        """The engine's `memory()`: where the weights are and the bytes held on its device."""
        return self.engine.memory()

    def set_version(self, version: int) -> None:
        """Record that the weights now held are version `version` (after a verified sync): the
        zone samples again."""
        self._version = version
        self._matches_version = True

    def save_state(self) -> ZoneState:
        with self._seed_lock:
            rng = self._generator.get_state()
        return ZoneState({"rng.safetensors": {"sampler": rng}}, {"sampler_version": self._version})

    def check_state(self, state: ZoneState) -> None:
        if "sampler" not in state.tensors.get("rng.safetensors", {}) or type(state.meta.get("sampler_version")) is not int:
            raise StateError("load_state: the state has no sampler version or generator; it is not a floe state")
        if not 0 <= state.meta["sampler_version"] <= VERSION_LIMIT:
            raise StateError(f"load_state: the state's sampler version {state.meta['sampler_version']} is outside "
                             "[0, 2**63 - 1]; it is not a state floe wrote")

    def load_state(self, state: ZoneState) -> None:
        """Restore version and generator; called after the verified push of the restored policy's
        weights, so the weights now held are that version's."""
        self._version = int(state.meta["sampler_version"])
        self._matches_version = True
        with self._seed_lock:
            self._generator.set_state(state.tensors["rng.safetensors"]["sampler"])

    def close(self) -> None:
        self.engine.close()
