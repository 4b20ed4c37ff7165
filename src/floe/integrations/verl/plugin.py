"""verl 0.9.1 plugin: the `floe` V1 trainer mode and the `floe` rollout, both on a floe backend.

Loaded by verl at `import verl` through the `verl.plugins` entry point (or
VERL_USE_EXTERNAL_MODULES=floe.integrations.verl.plugin). It registers:

* trainer mode "floe" (`trainer.v1.trainer_mode=floe`): verl's synchronous V1 trainer with
  its GPU wiring replaced. verl's own data loader, agent loops, reward loop, replay buffer,
  GRPO advantages, validation, metrics and checkpoints run unchanged; the actor's
  log-probs, the reference log-probs and the PPO updates go to floe (`FloeWorkerGroup`), and
  weight sync is `client.sync_weights(version=<verl's global step>)` (`FloeWeightSync`).
* rollout "floe": a rollout replica whose server (`FloeRolloutServer`, a Ray actor) answers
  verl's token-in/token-out `generate` with `client.sample`, batching concurrent requests by
  prompt so each prompt is prefilled once. With the floe trainer mode every rollout is floe's:
  the recipe's `rollout.name` (vllm, or floe for floe's torch engine) picks the engine of floe's
  sampler (hardware.py), and the trainer renames it to "floe" before verl builds its replicas.

The backend is chosen by the recipe's `floe` block (backend_config.py): by default a
`floe serve` the plugin starts on loopback from `actor_rollout_ref.model.path`, with the
recipe's device, dtype, memory and engine settings (hardware.py; on one GPU the server runs
under a Ray actor that holds the GPU), or a given URL + token. The loss comes from verl's actor config (loss_mapping.py), the learning rate of
each step from verl's own LR scheduler (schedule.py). Everything crosses to
floe through the public client API and floe.convert.

verl's one-step off-policy entrypoint runs on floe too (one_step.py, its own `verl.plugins` entry
point: `python -m verl.experimental.one_step_off_policy.main_ppo` with the same
`trainer.v1.trainer_mode=floe`), and so does its fully-async trainer (fully_async.py, entry point
`floe_fully_async`: `python -m verl.experimental.fully_async_policy.fully_async_main`, same key);
`start_session` is the backend set-up the trainers share.

Pinned to verl==0.9.1: `FloeTrainer._setup` replaces a private method of verl's trainer and
reads verl's TransferQueue field names.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
import torch
import transfer_queue as tq
from omegaconf import OmegaConf, open_dict
from tensordict import TensorDict
from transformers import AutoConfig
from verl.experimental.reward_loop import RewardLoopManager
from verl.trainer.ppo.v1 import PPOTrainerSync, register_trainer
from verl.utils import tensordict_utils as tu
from verl.workers.rollout.llm_server import LLMServerManager
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry, TokenOutput

import floe
from floe.convert import verl_sequence_values, verl_to_batch
from floe.errors import InvalidInput, StateError
from floe.integrations.hardware import check_installed, check_server_lora, describe
from floe.integrations.verl.backend_config import floe_target
from floe.integrations.verl.local_server import LocalServer
from floe.integrations.verl.loss_mapping import VerlLoss, verl_loss, weighted_advantages
from floe.integrations.verl.rollout_mapping import floe_sampling_params
from floe.integrations.verl.schedule import ScheduleNotSet, VerlSchedule
from floe.integrations.verl.throughput import ActorThroughput
from floe.placement.gpus import check_cluster_gpus, needs_gpu_process

log = logging.getLogger("floe.integrations.verl")

STATE_MARKER = "floe_state.json"  # written into verl's actor checkpoint folder: which floe state it is


def _connect(url: str, token: str | None, timeout_s: float) -> floe.Client:
    return floe.connect(url, token=token, timeout=timeout_s)


@ray.remote
class _GpuServer:
    """Holds the GPU of a one-GPU run for the plugin's `floe serve`: Ray shows a GPU only to the
    actor it is given to, and the server process inherits the actor's view of it."""

    def __init__(self, backend: dict[str, Any]):
        self.server = LocalServer(backend)

    def address(self) -> tuple[str, str]:
        return self.server.url, self.server.token

    def stop(self) -> None:
        self.server.stop()


class _ServerOnGpu:
    """`url`, `token`, `stop()` of a `floe serve` running under a `_GpuServer` actor."""

    def __init__(self, backend: dict[str, Any]):
        self.actor = _GpuServer.options(num_gpus=1, num_cpus=0).remote(backend)  # type: ignore[attr-defined]
        self.url, self.token = ray.get(self.actor.address.remote())

    def stop(self) -> None:
        ray.get(self.actor.stop.remote())
        ray.kill(self.actor)


def _start_server(backend: dict[str, Any]) -> Any:
    """The plugin's own `floe serve`: a child of this process, or, for a local placement on a GPU,
    of an actor that holds the GPU (a Ray placement's actors take their own GPUs)."""
    if needs_gpu_process(backend):
        return _ServerOnGpu(backend)
    return LocalServer(backend)


def _non_tensor(data: TensorDict, key: str) -> list[Any]:
    value = data[key]
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _rows(data: TensorDict, key: str) -> list[list[Any]]:
    """A jagged TransferQueue field as Python lists, one per row."""
    return [t.tolist() for t in data[key].unbind()]


def _nested(rows: list[list[float]]) -> torch.Tensor:
    return torch.nested.as_nested_tensor([torch.tensor(r, dtype=torch.float32) for r in rows], layout=torch.jagged)


class FloeWorkerGroup:
    """Stands in for verl's actor/rollout/ref worker group: every call goes to floe.

    verl hands it TransferQueue handles (`KVBatchMeta`); it reads the rows it needs, rebuilds
    groups by uid (floe.convert), calls floe, and writes results back in verl's layout.
    """

    def __init__(self, client: floe.Client, loss: VerlLoss, schedule: VerlSchedule, url: str, token: str | None,
                 timeout_s: float, throughput: ActorThroughput):
        self.client = client
        self.loss = loss
        self.schedule = schedule
        self.throughput = throughput
        self.url, self.token, self.timeout_s = url, token, timeout_s
        self._dispatch_info = {"actor": [0]}
        self.world_size = 1
        self.workers: list[Any] = []
        self._saved_states: list[str] = []
        self.calls: dict[str, int] = defaultdict(int)  # floe calls made, by operation

    # -- what verl's trainer asks of a worker group ------------------------------------------

    def _query_dispatch_info(self, role: str) -> list[int]:
        return [0]

    def init_model(self) -> None:
        return None

    # -- how a batch is read and answered: TransferQueue handles (V1). A subclass for verl's
    # TensorDict batches (one_step.FloeTensorDictWorkerGroup) overrides these methods only.

    def _fetch(self, batch: Any, fields: list[str]) -> dict[str, list[Any]]:
        """Rows of the batch: `prompts`, `responses` (token lists), `uid`, and each per-token
        response field of `fields` (lists over the response)."""
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["prompts", "responses", "uid", *fields])
        return {"uid": _non_tensor(data, "uid"), **{name: _rows(data, name) for name in ["prompts", "responses", *fields]}}

    def _info(self, batch: Any) -> Any:
        """The batch's settings (temperature, mini-batch size, ...): a mapping with .get."""
        return batch.extra_info

    def _has(self, batch: Any, field: str) -> bool:
        return batch.fields is None or field in batch.fields

    def _answer_log_probs(self, batch: Any, fields: dict[str, torch.Tensor]) -> Any:
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                               fields=TensorDict(fields, batch_size=[len(batch.keys)]))

    def _answer_update(self, metrics: dict[str, list[float]]) -> Any:
        return {"metrics": metrics}

    def _log_probs(self, batch: Any, zone: str) -> Any:
        info = self._info(batch)
        temperature = float(info.get("temperature", 1.0))
        with_entropy = zone == "policy" and bool(info.get("calculate_entropy", False))
        rows = self._fetch(batch, [])
        layout = verl_to_batch(rows["prompts"], rows["responses"], rows["uid"])
        result = self.client.forward(layout.batch, zone=zone, temperature=temperature, with_entropy=with_entropy)
        self.calls["forward"] += 1
        fields = {"log_probs": _nested(verl_sequence_values(layout, result.logprobs))}
        if with_entropy:
            assert result.entropy is not None
            fields["entropy"] = _nested(verl_sequence_values(layout, result.entropy))
        return self._answer_log_probs(batch, fields)

    def compute_log_prob(self, batch: Any) -> Any:
        """Policy log-probs (and entropy) over each whole sequence, verl's alignment."""
        return self._log_probs(batch, "policy")

    def compute_ref_log_prob(self, batch: Any) -> Any:
        """Reference-zone log-probs over each whole sequence, verl's alignment."""
        return self._log_probs(batch, "reference")

    def update_actor(self, batch: Any) -> dict[str, Any]:
        """verl's PPO update: its mini-batches (same size, epochs, seed and shuffle as verl's
        own iterator), each one floe forward_backward + optim_step at verl's scheduled rate for
        this step (with verl's rollout IS weights, when its trainer wrote them, folded into the
        advantages: loss_mapping.weighted_advantages); then verl's scheduler advances once (schedule.py), and `lr` reports the new
        rate as verl's engine does (`floe/applied_lr`, logged as actor/floe/applied_lr: the rate the
        steps ran at). `mfu` (perf/mfu/actor) is verl's FlopsCounter over the step's sequences and
        the backend's measured seconds of its forward_backward calls, with tokens/s beside it
        (throughput.py)."""
        info = self._info(batch)
        extra = ["response_mask", "old_log_probs", "advantages"]
        if self.loss.needs_ref_logprobs:
            extra.append("ref_log_prob")
        if self.loss.rollout_is_weights:
            if not self._has(batch, "rollout_is_weights"):
                raise InvalidInput("algorithm.rollout_correction.rollout_is",
                                   "verl's trainer wrote no rollout_is_weights (the batch has no rollout_log_probs)")
            extra.append("rollout_is_weights")
        data = self._fetch(batch, extra)
        prompts, responses, uids = data["prompts"], data["responses"], data["uid"]
        per_token = {name: data[name] for name in extra}
        if self.loss.rollout_is_weights:  # verl's pg_losses * rollout_is_weights, as A·w (loss_mapping)
            per_token["advantages"] = weighted_advantages(per_token["advantages"], per_token["rollout_is_weights"])
        n = len(uids)
        mini = int(info.get("mini_batch_size") or n)
        order = TensorDict({"row": torch.arange(n)}, batch_size=[n])
        iterator = tu.make_iterator(order, mini_batch_size=mini, epochs=int(info.get("epochs", 1)),
                                    seed=info.get("seed", 42), dataloader_kwargs=dict(info.get("dataloader_kwargs") or {}))
        temperature = float(info.get("temperature", 1.0))
        metrics: dict[str, list[float]] = defaultdict(list)
        seqlens: list[int] = []
        seconds = tokens = 0.0
        for part in iterator:
            rows = part["row"].tolist()
            advantages = [per_token["advantages"][i] for i in rows]
            if self.loss.bypass is not None:
                advantages = self._bypass_advantages(rows, prompts, responses, uids, per_token, advantages,
                                                     temperature, metrics)
            layout = verl_to_batch(
                [prompts[i] for i in rows], [responses[i] for i in rows], [uids[i] for i in rows],
                response_mask=[per_token["response_mask"][i] for i in rows],
                old_log_probs=[per_token["old_log_probs"][i] for i in rows],
                advantages=advantages,
                ref_log_probs=[per_token["ref_log_prob"][i] for i in rows] if self.loss.needs_ref_logprobs else None,
            )
            fb = self.client.forward_backward(layout.batch, self.loss.loss, self.loss.loss_config, temperature=temperature)
            step = self.client.optim_step(lr=self.schedule.lr)
            self.calls["forward_backward"] += 1
            self.calls["optim_step"] += 1
            seqlens += [len(g.prompt) + len(smp.tokens) for g in layout.batch.groups for smp in g.samples]
            seconds += fb.metrics["seconds"]
            tokens += fb.metrics["sequence_tokens"]
            metrics["pg_loss"].append(fb.metrics["policy_loss"])  # verl's: the policy term alone
            metrics["floe/loss"].append(fb.metrics["loss"])  # with the KL and entropy terms
            metrics["pg_clipfrac"].append(fb.metrics.get("clip_fraction", 0.0))
            metrics["grad_norm"].append(step.grad_norm)
            metrics["floe/applied_lr"].append(step.lr)
            for key in ("kl_ref_k3", "kl_sampler_k1", "entropy", "ratio_mean"):
                if key in fb.metrics:
                    metrics[f"floe/{key}"].append(fb.metrics[key])
        if metrics["floe/applied_lr"]:
            metrics["lr"] = [self.schedule.step()]
        metrics.update(self.throughput.metrics(seqlens, seconds, tokens))
        if "mfu" not in metrics:  # no update ran: verl's trainer pops actor/mfu all the same
            metrics["mfu"] = [0.0]
        return self._answer_update(dict(metrics))

    def _bypass_advantages(self, rows: list[int], prompts: list[list[int]], responses: list[list[int]], uids: list[Any],
                           per_token: dict[str, list[list[float]]], advantages: list[list[float]], temperature: float,
                           metrics: dict[str, list[float]]) -> list[list[float]]:
        """verl's bypass_mode loss on this mini-batch (bypass.py): the policy's log-probs now (one
        floe forward at the current weights), verl's correction against the sampler's log-probs
        (`old_log_probs` in bypass mode), folded into the advantages; its metrics appended."""
        from floe.integrations.verl.bypass import bypass_advantages  # noqa: PLC0415 - only this mode needs it

        assert self.loss.bypass is not None
        masks = [per_token["response_mask"][i] for i in rows]
        rollout = [per_token["old_log_probs"][i] for i in rows]
        layout = verl_to_batch([prompts[i] for i in rows], [responses[i] for i in rows], [uids[i] for i in rows])
        current = layout.per_row(self.client.forward(layout.batch, zone="policy", temperature=temperature).logprobs)
        self.calls["forward"] += 1
        out, rc_metrics = bypass_advantages(self.loss.bypass, self.loss.loss_config["aggregation"], current, rollout,
                                            masks, advantages)
        for key, value in rc_metrics.items():
            metrics[key].append(value)
        return out

    def save_checkpoint(self, local_path: str, hdfs_path: str | None = None, global_step: int = 0,
                        max_ckpt_to_keep: int | None = None) -> None:
        """floe save_state("verl_step_<global_step>"), named in `<local_path>/floe_state.json`;
        older plugin states beyond `max_ckpt_to_keep` are deleted."""
        name = f"verl_step_{int(global_step)}"
        result = self.client.save_state(name)
        Path(local_path).mkdir(parents=True, exist_ok=True)
        Path(local_path, STATE_MARKER).write_text(json.dumps({"state": result.name, "step": result.step,
                                                              "version": result.version,
                                                              "lr_scheduler_steps": self.schedule.steps}))
        if name not in self._saved_states:
            self._saved_states.append(name)
        if max_ckpt_to_keep:
            while len(self._saved_states) > max_ckpt_to_keep:
                self.client.delete_state(self._saved_states.pop(0))

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False) -> None:
        """floe load_state of the state named in `<local_path>/floe_state.json`, and verl's LR
        scheduler where that checkpoint left it (as verl's engine restores its own)."""
        marker = Path(local_path, STATE_MARKER)
        if not marker.exists():
            raise InvalidInput("trainer.resume_from_path", f"{local_path} holds no {STATE_MARKER}: not a floe checkpoint")
        saved = json.loads(marker.read_text())
        self.client.load_state(saved["state"])
        # Markers from before the plugin ran verl's schedule had a constant one: its position is moot.
        self.schedule = self.schedule.at(int(saved.get("lr_scheduler_steps", 0)))

    def start_profile(self, **kwargs: Any) -> None:
        return None

    def stop_profile(self, **kwargs: Any) -> None:
        return None


class FloeWeightSync:
    """verl's weight-sync manager, on floe: `update_weights(global_steps)` syncs the policy
    into the sampler under a version tag that maps back to verl's step.

    floe versions only move forward, and a server may already be past 0, so the tag is
    `offset + global_steps`, with the offset fixed at the first sync; every rollout server
    learns the offset and reports `weights_version - offset` as verl's `global_steps`.
    """

    def __init__(self, client: floe.Client, replicas: list[RolloutReplica]):
        self.client = client
        self.replicas = replicas
        self.offset: int | None = None
        self.version: int | None = None  # the last synced version: the policy's weights the next step trains
        self.synced_step: int | None = None  # the policy's optimizer step at that sync
        self.calls = 0

    def update_weights(self, global_steps: int | None = None) -> None:
        """Sync the policy to the sampler as verl's step `global_steps`. A second call for the
        step last synced is a no-op when the policy has not stepped since (verl's fully-async
        trainer re-syncs its last version before a final validation; floe versions only move
        forward); StateError if it has (new weights under an old step number)."""
        if global_steps is None:  # a re-wake with unchanged weights (verl's colocated reward path)
            return
        info = self.client.info()  # verl's trainer does not step the policy during this call
        if self.offset is None:
            self.offset = info.sampler_version + 1 - int(global_steps)
            ray.get([s.set_version_offset.remote(self.offset) for r in self.replicas for s in r.servers])
        version = self.offset + int(global_steps)
        if version == self.version:
            if info.step != self.synced_step:
                raise StateError(f"update_weights: verl step {global_steps} was synced at policy step "
                                 f"{self.synced_step}, and the policy has stepped since (now {info.step}): new "
                                 "weights need a new step number")
            return
        self.version = self.client.sync_weights(version=version).version
        self.synced_step = info.step
        self.calls += 1

    def sleep_replicas(self) -> None:
        return None

    def abort_replicas(self) -> None:
        return None

    def resume_generation_replicas(self) -> None:
        return None


@dataclass
class FloeSession:
    """The floe side of one verl run: the backend (the plugin's own `floe serve`, or `floe.url`'s),
    the trainer's client, and the worker group that answers verl's actor / reference calls."""

    server: Any  # the plugin's own server (stop() at the end), or None for a floe.url server
    client: floe.Client
    worker_group: FloeWorkerGroup
    policy_devices: int  # floe's policy devices (info().capabilities): perf/throughput's divisor
    rollout_chunk_tokens: int  # the `floe` block's, for verl's fully-async partial rollouts


def start_session(config: Any, use_critic: bool, worker_group_cls: type[FloeWorkerGroup] = FloeWorkerGroup,
                  check: Callable[[dict[str, Any]], None] | None = None, schedule: bool = True) -> FloeSession:
    """Check the recipe's keys floe cannot honour (InvalidInput naming the key; `check`: the
    trainer's own checks on the resolved config, run after the shared ones), start or reach
    the backend (backend_config.floe_target: the `floe` block and the recipe's hardware keys),
    and build `worker_group_cls` on it with verl's loss, LR schedule and throughput counters.
    Sets `actor_rollout_ref.rollout.name=floe` in `config`: the recipe's engine (vllm, floe) is
    now floe's sampler engine (hardware.py), and verl's replica for it is floe's. `schedule=False`:
    the worker group's LR schedule is set later (`ScheduleNotSet` until then), for a trainer that
    learns its total training steps after building its workers (fully_async.py)."""
    cfg = OmegaConf.to_container(config, resolve=True)
    assert isinstance(cfg, dict)
    loss = verl_loss(cfg["actor_rollout_ref"]["actor"], cfg.get("algorithm"))
    if cfg["algorithm"].get("adv_estimator") == "remax":
        # verl 0.9.1's V1 trainer calls compute_remax_outcome_advantage without the greedy
        # baseline rollout (only its legacy ray_trainer generates reward_baselines; its one-step
        # off-policy trainer does not either).
        raise InvalidInput("algorithm.adv_estimator", "remax needs a greedy baseline rollout per prompt, which verl "
                           "0.9.1's V1 trainer (the one trainer_mode=floe runs) does not generate; use grpo, rloo or "
                           "reinforce_plus_plus, or verl's legacy trainer without floe")
    if use_critic:
        raise InvalidInput("algorithm.adv_estimator", "floe's verl plugin trains no critic; use a critic-free "
                           f"estimator such as grpo (got {cfg['algorithm'].get('adv_estimator')!r})")
    override = cfg["actor_rollout_ref"]["model"].get("override_config") or {}
    if override:
        raise InvalidInput(f"actor_rollout_ref.model.override_config.{min(override)}", (
            "floe's backend loads the model with its own config.json, which verl's override would change only in "
            "verl's FSDP workers: edit the model's config.json instead (drop the override)"))
    if cfg["reward"]["reward_model"].get("enable"):
        raise InvalidInput("reward.reward_model.enable", "model-based rewards need a GPU pool; floe's verl plugin "
                           "runs rule / custom reward functions")
    target = floe_target(cfg)
    if target.url is None:  # a floe.url server has GPUs of its own
        check_cluster_gpus(target.hardware.gpus, "trainer.device", (
            "trainer.n_gpus_per_node x trainer.nnodes GPUs with trainer.device=cuda (verl 0.9.1 sets cuda even "
            "on a machine without GPUs); to train on the CPU add +floe.backend.device=cpu"))
        check_installed(target.backend or {}, "actor_rollout_ref.rollout.name")
    if check is not None:
        check(cfg)
    with open_dict(config):
        config.actor_rollout_ref.rollout.name = "floe"
    server: Any = None
    if target.url is None:
        backend = dict(target.backend or {})
        backend.setdefault("state_dir", os.path.abspath(os.path.join(cfg["trainer"]["default_local_dir"], "floe_state")))
        server = _start_server(backend)
        url, token = server.url, server.token
    else:
        url, token = target.url, target.token or os.environ.get("FLOE_TOKEN")
    client = _connect(url, token, target.timeout_s)
    log.warning("floe backend at %s (%s)", url, "started by the plugin" if server else "given")
    if target.backend is not None:
        log.warning("%s", describe(target.backend))
    lr_schedule: VerlSchedule | ScheduleNotSet = (VerlSchedule(cfg["actor_rollout_ref"]["actor"]["optim"]) if schedule
                                                  else ScheduleNotSet())
    model = cfg["actor_rollout_ref"]["model"]
    capabilities = client.info().capabilities
    if target.url is not None:
        check_server_lora(target.hardware.backend.get("lora"), capabilities.get("lora"),
                          "actor_rollout_ref.model.lora_rank")
    throughput = ActorThroughput(AutoConfig.from_pretrained(model["path"], trust_remote_code=bool(
        model.get("trust_remote_code", False))), capabilities)
    group = worker_group_cls(client, loss, lr_schedule, url, token, target.timeout_s, throughput)  # type: ignore[arg-type]
    # verl makes world_size // (rollout tp * dp * pp) replicas: one, on the floe backend.
    rollout = cfg["actor_rollout_ref"]["rollout"]
    group.world_size = (rollout["tensor_model_parallel_size"] * rollout["data_parallel_size"]
                        * rollout["pipeline_model_parallel_size"])
    return FloeSession(server, client, group, int(capabilities.get("policy_devices", 1)), target.rollout_chunk_tokens)


@register_trainer("floe")
class FloeTrainer(PPOTrainerSync):
    """verl's synchronous V1 trainer with a floe backend in place of GPU worker groups."""

    def _build_replay_buffer(self) -> Any:
        # verl's V1 base class branches on the literal mode name "sync" (replay buffer, DAPO
        # refills and gen_batch_size, TransferQueue checkpoints, in-flight prompts): mode "floe"
        # is that synchronous trainer, so from here on it reads as "sync", with sync's settings.
        # (The base's __init__ builds the replay buffer right after reading the mode.)
        self.trainer_mode = "sync"
        self.parameter_sync_step = self.config.trainer.v1.get("sync", {}).get("parameter_sync_step", 1)
        return super()._build_replay_buffer()

    def _setup(self) -> None:
        self._init_tokenizer()
        self._init_dataloader()
        self._init_dump_executor()
        if self.use_teacher_policy:
            raise InvalidInput("distillation", "on-policy distillation is not supported by floe's verl plugin")
        session = start_session(self.config, self.use_critic)
        self.floe_loss = session.worker_group.loss
        self.floe_server = session.server
        self.floe_policy_devices = session.policy_devices
        self.ref_in_actor = False
        self.actor_rollout_wg = session.worker_group
        if self.use_reference_policy:
            self.ref_policy_wg = self.actor_rollout_wg
        self.reward_loop_manager = RewardLoopManager(config=self.config, rm_resource_pool=None)
        self.teacher_model_manager = None
        self.distillation_config = None
        self.llm_server_manager = LLMServerManager.create(config=self.config, worker_group=self.actor_rollout_wg)
        self.checkpoint_manager = FloeWeightSync(session.client, self.llm_server_manager.get_replicas())
        self._load_checkpoint()

    def _get_n_gpus_for_throughput(self) -> int:
        """perf/throughput's divisor: the devices floe's policy trains on (info().capabilities)."""
        return self.floe_policy_devices

    def on_sample_end(self) -> None:
        return None

    def on_step_end(self) -> None:
        """verl's weight sync, then floe's call counts so far into this step's metrics
        (floe/calls/<op>; sampled_sequences counts the samples the rollout servers returned)."""
        super().on_step_end()
        counts = {f"floe/calls/{op}": float(n) for op, n in self.actor_rollout_wg.calls.items()}
        counts["floe/calls/sync_weights"] = float(self.checkpoint_manager.calls)
        servers = [s for r in self.llm_server_manager.get_replicas() for s in r.servers]
        for server_counts in ray.get([s.counts.remote() for s in servers]):
            for op, n in server_counts.items():
                counts[f"floe/calls/{op}"] = counts.get(f"floe/calls/{op}", 0.0) + n
        self._pending_sync_metrics = {**(getattr(self, "_pending_sync_metrics", None) or {}), **counts}


@dataclass(frozen=True)
class FloeConnection:
    """How a rollout server reaches the run's floe backend; `chunk_tokens`: generate each response
    that many tokens per `sample` call so a sync can interrupt it (verl's partial rollouts,
    fully_async.py), or None: one call per response, which a sync lets finish on its weights."""

    url: str
    token: str | None
    timeout_s: float
    chunk_tokens: int | None = None


@ray.remote
class FloeRolloutServer:
    """verl's token-in/token-out rollout server on floe's `sample`.

    Concurrent `generate` calls are collected for a moment and sent as one `sample` per
    (sampling params, n): identical prompts become one prompt with n samples, so the sampler
    prefills each prompt once.

    With `chunk_tokens` (verl's fully-async partial rollouts) a response is generated in chunks
    of that many tokens, each a `sample` of prompt + the tokens so far; `abort_all_requests`
    closes the server to new requests (they wait for `resume_generation`, as verl's servers park
    them) and makes every running request return after its current chunk with the tokens and
    log-probs so far and `stop_reason="aborted"`, which verl's `FullyAsyncLLMServerClient`
    resumes from prompt + partial tokens once generation resumes. It returns when no request is
    running, so the sync that follows never waits on a chunk. Without `chunk_tokens`, abort and
    resume do nothing: floe's sync lets a running `sample` finish on the weights it started with.
    `extra_fields["global_steps"]` of a reply is the oldest weights version (− offset) of its chunks.
    """

    def __init__(self, url: str, token: str | None, timeout_s: float, response_length: int, prompt_length: int,
                 max_model_len: int | None, chunk_tokens: int | None = None):
        self.client = _connect(url, token, timeout_s)
        self.lengths = (response_length, prompt_length, max_model_len)
        self.offset = 0
        self.chunk_tokens = chunk_tokens
        self._pending: list[tuple[list[int], floe.SamplingParams, asyncio.Future]] = []
        self._runner: asyncio.Task | None = None
        self._counts = {"sample": 0, "sampled_sequences": 0, "aborted_requests": 0}
        self._open = asyncio.Event()  # set: requests may start; cleared from abort to resume
        self._open.set()
        self._aborting = False
        self._rejecting = False
        self._running = 0
        self._idle = asyncio.Event()  # set while no request is running
        self._idle.set()

    def counts(self) -> dict[str, int]:
        """floe `sample` calls made, sequences returned and requests an abort stopped, so far."""
        return dict(self._counts)

    def set_version_offset(self, offset: int) -> None:
        self.offset = int(offset)

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Any = None, video_data: Any = None, **kwargs: Any) -> TokenOutput:
        if image_data is not None or video_data is not None or kwargs.get("audio_data") is not None:
            raise InvalidInput("image_data", "floe's verl rollout serves text-only models")
        prompt = [int(t) for t in prompt_ids]
        response_length, prompt_length, max_model_len = self.lengths
        params = floe_sampling_params(sampling_params, len(prompt), response_length, prompt_length, max_model_len)
        if self.chunk_tokens is None:
            sample = await self._submit(prompt, params)
            return TokenOutput(token_ids=sample.tokens, log_probs=sample.logprobs, stop_reason="completed",
                               extra_fields={"global_steps": sample.weights_version - self.offset})
        while not self._open.is_set():  # between abort_all_requests and resume_generation
            if self._rejecting:
                raise RuntimeError("floe rollout server: generation is stopped (aborted with reject_request)")
            await self._open.wait()
        self._running += 1
        self._idle.clear()
        try:
            return await self._generate_chunks(prompt, params)
        finally:
            self._running -= 1
            if self._running == 0:
                self._idle.set()

    async def _generate_chunks(self, prompt: list[int], params: floe.SamplingParams) -> TokenOutput:
        assert self.chunk_tokens is not None
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        while True:
            take = min(self.chunk_tokens, params.max_tokens - len(tokens))
            context = prompt + tokens
            # a seeded request: each chunk's seed moves with its position (no chunk repeats another's draws)
            seed = None if params.seed is None else int(params.seed) + len(context)
            chunk = await self._submit(context, replace(params, max_tokens=take, seed=seed))
            tokens += chunk.tokens
            logprobs += chunk.logprobs
            versions.append(chunk.weights_version)
            if chunk.stop_reason != "length" or len(tokens) >= params.max_tokens:
                stop = "completed"
                break
            if self._aborting:
                stop = "aborted"
                self._counts["aborted_requests"] += 1
                break
        return TokenOutput(token_ids=tokens, log_probs=logprobs, stop_reason=stop,
                           extra_fields={"global_steps": min(versions) - self.offset})

    async def _submit(self, prompt: list[int], params: floe.SamplingParams) -> floe.SampledSequence:
        """One sample of `prompt`, batched with the other requests of this moment (_drain)."""
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending.append((prompt, params, future))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            await asyncio.sleep(0.01)  # let the other requests of this round arrive
            pending, self._pending = self._pending, []
            by_params: dict[str, dict[tuple[int, ...], list[asyncio.Future]]] = defaultdict(lambda: defaultdict(list))
            params_of: dict[str, floe.SamplingParams] = {}
            for prompt, params, future in pending:
                key = json.dumps(params.__dict__, sort_keys=True)
                params_of[key] = params
                by_params[key][tuple(prompt)].append(future)
            for key, prompts in by_params.items():
                by_n: dict[int, list[tuple[int, ...]]] = defaultdict(list)
                for prompt, futures in prompts.items():
                    by_n[len(futures)].append(prompt)
                for n, group in by_n.items():
                    try:
                        result = await asyncio.to_thread(self.client.sample, [list(p) for p in group], n, params_of[key])
                        self._counts["sample"] += 1
                        self._counts["sampled_sequences"] += n * len(group)
                    except Exception as e:  # noqa: BLE001 - every waiting request gets the error, none hangs
                        for p in group:
                            for f in prompts[p]:
                                if not f.done():
                                    f.set_exception(e)
                        continue
                    for p, sampled in zip(group, result.groups):
                        for f, s in zip(prompts[p], sampled.samples):
                            if not f.done():
                                f.set_result(s)

    async def wake_up(self) -> None: ...
    async def sleep(self) -> None: ...
    async def abort_all_requests(self, reject_request: bool = False) -> None:
        """With chunks: close to new requests (parked, or refused with `reject_request`), stop every
        running one after its current chunk, return once none runs. Without: nothing (class doc)."""
        if self.chunk_tokens is None:
            return
        self._open.clear()
        self._rejecting = reject_request
        self._aborting = True
        try:
            await self._idle.wait()
        finally:
            self._aborting = False

    async def resume_generation(self) -> None:
        """Open again after abort_all_requests: parked and new requests start."""
        self._rejecting = False
        self._open.set()

    async def clear_kv_cache(self) -> None: ...
    async def release_kv_cache(self) -> None: ...
    async def resume_kv_cache(self) -> None: ...
    async def start_profile(self, **kwargs: Any) -> None: ...
    async def stop_profile(self) -> None: ...


class FloeReplica(RolloutReplica):
    """One rollout replica: one `FloeRolloutServer` on the trainer's floe backend."""

    async def init_hybrid(self, worker_group: Any) -> None:
        if not isinstance(worker_group, FloeWorkerGroup):
            raise InvalidInput("trainer.v1.trainer_mode", "actor_rollout_ref.rollout.name=floe needs "
                               "trainer.v1.trainer_mode=floe")
        self.rollout_mode = RolloutMode.HYBRID
        self._floe_connection = (worker_group.url, worker_group.token, worker_group.timeout_s)
        await self.launch_servers()

    floe_standalone: FloeConnection | None = None  # set by fully_async.FloeServerManager before init

    async def init_standalone(self) -> None:
        """A replica of verl's separate rollout pool (fully-async trainer): a server on the floe
        backend whose connection the fully-async rollouter gave it (`floe_standalone`)."""
        if self.floe_standalone is None:
            raise InvalidInput("actor_rollout_ref.rollout.name", "floe's rollout runs with trainer.v1.trainer_mode=floe only")
        self.rollout_mode = RolloutMode.STANDALONE
        conn = self.floe_standalone
        self._floe_connection = (conn.url, conn.token, conn.timeout_s)
        self._floe_chunk_tokens = conn.chunk_tokens
        await self.launch_servers()

    async def init_colocated(self, resource_pool: Any) -> None:
        raise InvalidInput("actor_rollout_ref.rollout.name", "floe's rollout runs with trainer.v1.trainer_mode=floe only")

    async def launch_servers(self) -> None:
        url, token, timeout_s = self._floe_connection
        cfg = self.config
        server = FloeRolloutServer.options(
            name=f"floe_rollout_{self.replica_rank}{self.name_suffix}", max_concurrency=self.max_concurrency, num_cpus=0,
        ).remote(url, token, timeout_s, int(cfg.response_length), int(cfg.prompt_length),
                 int(cfg.max_model_len) if getattr(cfg, "max_model_len", None) else None,
                 getattr(self, "_floe_chunk_tokens", None))
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{url}#rollout-{self.replica_rank}"

    def rollout_worker_use_gpu(self) -> bool:
        return False


RolloutReplicaRegistry.register("floe", lambda: FloeReplica)
