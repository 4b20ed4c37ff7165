"""SkyRL's worker dispatch and PPO trainer on a floe backend.

`FloeDispatch` is a duck-typed SkyRL 0.4.0 ``WorkerDispatch`` (the object ``RayPPOTrainer``
drives): its forward passes become ``client.forward`` (policy or reference zone), each PPO
mini-batch one ``client.forward_backward`` (loss from mapping.py, weights/advantages chosen
so floe computes exactly SkyRL's reduction and, when configured, its off-policy correction) and ``client.optim_step(lr=...)`` at the rate of
SkyRL's own LR scheduler (mapping.lr_scheduler, stepped after every optimizer step as SkyRL's
FSDP strategy steps it, and set back to floe's restored step on resume), and
``save_weights_for_sampler`` a ``client.sync_weights(version=<trainer step>)``, so every sample
echoes the step whose weights produced it. Batches move through floe.convert (SkyRL section):
rows with the same prompt become one group, so floe runs each prompt once.

`FloeRayPPOTrainer` is SkyRL's own ``RayPPOTrainer`` with only ``build_models`` replaced (no
Ray worker groups, no GPUs) and the response layout of each forward batch handed to the
dispatch (SkyRL's forward batches carry only ``sequences`` / ``attention_mask``): the
`FloeTrainerMixin`, which fully_async.py mixes into SkyRL's fully-async trainer too.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from skyrl.backends.skyrl_train.distributed.dispatch import WorkerOutput
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.backends.skyrl_train.utils.off_policy_correction_utils import compute_off_policy_correction
from skyrl.backends.skyrl_train.utils.ppo_utils import compute_approx_kl
from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean
from skyrl.backends.skyrl_train.workers.worker_utils import compute_minibatch_rollout_logprob_diff_metrics
from skyrl.train.config.config import OffPolicyCorrectionConfig
from skyrl.train.trainer import RayPPOTrainer

import floe
from floe.atomic import atomic_write_text
from floe.compute.flops import mfu
from floe.convert import skyrl_to_batch, skyrl_token_values
from floe.errors import InvalidInput
from floe.integrations.skyrl.inference import FloeInferenceClient
from floe.integrations.skyrl.mapping import (
    SkyRLLoss,
    corrected_advantages,
    floe_advantages,
    lr_scheduler,
    optimizer_steps,
    token_weights,
)
from floe.integrations.stand_in import advance

ZONES = {"policy": "policy", "ref": "reference"}
STATE_FILE = "floe_state.txt"  # in SkyRL's checkpoint folder: the floe state saved for it


class _Chunk:
    """One staged mini-batch: its rows and where they start in the full training batch."""

    def __init__(self, data: TrainingInputBatch, start: int):
        self.data, self.start = data, start


def behaviour_logprobs(data: TrainingInputBatch, loss: SkyRLLoss) -> torch.Tensor:
    """The log-probs SkyRL's loss takes its ratio against [B, R], sent as the samples'
    `logprobs`: the old ones (action_log_probs), the rollout's (rollout_is, cispo with
    cispo_anchor=rollout; SkyRL asserts they exist), or for dppo the rollout's when the batch
    has them and else the old, as dppo_policy_loss chooses (`SkyRLLoss.behaviour`)."""
    rollout = data.get("rollout_logprobs")
    if loss.behaviour == "rollout" or (loss.behaviour == "rollout_or_old" and rollout is not None):
        if rollout is None:
            raise InvalidInput("rollout_logprobs", "this policy_loss_type takes its ratio against the rollout log-probs, "
                               "and the batch has none (the generator must return logprobs)")
        return rollout
    old = data.get("action_log_probs")
    if old is None:
        raise InvalidInput("action_log_probs", "the batch has no old log-probs (SkyRL skipped the policy forward)")
    return old


class FloeDispatch:
    """The parts of SkyRL's ``WorkerDispatch`` that ``RayPPOTrainer`` calls, on a floe client."""

    def __init__(self, cfg: Any, client: floe.Client, loss: SkyRLLoss, calls: Counter[str],
                 inference_client: FloeInferenceClient, trainer: RayPPOTrainer, total_optimizer_steps: int | None):
        self.cfg = cfg
        self.total_optimizer_steps = total_optimizer_steps
        self.scheduler = self._scheduler_at(0)
        self.client = client
        self.loss = loss
        self.calls = calls
        self.inference_client = inference_client
        self.trainer = trainer
        self.response_mask: torch.Tensor | None = None  # of the batch being scored (see the trainer)
        self.dirty = False  # an optim_step since the last sync
        self.last_sync_seconds: float | None = None
        self.run_name = "skyrl"
        self.capabilities = client.info().capabilities
        self.measured: dict[str, float] = {}  # the training step's forward_backward measurements, summed

    # -- data parallel shape: one floe backend is one logical worker ------------------------------
    def get_lcm_dp_size(self) -> int:
        return 1

    def dp_size(self, model: str) -> int:
        return 1

    def stage_data(self, model: str, data: TrainingInputBatch, mini_batch_boundaries: list[tuple[int, int]]) -> list[list[_Chunk]]:
        return [[_Chunk(data[s:e], s)] for s, e in mini_batch_boundaries]

    # -- forward passes ----------------------------------------------------------------------------
    def forward(self, model: str, data: TrainingInputBatch, loss_fn: str | None = None, **kwargs: Any) -> WorkerOutput:
        """Per-row log-probs of the last R (= metadata response_length) positions, right-aligned."""
        return self._forward(model, data, 0, loss_fn, kwargs)

    def forward_from_staged(self, model: str, chunk_refs: list[_Chunk], loss_fn: str | None = None, **kwargs: Any) -> WorkerOutput:
        return self._forward(model, chunk_refs[0].data, chunk_refs[0].start, loss_fn, kwargs)

    def _forward(self, model: str, data: TrainingInputBatch, start: int, loss_fn: str | None, kwargs: dict[str, Any]) -> WorkerOutput:
        if model not in ZONES:
            raise InvalidInput("model", f"floe has no {model!r} model (policy and ref only)")
        if loss_fn is not None or kwargs.get("loss_fn_config") is not None:
            raise InvalidInput("loss_fn", "forward with a loss is not supported by floe's SkyRL plugin")
        width = int(data.metadata["response_length"])
        rows = data["sequences"].shape[0]
        mask = self.response_mask
        known = mask is not None and mask.shape[1] == width and start + rows <= mask.shape[0]
        layout = skyrl_to_batch(
            data["sequences"], data["attention_mask"],
            mask[start : start + rows] if known else None,  # type: ignore[index]
            response_length=None if known else width,
        )
        self.calls["forward"] += 1
        res = self.client.forward(layout.batch, zone=ZONES[model], temperature=self.loss.temperature)
        values = skyrl_token_values(layout, res.logprobs, width)
        return WorkerOutput(loss_fn_outputs=[{"logprobs": row.tolist()} for row in values], metrics={})

    # -- training ----------------------------------------------------------------------------------
    def forward_backward(self, model: str, data: TrainingInputBatch, loss_fn: str | None = None,
                         loss_fn_config: dict[str, Any] | None = None, **kwargs: Any) -> WorkerOutput:
        """One PPO mini-batch: weights and advantages per mapping.py, then ``forward_backward``."""
        if model != "policy":
            raise InvalidInput("model", f"floe trains the policy only, not {model!r}")
        if loss_fn is not None or loss_fn_config is not None:
            raise InvalidInput("loss_fn", "per-call loss overrides are not supported; set trainer.algorithm.policy_loss_type")
        loss_mask = data["loss_mask"]
        weights = token_weights(loss_mask, self.loss.weighting, self.cfg.trainer.micro_train_batch_size_per_gpu)
        advantages, off_policy_metrics = self._off_policy_corrected(data)
        advantages = floe_advantages(advantages, loss_mask, weights)
        use_ref = "kl" in self.loss.loss_config
        width = data["response_mask"].shape[1]
        layout = skyrl_to_batch(
            data["sequences"], data["attention_mask"], data["response_mask"],
            logprobs=behaviour_logprobs(data, self.loss), advantages=advantages, weights=weights,
            ref_logprobs=data["base_action_log_probs"] if use_ref else None,
        )
        self.calls["forward_backward"] += 1
        res = self.client.forward_backward(layout.batch, loss=self.loss.loss, loss_config=self.loss.loss_config,
                                           temperature=self.loss.temperature)
        for key in ("seconds", "sequence_tokens", "model_flops"):
            if key in res.metrics:
                self.measured[key] = self.measured.get(key, 0.0) + res.metrics[key]
        new_logprobs = skyrl_token_values(layout, res.logprobs, width)
        metrics: dict[str, Any] = {
            "final_loss": res.metrics["loss"],
            "policy_loss": res.metrics["policy_loss"],
            "loss_metrics/clip_ratio": res.metrics.get("clip_fraction", 0.0),
            "response_length": width,
        }
        if self.cfg.trainer.algorithm.use_kl_loss:  # SkyRL's own: its estimator, per-sequence token mean
            kl = compute_approx_kl(new_logprobs, data["base_action_log_probs"], loss_mask=loss_mask,
                                   kl_estimator_type=self.cfg.trainer.algorithm.kl_estimator_type)
            metrics["policy_kl"] = float(masked_mean(kl, loss_mask, dim=-1).mean())
        for floe_key, skyrl_key in (("entropy", "policy_entropy"), ("kl_ref_k3", "policy_kl_k3"),
                                    ("ratio_mean", "loss_metrics/ratio_mean"), ("kl_sampler_k3", "floe_kl_sampler_k3")):
            if floe_key in res.metrics:
                metrics[skyrl_key] = res.metrics[floe_key]
        metrics.update({f"loss_metrics/{k}": v for k, v in off_policy_metrics.items()})
        rollout = data.get("rollout_logprobs")
        metrics.update(compute_minibatch_rollout_logprob_diff_metrics(new_logprobs, rollout, loss_mask.to(new_logprobs.dtype)))
        return WorkerOutput(loss_fn_outputs=[{"logprobs": row.tolist()} for row in new_logprobs], metrics=metrics)

    def _off_policy_corrected(self, data: TrainingInputBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The mini-batch's advantages with SkyRL's off-policy correction folded in (mapping.
        corrected_advantages), and SkyRL's metrics of it; unchanged when the correction is off.
        The correction is SkyRL's own ``compute_off_policy_correction`` on old (trainer) vs
        rollout (sampler) log-probs, as its policy losses call it."""
        if self.loss.off_policy is None:
            return data["advantages"], {}
        rollout = data.get("rollout_logprobs")
        if rollout is None:
            raise InvalidInput("trainer.algorithm.off_policy_correction",
                               "needs the sampler's log-probs (generator.sampling_params.logprobs); the batch has none")
        loss_mask = data["loss_mask"]
        tis, metrics, corrected = compute_off_policy_correction(
            data["action_log_probs"], rollout, loss_mask, OffPolicyCorrectionConfig(**self.loss.off_policy))  # type: ignore[arg-type]
        return corrected_advantages(data["advantages"], tis, loss_mask, corrected), metrics

    def forward_backward_from_staged(self, model: str, chunk_refs: list[_Chunk], **kwargs: Any) -> WorkerOutput:
        return self.forward_backward(model, chunk_refs[0].data, **kwargs)

    def optim_step(self, model: str, model_id: str | None = None) -> float:
        if model != "policy":
            raise InvalidInput("model", f"floe trains the policy only, not {model!r}")
        self.calls["optim_step"] += 1
        res = self.client.optim_step(lr=self.scheduler.get_last_lr()[0])
        advance(self.scheduler)
        self.dirty = True
        self.trainer.all_metrics["policy/policy_lr"] = res.lr
        return res.grad_norm

    def step_throughput(self) -> dict[str, float]:
        """The training step's throughput from the backend's measurements of its forward_backward
        calls (then cleared for the next step): `floe/train_seconds` (Σ seconds),
        `floe/train_tokens` (Σ sequence tokens), `floe/tokens_per_second`, `floe/peak_tflops`
        (one policy device; 0 = unknown) and, when the backend counts the model's FLOPs
        (floe.compute.flops), `floe/model_tflops` (achieved, all devices) and, with a known
        peak, `floe/mfu` = Σ model_flops / Σ seconds / (peak × policy devices)."""
        measured, self.measured = self.measured, {}
        seconds = measured.get("seconds", 0.0)
        if seconds <= 0:
            return {}
        peak = self.capabilities.get("peak_flops")
        out = {"floe/train_seconds": seconds, "floe/train_tokens": measured["sequence_tokens"],
               "floe/tokens_per_second": measured["sequence_tokens"] / seconds,
               "floe/peak_tflops": (peak or 0.0) / 1e12}
        if "model_flops" in measured:
            out["floe/model_tflops"] = measured["model_flops"] / seconds / 1e12
            utilisation = mfu(measured["model_flops"], seconds, peak, int(self.capabilities["policy_devices"]))
            if utilisation is not None:
                out["floe/mfu"] = utilisation
        return out

    def _scheduler_at(self, step: int) -> Any:
        """SkyRL's LR scheduler after `step` optimizer steps (where its own checkpoint would resume it)."""
        scheduler = lr_scheduler(asdict(self.cfg.trainer.policy.optimizer_config), self.total_optimizer_steps)
        advance(scheduler, step)
        return scheduler

    # -- weights for the sampler -------------------------------------------------------------------
    def init_weight_sync_state(self, inference_engine_client: Any) -> None:
        return None

    async def save_weights_for_sampler(self, model_id: str | None = None) -> None:
        """policy -> sampler with the trainer's step as the version tag. Before any optim_step
        the sampler already holds the policy's weights, so nothing moves."""
        if not self.dirty:
            return
        step = int(self.trainer.global_step)
        current = self.inference_client.weight_version
        t0 = time.perf_counter()
        self.calls["sync_weights"] += 1
        # off the event loop: under the fully-async trainer, generation keeps queuing meanwhile
        # (floe's sync waits for running samples; samples that arrive during it wait for it)
        res = await asyncio.to_thread(self.client.sync_weights, version=step if step > current else None)
        self.last_sync_seconds = time.perf_counter() - t0
        self.inference_client.weight_version = res.version
        self.dirty = False

    def get_timing_metrics(self) -> dict[str, float]:
        return {} if self.last_sync_seconds is None else {"sync_weights_only_transfer": self.last_sync_seconds}

    # -- checkpoints -------------------------------------------------------------------------------
    def save_checkpoint(self, model: str, ckpt_dir: str, tokenizer: Any = None, model_id: str | None = None) -> None:
        """floe saves the policy (weights + optimizer + step) as a named state; SkyRL's checkpoint
        folder records that name, so ``load_checkpoint`` finds it again."""
        if model != "policy":
            raise InvalidInput("model", f"floe checkpoints the policy only, not {model!r}")
        name = f"{self.run_name}-{Path(ckpt_dir).parent.name}"
        self.calls["save_state"] += 1
        self.client.save_state(name)
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(ckpt_dir) / STATE_FILE, name + "\n")

    def load_checkpoint(self, model: str, ckpt_dir: str, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, model_id: str | None = None) -> None:
        if model != "policy":
            raise InvalidInput("model", f"floe checkpoints the policy only, not {model!r}")
        if not (load_optimizer_states and load_lr_scheduler_states):
            raise InvalidInput("trainer.resume_mode", "floe restores weights, optimizer and schedule together")
        name = (Path(ckpt_dir) / STATE_FILE).read_text().strip()
        self.calls["load_state"] += 1
        res = self.client.load_state(name)
        self.scheduler = self._scheduler_at(res.step)
        self.inference_client.weight_version = res.version
        self.dirty = True

    def finalize_pending_saves(self, model: str) -> None:
        return None

    def save_hf_model(self, model: str, export_dir: str, tokenizer: Any) -> None:
        if model != "policy":
            raise InvalidInput("model", f"floe exports the policy only, not {model!r}")
        self.calls["export_hf"] += 1
        self.client.export_hf(export_dir)
        tokenizer.save_pretrained(export_dir)

    def init_model(self, model: str, model_path: str, num_training_steps: int | None = None) -> None:
        raise InvalidInput("trainer.update_ref_every_epoch", "floe's reference zone is fixed for the run")

    # -- placement, memory and profiling hooks: floe owns these ------------------------------------
    def empty_cache(self, model: str | None = None) -> None:
        return None

    def mark_all_offloaded(self) -> None:
        return None

    def get_node_ids(self) -> list[str]:
        return []

    def start_profile(self, model: str, config: dict | None = None, raise_on_error: bool = False) -> None:
        return None

    def profile_step(self, model: str) -> None:
        return None

    def stop_profile(self, model: str, raise_on_error: bool = False) -> None:
        return None

    def dump_profiler_summary(self, model: str) -> None:
        return None


class FloeTrainerMixin:
    """What SkyRL's trainers need to run on floe (see the module doc); mixed into
    ``RayPPOTrainer`` here and into ``FullyAsyncRayPPOTrainer`` in fully_async.py."""

    cfg: Any
    all_metrics: dict[str, Any]
    inference_engine_client: Any
    dispatch: Any
    trajectory_logger: Any

    def __init__(self, *args: Any, floe_client: floe.Client, floe_loss: SkyRLLoss, floe_calls: Counter[str], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._floe = (floe_client, floe_loss, floe_calls)

    def build_models(self, PolicyWorker: Any, CriticWorker: Any, RefWorker: Any) -> None:
        client, loss, calls = self._floe
        algorithm = self.cfg.trainer.algorithm
        self.policy_model = "floe:policy"  # no Ray actor group: floe holds the model
        self.critic_model = None
        self.ref_model = "floe:reference" if (algorithm.use_kl_loss or algorithm.use_kl_in_reward) else None
        assert isinstance(self.inference_engine_client, FloeInferenceClient)
        # SkyRL's own count: the scheduler spans every optimizer step of the run.
        total = optimizer_steps(self.cfg.trainer, self.total_training_steps)  # type: ignore[attr-defined]
        self.dispatch = FloeDispatch(self.cfg, client, loss, calls, self.inference_engine_client, self, total)  # type: ignore[arg-type]
        self.dispatch.run_name = self.cfg.trainer.run_name or "skyrl"
        # SkyRL's trainer/tokens_per_second_per_gpu divides by this: the devices floe's policy trains on.
        self._num_training_gpus = int(self.dispatch.capabilities["policy_devices"])

    def train_critic_and_policy(self, data: TrainingInputBatch) -> Any:
        """SkyRL's training step, then floe's throughput of it into the step's metrics
        (`FloeDispatch.step_throughput`)."""
        self.dispatch.measured = {}
        status = super().train_critic_and_policy(data)  # type: ignore[misc]
        self.all_metrics.update(self.dispatch.step_throughput())
        return status

    def fwd_logprobs_values_reward(self, training_input: TrainingInputBatch) -> TrainingInputBatch:
        self.dispatch.response_mask = training_input["response_mask"]
        try:
            return super().fwd_logprobs_values_reward(training_input)  # type: ignore[misc]
        finally:
            self.dispatch.response_mask = None


class FloeRayPPOTrainer(FloeTrainerMixin, RayPPOTrainer):
    """SkyRL's (synchronous) PPO trainer whose models live in a floe backend (see the module doc)."""
