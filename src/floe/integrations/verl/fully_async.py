"""verl 0.9.1's fully-async trainer on a floe backend, staleness per sample.

    python -m verl.experimental.fully_async_policy.fully_async_main <recipe ...> trainer.v1.trainer_mode=floe

verl's own entrypoint, config (`fully_async_ppo_trainer.yaml`), task runner, message queue and the
loops of its two actors run unchanged: `FullyAsyncRollouter` feeds one prompt at a time to its agent
loops and puts each finished group into the `MessageQueue`, pausing by its staleness rule
(`async_training.staleness_threshold`: at most (1 + threshold) × `require_batches` ×
`ppo_mini_batch_size` × `trigger_parameter_sync_step` prompts per weights version);
`FullyAsyncTrainer` takes `require_batches` mini-batches of groups per step from the queue and
syncs the weights every `trigger_parameter_sync_step` steps. Only what needs GPUs is floe's:

* `FloeFullyAsyncTrainer.init_workers` builds no resource pools or FSDP workers: the backend
  (`plugin.start_session`) and the actor / reference calls through `FloeTensorDictWorkerGroup`
  (verl's TensorDict batches; the loss, LR schedule and throughput mapping of the V1 plugin).
* The rollouter's replicas are floe's (`FloeServerManager`: `plugin.FloeReplica` in standalone
  mode, one `FloeRolloutServer` per replica of `rollout.n_gpus_per_node × rollout.nnodes /
  rollout TP`, each sampling on the backend's sampler through its own client).
* verl's checkpoint-engine parameter sync is `FloeAbortingWeightSync`: verl's own order (abort
  the replicas' running requests, sync, resume), the sync being floe's
  `sync_weights(version=offset + current_param_version)`.

Partial rollouts (`async_training.partial_rollout=True`): the rollout servers generate a response
`floe.rollout_chunk_tokens` tokens per `sample` call; verl's abort makes a running request return
after its current chunk with its tokens and log-probs so far (`stop_reason="aborted"`), and verl's
`FullyAsyncLLMServerClient` resumes it from prompt + those tokens on the new weights, so one
response spans versions (verl's `min_global_steps` / `max_global_steps`: the first and last).
With `partial_rollout=False` a request runs as one `sample`, which floe's sync lets finish on the
weights it started with.

The entrypoint builds its actors by name, `FullyAsyncTrainer.remote(...)` and
`FullyAsyncRollouter.remote(...)`, imported from `fully_async_trainer` / `fully_async_rollouter`;
`install` (run at `import verl`: this module is its own `verl.plugins` entry point) puts an
`ActorChoice` there that builds floe's actor with `trainer.v1.trainer_mode=floe` and verl's own,
untouched, otherwise. The rollouter learns the backend's address from the trainer actor the same
task runner built first (the entrypoint creates and initialises the trainer before the rollouter).

Staleness (floe.integrations.staleness): a sample's weights version is the *oldest* of its tokens'
(`offset + min_global_steps`: a response a sync interrupted counts from the version it started
on); the policy version is the last sync's (`offset + current_param_version`: every step of a
sync cycle trains from it); staleness = policy − sample. Reported per step as `floe/staleness/*`
(aggregated over a sync cycle by verl's MetricsAggregator: mean / ratio averaged, max, min,
violation count summed) and one line per sample in `<trainer.default_local_dir>/floe_samples.jsonl`.
The violation bound is ceil(`staleness_threshold`) versions: the prompts started beyond one
cycle's worth (at most that fraction of a cycle) are trained one sync later.
"""

from __future__ import annotations

import asyncio
import functools
import math
from pathlib import Path
from typing import Any

import ray
from omegaconf import OmegaConf, open_dict
from verl.experimental.fully_async_policy import fully_async_rollouter, fully_async_trainer
from verl.experimental.fully_async_policy.fully_async_rollouter import (
    FullyAsyncAgentLoopManager,
    FullyAsyncLLMServerManager,
)
from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

from floe.errors import InvalidInput
from floe.integrations.staleness import append_samples, staleness_stats
from floe.integrations.verl.one_step import FloeTensorDictWorkerGroup, check_one_step
from floe.integrations.verl.plugin import FloeConnection, FloeReplica, FloeWeightSync, start_session
from floe.integrations.verl.schedule import VerlSchedule

SAMPLES_FILE = "floe_samples.jsonl"
VerlTrainer: Any = fully_async_trainer.FullyAsyncTrainer.__ray_actor_class__
VerlRollouter: Any = fully_async_rollouter.FullyAsyncRollouter.__ray_actor_class__
# floe's aggregation of its per-step keys over a sync cycle (verl's MetricsAggregator rules;
# max / min / mean-named keys already aggregate by name)
AGGREGATION = {"sum": ["floe/staleness/violation_count", "floe/partial/spanning_samples"],
               "last": ["floe/policy_version"]}


def floe_mode(config: Any) -> bool:
    """Whether a fully-async config asks for floe (`trainer.v1.trainer_mode=floe`)."""
    return OmegaConf.select(config, "trainer.v1.trainer_mode") == "floe"


def check_fully_async(cfg: dict[str, Any]) -> None:
    """The fully-async keys floe cannot honour, refused by name (InvalidInput); also the
    one-step trainer's (one_step.check_one_step)."""
    check_one_step(cfg)
    at = cfg["async_training"]
    if at.get("use_trainer_do_validate"):
        raise InvalidInput("async_training.use_trainer_do_validate", (
            "validates on hybrid rollout replicas that share the trainer's GPUs with its FSDP workers; floe's "
            "backend has one sampler, the rollouter validates on it: set it false"))
    if at.get("use_dynamic_resource_scheduling"):
        raise InvalidInput("async_training.use_dynamic_resource_scheduling", (
            "moves trainer GPUs between training and rollout replicas; floe's placement gives each zone its "
            "devices for the run: set it false"))
    if not (cfg["algorithm"].get("rollout_correction") or {}).get("bypass_mode"):
        raise InvalidInput("algorithm.rollout_correction.bypass_mode", (
            "false makes verl recompute old_log_probs at the weights of the sync cycle's first step, which its "
            "FSDP workers keep as CPU copies (save_model_to_cpu / restore_model_from_cpu); floe's policy keeps "
            "no such copies: keep fully_async_ppo_trainer.yaml's true (old_log_probs = the sampler's)"))
    if (cfg.get("distillation") or {}).get("enabled"):
        raise InvalidInput("distillation.enabled", "on-policy distillation is not supported by floe's verl plugin")


def staleness_limit(config: Any) -> int:
    """The staleness, in weights versions, verl's `async_training.staleness_threshold` allows."""
    return math.ceil(float(config.async_training.staleness_threshold))


class FloeAbortingWeightSync(FloeWeightSync):
    """verl's CheckpointEngineManager.update_weights on floe: abort the replicas' running requests
    (partial rollouts return their tokens so far), `sync_weights(version=offset + global_steps)`
    (FloeWeightSync), resume the replicas, whose servers then take the resumed requests."""

    async def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:  # type: ignore[override]
        await asyncio.gather(*[r.abort_all_requests() for r in self.replicas])
        try:
            await asyncio.to_thread(FloeWeightSync.update_weights, self, global_steps)
        finally:
            await asyncio.gather(*[r.resume_generation() for r in self.replicas])
        return {}

    async def abort_replicas(self, reject_request: bool = False) -> None:  # type: ignore[override]
        await asyncio.gather(*[r.abort_all_requests(reject_request=reject_request) for r in self.replicas])

    async def resume_generation_replicas(self) -> None:  # type: ignore[override]
        await asyncio.gather(*[r.resume_generation() for r in self.replicas])


class FloeFullyAsyncTrainer(VerlTrainer):  # type: ignore[misc, valid-type]
    """verl's FullyAsyncTrainer with floe's models, parameter sync and staleness (module doc)."""

    async def init_workers(self) -> None:
        session = start_session(self.config, self.use_critic, FloeTensorDictWorkerGroup, check=check_fully_async,
                                schedule=False)
        self.floe_server = session.server
        self.floe_client = session.client
        self.ref_in_actor = False  # floe's reference zone is the base model, with or without LoRA
        self.actor_wg = self.actor_rollout_wg = session.worker_group
        if self.use_reference_policy:
            self.ref_policy_wg = self.actor_rollout_wg
        chunk = session.rollout_chunk_tokens if self.config.async_training.partial_rollout else None
        group = session.worker_group
        self.floe_rollout = FloeConnection(group.url, group.token, group.timeout_s, chunk)
        self.floe_samples = Path(self.config.trainer.default_local_dir) / SAMPLES_FILE
        self.floe_staleness_limit = staleness_limit(self.config)
        for kind, keys in AGGREGATION.items():
            self.metrics_aggregator.aggregation_rules.setdefault(kind, []).extend(keys)

    def floe_connection(self) -> FloeConnection:
        """Where the rollouter's servers reach this run's backend (FloeServerManager)."""
        return self.floe_rollout

    async def _setup_checkpoint_manager(self) -> None:
        replicas = await self.rollouter.get_replicas.remote()
        self.checkpoint_manager = FloeAbortingWeightSync(self.floe_client, replicas)

    def set_total_train_steps(self, total_training_steps: int) -> None:
        """verl's (it writes the total into the optimizer config), then verl's LR schedule over it."""
        super().set_total_train_steps(total_training_steps)
        optim = OmegaConf.to_container(self.config.actor_rollout_ref.actor.optim, resolve=True)
        assert isinstance(optim, dict)
        self.actor_wg.schedule = VerlSchedule(optim)  # type: ignore[arg-type]

    async def _fit_generate(self, batch: Any = None) -> Any:
        """verl's: the step's groups from the message queue; then each sample's staleness."""
        batch = await super()._fit_generate(batch)
        self._record_staleness(batch)
        return batch

    def _record_staleness(self, batch: Any) -> None:
        sync = self.checkpoint_manager
        assert isinstance(sync, FloeWeightSync) and sync.offset is not None and sync.version is not None
        tensors = batch.non_tensor_batch
        if "min_global_steps" not in tensors or any(s is None for s in tensors["min_global_steps"]):
            raise RuntimeError("a sample carries no min_global_steps: it was not generated by floe's rollout server")
        oldest = [sync.offset + int(s) for s in tensors["min_global_steps"]]
        newest = [sync.offset + int(s) for s in tensors["max_global_steps"]]
        stats = staleness_stats(sync.version, oldest, self.floe_staleness_limit)
        self.metrics.update({f"floe/staleness/{k}": stats[k] for k in ("mean", "max", "min", "ratio", "violation_count")})
        self.metrics.update({"floe/weights_version/min": stats["weights_version_min"],
                             "floe/weights_version/max": max(newest), "floe/policy_version": sync.version,
                             "floe/partial/spanning_samples": sum(a != b for a, b in zip(oldest, newest))})
        append_samples(self.floe_samples, (
            {"step": self.global_steps, "param_version": self.current_param_version, "uid": str(uid), "row": i,
             "weights_version": v, "newest_weights_version": w, "policy_version": sync.version,
             "staleness": sync.version - v}
            for i, (uid, v, w) in enumerate(zip(tensors["uid"], oldest, newest))))


def floe_replica(connection: FloeConnection, **kwargs: Any) -> FloeReplica:
    """A floe replica of verl's standalone rollout pool, on `connection`'s backend."""
    replica = FloeReplica(**kwargs)
    replica.floe_standalone = connection
    return replica


class FloeServerManager(FullyAsyncLLMServerManager):
    """verl's FullyAsyncLLMServerManager whose standalone replicas are floe's (`floe_replica`)."""

    def __init__(self, config: Any, worker_group: Any = None, rollout_resource_pool: Any = None, *,
                 floe_connection: FloeConnection):
        self.rollout_replica_class = functools.partial(floe_replica, floe_connection)  # verl's hook ("for recipe to change")
        super().__init__(config, worker_group, rollout_resource_pool)


class FloeFullyAsyncRollouter(VerlRollouter):  # type: ignore[misc, valid-type]
    """verl's FullyAsyncRollouter whose replicas are floe rollout servers (module doc)."""

    def __init__(self, config: Any, tokenizer: Any, processor: Any = None, device_name: str | None = None, *,
                 floe_connection: FloeConnection):
        with open_dict(config):  # as start_session renames it in the trainer: verl's replica is floe's
            config.actor_rollout_ref.rollout.name = "floe"
        self.floe_connection = floe_connection
        super().__init__(config=config, tokenizer=tokenizer, processor=processor, device_name=device_name)

    async def _init_async_rollout_manager(self) -> None:
        """verl's own (FullyAsyncRollouter._init_async_rollout_manager), with FloeServerManager."""
        enable_agent_reward_loop = not self.use_rm or self.config.reward.reward_model.enable_resource_pool
        handles = self.reward_loop_manager.reward_loop_workers if enable_agent_reward_loop else None
        assert self.config.actor_rollout_ref.rollout.mode == "async"
        self.async_rollout_mode = True
        self.llm_server_manager = await FloeServerManager.create(
            config=self.config, worker_group=self.get_hybrid_worker_group(), floe_connection=self.floe_connection)
        self.async_rollout_manager = await FullyAsyncAgentLoopManager.create(
            config=self.config, llm_client=self.llm_server_manager.get_client(client_cls=FullyAsyncLLMServerClient),
            reward_loop_worker_handles=handles,
            teacher_client=self.teacher_model_manager.get_client() if self.teacher_model_manager else None)


# The actors hold one logical CPU each, where verl's ask for 10: their model work runs in floe's backend.
FloeTrainerActor = ray.remote(num_cpus=1)(FloeFullyAsyncTrainer)
FloeRollouterActor = ray.remote(num_cpus=1, max_concurrency=100)(FloeFullyAsyncRollouter)
_trainers: list[Any] = []  # the floe trainer actors this process (verl's task runner) built, newest last


class ActorChoice:
    """What verl's entrypoint calls `FullyAsyncTrainer` / `FullyAsyncRollouter`: `.remote(config=...)`
    builds floe's actor with `trainer.v1.trainer_mode=floe`, verl's own otherwise. Pickles by name
    (the task runner is pickled by value with its globals)."""

    def __init__(self, role: str, verl_actor: Any):
        self.role = role
        self.verl_actor = verl_actor

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        config = kwargs.get("config", args[0] if args else None)
        if not floe_mode(config):
            return self.verl_actor.remote(*args, **kwargs)
        if self.role == "trainer":
            trainer = FloeTrainerActor.remote(*args, **kwargs)
            _trainers.append(trainer)
            return trainer
        if not _trainers:
            raise RuntimeError("verl's fully-async task runner built the rollouter before the trainer")
        connection = ray.get(_trainers[-1].floe_connection.remote())
        return FloeRollouterActor.remote(*args, floe_connection=connection, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.verl_actor, name)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (actor_choice, (self.role,))


CHOICES = {"trainer": ActorChoice("trainer", fully_async_trainer.FullyAsyncTrainer),
           "rollouter": ActorChoice("rollouter", fully_async_rollouter.FullyAsyncRollouter)}


def actor_choice(role: str) -> ActorChoice:
    """The module's ActorChoice for `role` ("trainer" | "rollouter")."""
    return CHOICES[role]


def install() -> None:
    """Put the ActorChoices where verl's fully-async entrypoint imports its actors from (once)."""
    if not isinstance(fully_async_trainer.FullyAsyncTrainer, ActorChoice):
        fully_async_trainer.FullyAsyncTrainer = CHOICES["trainer"]  # type: ignore[assignment]
    if not isinstance(fully_async_rollouter.FullyAsyncRollouter, ActorChoice):
        fully_async_rollouter.FullyAsyncRollouter = CHOICES["rollouter"]  # type: ignore[assignment]


install()
