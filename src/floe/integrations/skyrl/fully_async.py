"""SkyRL's fully-async trainer (``trainer.fully_async.enabled=true``) on a floe backend.

`FloeFullyAsyncTrainer` is SkyRL 0.4.0's own ``FullyAsyncRayPPOTrainer`` (its generation
workers, staleness manager, buffer and training loop, unchanged) with floe's models
(dispatch.FloeTrainerMixin). Generation overlaps training: the workers sample through a forked
floe client (its own ordered stream) while the trainer thread runs ``forward_backward`` /
``optim_step`` on the main one. After each step SkyRL calls ``save_weights_for_sampler``:
floe's ``sync_weights(version=<step>)`` waits for the sample calls already running (each
finishes on the weights it started with, so every response has exactly one weights version)
and holds new ones until the sampler has the new weights. That is SkyRL's
pause / sync / resume, with a running request finishing instead of freezing.

Staleness from floe's versions: `VersionedGenerator` wraps SkyRL's generator and collects the
floe ``weights_version`` of every response of a group (inference.record_versions, per SkyRL
session = trajectory); a trajectory's version is the oldest of its turns. At step g,
staleness of a sample = v_now − v_sample, v_now the sampler version of the policy being
trained (the last sync, after step g − 1). SkyRL's own ``async/staleness_{mean,max,min,ratio,
violation_count}`` (which it computes from the step each group was scheduled at) are replaced
by these per-sample values, SkyRL's are kept as ``async/scheduled_staleness_{mean,max}``,
``floe/weights_version_{min,max}`` are added, and one line per sample (step, uid, weights
version, staleness) goes to ``<trainer.export_path>/floe_samples.jsonl``. Since a response
never spans a sync, floe's staleness is at most SkyRL's scheduled one, which its capacity rule
bounds by ``trainer.fully_async.max_staleness_steps`` in steady state.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.train.fully_async_trainer import FullyAsyncRayPPOTrainer, GeneratedOutputGroup
from skyrl.train.generators.base import GeneratorInput, GeneratorOutput

from floe.errors import InvalidInput
from floe.integrations.skyrl.dispatch import FloeTrainerMixin
from floe.integrations.skyrl.inference import record_versions
from floe.integrations.staleness import append_samples, staleness_stats

log = logging.getLogger("floe.integrations.skyrl")
VERSIONS_KEY = "floe_weights_versions"  # per output row: the floe weights version that produced it
SAMPLES_FILE = "floe_samples.jsonl"


def session_id(trajectory_id: Any) -> str:
    """The session id SkyRLGymGenerator.agent_loop gives a trajectory (``<instance>_<repetition>``)."""
    return f"{trajectory_id.instance_id}_{trajectory_id.repetition_id}"


def row_versions(sink: dict[Any, list[int]], input_batch: GeneratorInput, output: GeneratorOutput) -> list[int]:
    """The floe weights version of each row of `output` (one row per trajectory, or per step
    with step-wise trajectories): the oldest version among its trajectory's responses. Without
    trajectory ids (no session to tell trajectories apart) every row gets the group's oldest.
    RuntimeError when a trajectory has no recorded response (the generator did not sample
    through FloeInferenceClient)."""
    rows = len(output["response_ids"])
    ids = output.get("trajectory_ids") or input_batch.get("trajectory_ids")
    if ids is None or len(ids) != rows:
        if not sink:
            raise RuntimeError("no floe weights version was recorded for this generation group")
        oldest = min(min(v) for v in sink.values())
        return [oldest] * rows
    out = []
    for tid in ids:
        versions = sink.get(session_id(tid))
        if not versions:
            raise RuntimeError(f"no floe weights version was recorded for trajectory {session_id(tid)!r}")
        out.append(min(versions))
    return out


class VersionedGenerator:
    """SkyRL's generator, each training-phase output carrying `VERSIONS_KEY` (row_versions).
    Every other attribute is the wrapped generator's."""

    def __init__(self, inner: Any):
        self._inner = inner
        self._tqdm_flag = "disable_tqdm" in inspect.signature(inner.generate).parameters

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def generate(self, input_batch: GeneratorInput, disable_tqdm: bool = False) -> GeneratorOutput:
        kwargs = {"disable_tqdm": disable_tqdm} if self._tqdm_flag else {}
        with record_versions() as sink:
            output: GeneratorOutput = await self._inner.generate(input_batch, **kwargs)
        meta = input_batch.get("batch_metadata")
        if meta is None or meta.training_phase == "train":
            output[VERSIONS_KEY] = row_versions(sink, input_batch, output)  # type: ignore[literal-required]
        return output


def staleness_metrics(now: int, versions: list[int], max_staleness_steps: int) -> dict[str, float]:
    """SkyRL's ``async/staleness_*`` keys (FullyAsyncRayPPOTrainer.convert_generation_group_
    mini_batch_to_training_input), per sample from floe's versions (staleness.staleness_stats),
    plus the versions' range."""
    stats = staleness_stats(now, versions, max_staleness_steps)
    out = {f"async/staleness_{k}": stats[k] for k in ("mean", "max", "min", "ratio", "violation_count")}
    return {**out, "floe/weights_version_min": stats["weights_version_min"],
            "floe/weights_version_max": stats["weights_version_max"]}


class FloeFullyAsyncTrainer(FloeTrainerMixin, FullyAsyncRayPPOTrainer):
    """SkyRL's fully-async trainer with floe's models and floe's staleness (module doc)."""

    def convert_generation_group_mini_batch_to_training_input(
        self, cur_generation_group_mini_batch: list[GeneratedOutputGroup],
        dropped_groups: list[GeneratedOutputGroup] | None = None,
    ) -> TrainingInputBatch:
        versions_by_group = [self._pop_versions(g) for g in cur_generation_group_mini_batch]
        for g in dropped_groups or []:
            self._pop_versions(g)
        training_input = super().convert_generation_group_mini_batch_to_training_input(
            cur_generation_group_mini_batch, dropped_groups)
        now = int(self.inference_engine_client.weight_version)  # the policy's version: the last sync
        versions = [v for vs in versions_by_group for v in vs]
        scheduled = {k: self.all_metrics[f"async/staleness_{k}"] for k in ("mean", "max")}
        self.all_metrics.update({f"async/scheduled_staleness_{k}": v for k, v in scheduled.items()})
        self.all_metrics.update(staleness_metrics(now, versions, self.max_staleness_steps))
        if self.all_metrics["async/staleness_violation_count"]:
            log.warning("floe: %s samples are more than trainer.fully_async.max_staleness_steps=%s versions old",
                        self.all_metrics["async/staleness_violation_count"], self.max_staleness_steps)
        self._write_samples(cur_generation_group_mini_batch, versions_by_group, now)
        return training_input

    @staticmethod
    def _pop_versions(group: GeneratedOutputGroup) -> list[int]:
        versions: list[int] | None = group.generator_output.pop(VERSIONS_KEY, None)  # type: ignore[misc, assignment]
        if versions is None:
            raise RuntimeError(f"generation group {group.uid} carries no floe weights versions (VersionedGenerator)")
        return list(versions)

    def _write_samples(self, groups: list[GeneratedOutputGroup], versions_by_group: list[list[int]], now: int) -> None:
        append_samples(Path(self.cfg.trainer.export_path) / SAMPLES_FILE, (
            {"step": self.global_step, "uid": g.uid, "row": j, "weights_version": v, "policy_version": now,
             "staleness": now - v, "scheduled_at_step": g.global_step_when_scheduled}
            for g, versions in zip(groups, versions_by_group) for j, v in enumerate(versions)))


def check_fully_async(cfg: Any) -> None:
    """The fully-async keys floe cannot honour, refused by name (InvalidInput)."""
    fa = cfg.trainer.fully_async
    if fa.simulate_training:
        raise InvalidInput("trainer.fully_async.simulate_training",
                           "simulates the trainer without models; there is nothing for floe to run: drop the key")
    if cfg.generator.inference_engine.offload_kv_for_weight_sync:
        raise InvalidInput("generator.inference_engine.offload_kv_for_weight_sync",
                           "floe's sampler keeps its memory across a sync; drop the key")
