"""Driver-side zone objects of the Ray placement: they implement the zone protocols of
`backend.zones` by calling the actors (`actors.py`) through `calls.gather`.

* `RayPolicy`: P policy ranks. forward / forward_backward split the batch
  (`backend.data_parallel.split_batch`: groups whole, balanced, global loss scales; for a loss
  with a batch statistic, clip_cov and kl_cov, a no-grad pre-pass first computes it over the
  whole batch, `policy.batch_token_stats`, and the shares carry it), send each
  rank its share, and merge the answers; every other call goes to all ranks (they are
  collectives) and rank 0's answer is the result.
* `RaySamplerGroup`: R sampler replicas behind one `SamplerZone` face: the call seed, the
  version and the generator state are the group's own (inherited from `SamplerZone`, so they
  behave exactly as the local zone's); `generate` splits the prompts (`split_prompts`), sends
  each replica its prompts with their per-prompt seeds, and merges (`merge_results`).
* `RayReference`: the reference zone on its own actor or in policy rank 0's.
Only plain data crosses: floe.types requests/results, RankShares, paths, tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ray
import torch

from floe.backend.data_parallel import merge_forward, merge_forward_backward, split_batch
from floe.backend.policy import batch_token_stats
from floe.backend.sampler import SamplerZone, merge_results, split_prompts
from floe.backend.weights import Fingerprint, WeightsSnapshot
from floe.compute.losses import LossSpec
from floe.errors import FloeError, StateError, WorkerFailed
from floe.placement.ray.calls import Call, gather, one
from floe.sampler.engine import OnStep, replay_steps
from floe.types import Batch, ForwardBackwardResult, ForwardResult, OptimStepResult, SampleResult, SamplingParams

__all__ = ["RayPolicy", "RayReference", "RaySamplerGroup"]


class RayPolicy:
    """Implements `zones.PolicyWorker` over P `actors.PolicyRankHost` actors."""

    def __init__(self, ranks: list[Any], timeout_s: float):
        self.ranks = ranks
        self.timeout_s = timeout_s
        self._step = 0
        self._pending = 0
        self.on_device = True  # False while offloaded (colocation)

    @property
    def step(self) -> int:
        return self._step

    @property
    def pending_calls(self) -> int:
        return self._pending

    def _all(self, method: str, *args: Any) -> list[Any]:
        return gather([Call("policy", i, r.call.remote(method, *args)) for i, r in enumerate(self.ranks)], self.timeout_s)

    def _each(self, method: str, per_rank: list[tuple[Any, ...]]) -> list[Any]:
        calls = [Call("policy", i, r.call.remote(method, *args)) for i, (r, args) in enumerate(zip(self.ranks, per_rank))]
        return gather(calls, self.timeout_s)

    def _counters(self) -> None:
        """Step and pending calls as rank 0 holds them (after a call that may have changed them)."""
        step, pending = one(Call("policy", 0, self.ranks[0].get.remote("step", "pending_calls")), self.timeout_s)
        self._step, self._pending = int(step), int(pending)

    def forward(self, batch: Batch, temperature: float, with_entropy: bool) -> ForwardResult:
        shares = split_batch(batch, len(self.ranks), None)
        results = self._each("forward", [(s, temperature, with_entropy) for s in shares])
        return merge_forward(len(batch.groups), shares, results)

    def _refreshing(self, call: Callable[[], Any]) -> Any:
        """`call()`; when it raises one of the zone's own errors (the workers are alive, e.g.
        StateError for non-finite gradients, which discards them), step and pending calls are
        read back from rank 0 before the error goes on. A WorkerFailed goes on as it is."""
        try:
            return call()
        except WorkerFailed:
            raise
        except FloeError:
            self._counters()
            raise

    def forward_backward(self, batch: Batch, spec: LossSpec, temperature: float) -> ForwardBackwardResult:
        stats = None
        if spec.definition.batch_statistic is not None:  # global over the call: a no-grad pre-pass here
            stats = batch_token_stats(batch, spec, self.forward(batch, temperature, False).logprobs, torch.device("cpu"))
        shares = split_batch(batch, len(self.ranks), spec, stats)
        partials = self._refreshing(lambda: self._each("forward_backward", [(s, spec, temperature) for s in shares]))
        self._pending += 1
        return merge_forward_backward(batch, shares, partials, spec)

    def optim_step(self, lr: float | None = None) -> OptimStepResult:
        result = self._refreshing(lambda: self._all("optim_step", lr)[0])
        self._step, self._pending = result.step, 0
        return result

    def all_finite(self) -> bool:
        return all(self._all("all_finite"))

    def publish(self) -> WeightsSnapshot:
        """Every full tensor on the driver (through the object store); for inspection and tests.
        Syncs do not use it (`sync.py` moves weights worker to worker)."""
        got = gather([Call("policy", i, r.put_weights.remote(1 << 30)) for i, r in enumerate(self.ranks)], self.timeout_s)
        refs, prints, _ = got[0]
        tensors: dict[str, torch.Tensor] = {}
        for bucket in gather([Call("policy", 0, ref) for ref in refs], self.timeout_s):
            tensors.update(bucket)
        return WeightsSnapshot(tensors, prints, self._step)

    def save_state(self, directory: Path) -> dict[str, Any]:
        return self._all("save_state", directory)[0]

    def check_state(self, directory: Path, meta: dict[str, Any]) -> None:
        self._all("check_state", directory, meta)

    def load_state(self, directory: Path, meta: dict[str, Any]) -> None:
        self._refreshing(lambda: self._all("load_state", directory, meta))
        self._counters()

    def export_hf(self, directory: Path) -> None:
        self._all("export_hf", directory)

    def describe(self) -> dict[str, str]:
        return one(Call("policy", 0, self.ranks[0].call.remote("describe")), self.timeout_s)

    def memory(self) -> list[dict[str, str]]:
        """Every rank's `describe()` (where its parameters, gradients and optimizer state are)."""
        return self._all("describe")

    def offload(self) -> None:
        self._all("offload")
        self.on_device = False

    def onload(self) -> None:
        self._all("onload")
        self.on_device = True


class RaySamplerGroup(SamplerZone):
    """Implements `zones.SamplerWorker` over R `actors.SamplerHost` replicas.

    Seeds, version and generator state are SamplerZone's own (this object holds no engine):
    `sample` draws the call seed exactly as a local zone does, and `generate` fans out.
    Replicas never see `params.seed`; each gets its prompts' seeds."""

    def __init__(self, replicas: list[Any], engine_name: str, seed: int, timeout_s: float):
        super().__init__(None, engine_name, seed)  # type: ignore[arg-type]
        self.replicas = replicas
        self.timeout_s = timeout_s
        self._dtypes: dict[str, str] | None = None

    @property
    def model(self) -> Any:
        raise StateError("the sampler runs in Ray actors: its model is not in this process")

    def _all(self, method: str, *args: Any) -> list[Any]:
        calls = [Call("sampler", i, r.call.remote(method, *args)) for i, r in enumerate(self.replicas)]
        return gather(calls, self.timeout_s)

    def validate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> None:
        one(Call("sampler", 0, self.replicas[0].call.remote("validate", prompts, n, params)), self.timeout_s)

    @property
    def streams_tokens(self) -> bool:
        """False: replicas answer whole samples; `on_step` is replayed from them (`replay_steps`)."""
        return False

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams, seeds: list[int],
                 on_step: OnStep | None = None) -> SampleResult:
        """Fan out over the replicas and merge; with `on_step`, the merged samples are replayed
        as steps afterwards (the tokens are those a live engine would report, only later)."""
        parts = [r for r in split_prompts(len(prompts), n, len(self.replicas)) if len(r)] or [range(0)]
        calls = [
            Call("sampler", i, self.replicas[i].call.remote(
                "generate", [prompts[k] for k in part], n, params, [seeds[k] for k in part]))
            for i, part in enumerate(parts)
        ]
        result = merge_results(gather(calls, self.timeout_s))
        if on_step is not None:
            replay_steps(result.groups, on_step)
        return result

    def held_dtypes(self) -> dict[str, str]:
        """The dtypes the replicas' engines hold (the same config everywhere: replica 0's, asked once)."""
        if self._dtypes is None:
            self._dtypes = one(Call("sampler", 0, self.replicas[0].call.remote("held_dtypes")), self.timeout_s)
        return dict(self._dtypes)

    def receive(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, Fingerprint]:
        """Every replica takes `tensors` whole; StateError unless all report the same fingerprints."""
        ref = ray.put(dict(tensors))
        return same_fingerprints(self._all("receive", ref))

    def set_version(self, version: int) -> None:
        self._all("set_version", version)
        super().set_version(version)

    def load_state(self, state: Any) -> None:
        super().load_state(state)
        self._all("set_version", self.version)

    @property
    def asleep(self) -> bool:
        return all(a for (a,) in gather(
            [Call("sampler", i, r.get.remote("asleep")) for i, r in enumerate(self.replicas)], self.timeout_s))

    def sleep(self) -> None:
        self._all("sleep")

    def wake(self) -> None:
        self._all("wake")

    def memory(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """Every replica's `memory()`."""
        return self._all("memory")

    def close(self) -> None:
        pass  # the actors go with the placement (`placement.ray.build_ray`'s close)


def same_fingerprints(answers: list[dict[str, Fingerprint]]) -> dict[str, Fingerprint]:
    """The replicas' fingerprints when all are equal; StateError naming the first replica that differs."""
    first = answers[0]
    for i, other in enumerate(answers[1:], start=1):
        if other != first:
            differ = sorted(k for k in first.keys() | other.keys() if first.get(k) != other.get(k))[:5]
            raise StateError(f"sync_weights: sampler replica {i} holds different weights than replica 0 ({differ})")
    return first


class RayReference:
    """Implements `zones.ReferenceWorker` on its own actor (`ReferenceHost`) or inside policy
    rank 0's (`PolicyRankHost.reference_forward`)."""

    def __init__(self, actor: Any, in_policy: bool, timeout_s: float):
        self.actor = actor
        self.in_policy = in_policy
        self.timeout_s = timeout_s

    def forward(self, batch: Batch, temperature: float, with_entropy: bool) -> ForwardResult:
        if self.in_policy:
            ref = self.actor.reference_forward.remote(batch, temperature, with_entropy)
        else:
            ref = self.actor.call.remote("forward", batch, temperature, with_entropy)
        return one(Call("reference", 0, ref), self.timeout_s)
