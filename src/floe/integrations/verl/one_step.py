"""verl 0.9.1's one-step off-policy trainer on a floe backend, staleness per sample.

    python -m verl.experimental.one_step_off_policy.main_ppo <recipe ...> trainer.v1.trainer_mode=floe

verl's own entrypoint, config (`one_step_off_ppo_trainer.yaml`) and trainer loop
(`OneStepOffRayTrainer.fit`: the batch of step k+1 is generated while step k trains, its
weights synced once per step) run unchanged; `FloeOneStepTrainer` replaces only what needs GPUs:
`init_workers` builds no resource pools or FSDP workers, the actor / reference calls go to floe
(`FloeTensorDictWorkerGroup`: verl's TensorDict batches, the V1 plugin's worker group logic), the
rollout replicas are floe's (`plugin.FloeReplica`, sampling through their own clients, so
generation runs on the backend's sampler while the trainer's client trains), and the weight
sync is `plugin.FloeWeightSync` (`sync_weights(version=offset + global_steps)`).

The entrypoint builds `verl.experimental.one_step_off_policy.ray_trainer.OneStepOffRayTrainer`
by name; `install` (run at `import verl`: this module is its own `verl.plugins` entry point) puts `one_step_trainer` there: it
builds floe's trainer when `trainer.v1.trainer_mode=floe` (the same one key as verl's
synchronous `main_ppo`; this entrypoint does not otherwise read `trainer.v1`) and verl's own
class, untouched, otherwise.

Staleness (floe.integrations.staleness): each sample carries the verl step its weights were
synced at (`global_steps`, which floe's rollout server reports as `weights_version − offset`),
so its floe weights version is `offset + global_steps`. At step k the policy trains from the
weights synced at the start of step k (verl's `_fit_generate` syncs before launching the next
generation); staleness = that version − the sample's version, reported in the step's metrics
(`floe/staleness/*`, verl has no per-sample staleness key for this trainer) and one line per
sample in `<trainer.default_local_dir>/floe_samples.jsonl`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from verl.experimental.one_step_off_policy import ray_trainer
from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer
from verl.utils import tensordict_utils as tu
from verl.utils.import_utils import load_class_from_fqn
from verl.workers.rollout.llm_server import LLMServerManager

from floe.convert import unpad_rows
from floe.errors import InvalidInput
from floe.integrations.staleness import append_samples, staleness_stats
from floe.integrations.verl.backend_config import floe_target
from floe.integrations.verl.plugin import FloeWeightSync, FloeWorkerGroup, start_session

SAMPLES_FILE = "floe_samples.jsonl"
MAX_STALENESS = 1  # verl's one-step trainer: a batch is generated one sync before it trains


class _TensorDictInfo:
    """A TensorDict batch's non-tensor settings (temperature, mini_batch_size, ...) with .get."""

    def __init__(self, batch: Any):
        self.batch = batch

    def get(self, key: str, default: Any = None) -> Any:
        return tu.get(self.batch, key, default)


class FloeTensorDictWorkerGroup(FloeWorkerGroup):
    """`FloeWorkerGroup` for verl's legacy trainer calls (`RayPPOTrainer._compute_old_log_prob`,
    `_compute_ref_log_prob`, `_update_actor`): the batch is a TensorDict after verl's
    `left_right_2_no_padding` (`input_ids` jagged prompt + response, `prompts` / `responses` /
    `attention_mask` padded, per-token fields padded over the response, settings as non-tensor
    data); answers are TensorDicts verl's `tu.get` reads. The floe calls are the V1 group's."""

    def _fetch(self, batch: Any, fields: list[str]) -> dict[str, list[Any]]:
        prompt_width = batch["prompts"].shape[1]
        lengths = [int(n) for n in batch["attention_mask"][:, prompt_width:].sum(-1).tolist()]
        sequences = [t.tolist() for t in batch["input_ids"].unbind()]
        rows: dict[str, list[Any]] = {
            "uid": list(tu.get(batch, "uid")),
            "prompts": [s[: len(s) - n] for s, n in zip(sequences, lengths)],
            "responses": [s[len(s) - n:] for s, n in zip(sequences, lengths)],
        }
        for name in fields:
            rows[name] = unpad_rows(batch[name], lengths, name)
        return rows

    def _info(self, batch: Any) -> Any:
        return _TensorDictInfo(batch)

    def _has(self, batch: Any, field: str) -> bool:
        return field in batch

    def _answer_log_probs(self, batch: Any, fields: dict[str, torch.Tensor]) -> Any:
        # perf/mfu/actor_infer: floe measures the seconds of its training calls only (throughput.py)
        return tu.get_tensordict(fields, non_tensor_dict={"metrics": {"mfu": 0.0}})

    def _answer_update(self, metrics: dict[str, list[float]]) -> Any:
        return tu.get_tensordict({}, non_tensor_dict={"metrics": metrics})


def check_one_step(cfg: dict[str, Any]) -> None:
    """The one-step trainer's keys floe cannot honour, refused by name (InvalidInput)."""
    rollout = cfg["actor_rollout_ref"]["rollout"]
    if rollout.get("checkpoint_manager_class"):
        raise InvalidInput("actor_rollout_ref.rollout.checkpoint_manager_class",
                           "floe syncs the policy into its sampler itself (sync_weights); drop the key")
    if cfg["actor_rollout_ref"]["actor"].get("calculate_sum_pi_squared"):
        raise InvalidInput("actor_rollout_ref.actor.calculate_sum_pi_squared",
                           "floe's forward returns log-probs and entropy, not Σπ²; set it false")
    target = floe_target(cfg)
    if target.url is None and target.hardware.gpus:
        raise InvalidInput("rollout.n_gpus_per_node", (
            "the plugin's own backend places floe's sampler on the trainer's GPUs (trainer.n_gpus_per_node x "
            "trainer.nnodes); separate rollout GPUs are not mapped: start a `floe serve` placed as you want and "
            "pass +floe.url=..., or train on the CPU with +floe.backend.device=cpu"))


class FloeOneStepTrainer(OneStepOffRayTrainer):
    """verl's one-step off-policy trainer with floe's models and floe's staleness (module doc)."""

    def init_workers(self) -> None:
        session = start_session(self.config, self.use_critic, FloeTensorDictWorkerGroup, check=check_one_step)
        self.floe_server = session.server
        self.ref_in_actor = False  # floe's reference zone is the base model, with or without LoRA
        self.actor_rollout_wg = self.actor_wg = session.worker_group
        if self.use_reference_policy:
            self.ref_policy_wg = self.actor_rollout_wg
        self.rm_wg = None
        self._init_reward_loop()
        self._init_async_rollout_manager()
        self.checkpoint_manager = FloeWeightSync(session.client, self.llm_server_manager.get_replicas())
        self.floe_samples = Path(self.config.trainer.default_local_dir) / SAMPLES_FILE

    def _init_async_rollout_manager(self) -> None:
        """verl's own (OneStepOffRayTrainer._init_async_rollout_manager), with the replicas given
        the floe worker group: `FloeReplica.init_hybrid` learns the backend's address from it."""
        from verl.experimental.agent_loop import AgentLoopManager  # noqa: PLC0415 - as verl imports it

        manager_class_fqn = self.config.actor_rollout_ref.rollout.get("agent", {}).get("agent_loop_manager_class")
        manager_cls = load_class_from_fqn(manager_class_fqn, "AgentLoopManager") if manager_class_fqn else AgentLoopManager
        self.llm_server_manager = LLMServerManager.create(config=self.config, worker_group=self.actor_rollout_wg)
        self.async_rollout_mode = True
        self.async_rollout_manager = manager_cls.create(
            config=self.config, llm_client=self.llm_server_manager.get_client(),
            reward_loop_worker_handles=self.reward_loop_manager.reward_loop_workers)

    async def _fit_generate(self, batch_data_future: Any, continuous_iterator: Any) -> Any:
        """verl's: await this step's batch, sync the weights, launch the next generation; then the
        staleness of every sample of the batch against the weights this step trains from."""
        batch, batch_data_future = await super()._fit_generate(batch_data_future, continuous_iterator)
        self._record_staleness(batch)
        return batch, batch_data_future

    def _record_staleness(self, batch: Any) -> None:
        sync = self.checkpoint_manager
        assert isinstance(sync, FloeWeightSync) and sync.offset is not None and sync.version is not None
        steps = batch.non_tensor_batch.get("global_steps")
        if steps is None or any(s is None for s in steps):
            raise RuntimeError("a sample carries no global_steps: it was not generated by floe's rollout server")
        versions = [sync.offset + int(s) for s in steps]
        stats = staleness_stats(sync.version, versions, MAX_STALENESS)
        self.metrics.update({f"floe/staleness/{k}": stats[k] for k in ("mean", "max", "min", "ratio", "violation_count")})
        self.metrics.update({"floe/weights_version/min": stats["weights_version_min"],
                             "floe/weights_version/max": stats["weights_version_max"],
                             "floe/policy_version": sync.version})
        uids = batch.non_tensor_batch["uid"]
        append_samples(self.floe_samples, (
            {"step": self.global_steps, "uid": str(uid), "row": i, "weights_version": v,
             "policy_version": sync.version, "staleness": sync.version - v}
            for i, (uid, v) in enumerate(zip(uids, versions))))


def one_step_trainer(config: Any, **kwargs: Any) -> OneStepOffRayTrainer:
    """What verl's one-step entrypoint builds as `OneStepOffRayTrainer(config=..., ...)`: floe's
    trainer with `trainer.v1.trainer_mode=floe`, verl's own otherwise."""
    floe_mode = OmegaConf.select(config, "trainer.v1.trainer_mode") == "floe"
    return (FloeOneStepTrainer if floe_mode else OneStepOffRayTrainer)(config=config, **kwargs)


def install() -> None:
    """Put `one_step_trainer` where verl's one-step entrypoint imports its trainer from (once)."""
    if ray_trainer.OneStepOffRayTrainer is OneStepOffRayTrainer:
        ray_trainer.OneStepOffRayTrainer = one_step_trainer  # type: ignore[assignment, misc]


install()
