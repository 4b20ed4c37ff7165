"""The one-line switch: SkyRL's stock ``main_base`` command with its models in a floe backend.

    python -m skyrl.train.entrypoints.main_base trainer.override_entrypoint=floe.integrations.skyrl.entrypoint ...

SkyRL's ``main_base`` sees ``trainer.override_entrypoint`` and calls `main` here, which parses
the same command line into `FloeSkyRLConfig` (SkyRL's config plus an optional ``floe`` block),
runs SkyRL's own ``validate_cfg``, checks that floe can honour every loss / optimizer /
sampling / model key (mapping.py, `check_supported`; an InvalidInput names the key otherwise),
counts the GPUs the backend needs, runs SkyRL's ``initialize_ray`` (`skyrl_ray_config`) and
runs `FloeExp` in one Ray task as ``main_base`` does. With ``trainer.fully_async.enabled=true``
the trainer is SkyRL's fully-async one (fully_async.py: generation overlaps training, staleness from floe's
weights versions). SkyRL's dataset, generator, skyrl-gym environments,
advantage estimators, loss reduction, metrics and trainer loop run unchanged; the policy,
reference and sampler are floe's.

The backend: embedded by default, built from ``trainer.policy.model.path`` (reference from
``trainer.ref.model.path``, optimizer from ``trainer.policy.optimizer_config``, seed from
``trainer.seed``, device / dtype / engine / placement from the recipe's placement, precision and
``generator.inference_engine`` keys: hardware.py; ``floe.backend.*`` on top); or a running ``floe serve`` with ``floe.url=http://host:port`` and
``floe.token=...`` (default: $FLOE_TOKEN), whose own configuration then applies. At the end
the number of each floe call made is written to ``<trainer.export_path>/floe_calls.json``, and
every metrics record SkyRL logs is also appended, at full precision, to
``<trainer.export_path>/floe_metrics.jsonl``.
"""

import copy
import importlib
import json
import logging
import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from skyrl.train.config import SkyRLTrainConfig
from skyrl.train.config.config import BaseConfig
from skyrl.train.dataset import PromptDataset
from skyrl.train.entrypoints.main_base import BasePPOExp
from skyrl.train.utils import validate_cfg
from skyrl.train.utils.tracking import Tracking
from skyrl.train.utils.utils import initialize_ray

import floe
from floe.atomic import atomic_write_text
from floe.config import parse_config
from floe.errors import InvalidInput
from floe.integrations.hardware import check_installed, check_server_lora, describe, with_overrides
from floe.integrations.skyrl.dispatch import FloeRayPPOTrainer, FloeTrainerMixin
from floe.integrations.skyrl.fully_async import FloeFullyAsyncTrainer, VersionedGenerator, check_fully_async
from floe.integrations.skyrl.hardware import SkyRLHardware, skyrl_hardware, skyrl_lora
from floe.integrations.skyrl.inference import FloeInferenceClient
from floe.integrations.skyrl.mapping import SkyRLLoss, map_loss, map_optimizer, map_sampling, optimizer_steps
from floe.placement.gpus import check_cluster_gpus, needs_gpu_process

OVERRIDE_KEY = "trainer.override_entrypoint="
log = logging.getLogger("floe.integrations.skyrl")
CALLS_FILE = "floe_calls.json"
METRICS_FILE = "floe_metrics.jsonl"


@dataclass
class FloeBlock(BaseConfig):
    """``floe.*`` keys on the SkyRL command line (all optional)."""

    url: str | None = None
    """A ``floe serve`` address; None = an embedded backend in the training process."""
    token: str | None = None
    """The server's bearer token (default: $FLOE_TOKEN)."""
    backend: dict[str, Any] = field(default_factory=dict)
    """BackendConfig keys of the embedded backend, applied over what the recipe's keys map to
    (hardware.py), e.g. ``floe.backend.device=cpu`` (SkyRL has no CPU mode of its own),
    ``floe.backend.num_threads=2``, ``floe.backend.state_dir=...`` (default
    <trainer.ckpt_path>/floe_states)."""
    import_modules: list[str] = field(default_factory=list)
    """Modules imported in the training process before anything is built, e.g. ones that
    register custom skyrl-gym environments (SkyRL's examples do that in their own main)."""


@dataclass
class FloeSkyRLConfig(SkyRLTrainConfig):
    """SkyRL's config plus the ``floe`` block."""

    floe: FloeBlock = field(default_factory=FloeBlock)


def check_supported(cfg: SkyRLTrainConfig) -> SkyRLLoss:
    """Every SkyRL setting the plugin cannot honour, refused by name before anything starts.

    Returns the floe loss for ``trainer.algorithm``. Raises InvalidInput naming the key.
    """
    trainer = cfg.trainer
    if trainer.fully_async.enabled:
        check_fully_async(cfg)
    if trainer.update_ref_every_epoch:
        raise InvalidInput("trainer.update_ref_every_epoch", "floe's reference zone is fixed for the run")
    if cfg.generator.vision_language_generator:
        raise InvalidInput("generator.vision_language_generator", "floe is text-only")
    for name in ("policy", "ref"):
        if getattr(trainer, name).model_config_kwargs:
            raise InvalidInput(f"trainer.{name}.model_config_kwargs", "floe builds the model from its own config.json: "
                               "it has no override of the Hugging Face config (e.g. rope_parameters); save the changed "
                               "config with the checkpoint instead")
    engine = cfg.generator.inference_engine
    if engine.engine_init_kwargs:
        raise InvalidInput("generator.inference_engine.engine_init_kwargs", "floe builds its sampler engine from "
                           "floe.backend.sampler.engine (docs/engines.md), not from vLLM keyword arguments")
    if engine.delta_weight_sync is not None:
        raise InvalidInput("generator.inference_engine.delta_weight_sync", "floe syncs the policy's weights to its "
                           "sampler itself (verified by fingerprint); there is no delta sync directory")
    check_sampling(cfg.generator)
    loss = map_loss(asdict(trainer.algorithm), max_tokens_per_microbatch=trainer.max_tokens_per_microbatch,
                    has_critic=bool(trainer.critic.model.path))
    map_optimizer(asdict(trainer.policy.optimizer_config), total_steps=_total_optimizer_steps(cfg))
    floe_block = getattr(cfg, "floe", None)
    skyrl_hardware(asdict(trainer), asdict(cfg.generator), (floe_block.backend if floe_block else {}).get("device"))
    return loss


def check_sampling(generator: Any) -> None:
    """``generator.sampling_params`` and ``generator.eval_sampling_params`` as floe samples them
    (`map_sampling`), checked before anything starts. SkyRL drops ``repetition_penalty`` from the
    requests it sends, so it is checked here by its key; InvalidInput names the SkyRL key."""
    for section in ("sampling_params", "eval_sampling_params"):
        params, where = getattr(generator, section), f"generator.{section}"
        if params.repetition_penalty != 1.0:
            raise InvalidInput(f"{where}.repetition_penalty", "floe's sampler has no repetition penalty; keep 1.0")
        request = {"max_tokens": params.max_generate_length, "temperature": params.temperature, "top_p": params.top_p,
                   "min_p": params.min_p, "top_k": params.top_k, "logprobs": params.logprobs, "stop": params.stop}
        for keys, prefix in ((request, where), *(({k: v}, f"{where}.additional_kwargs")
                                                 for k, v in (params.additional_kwargs or {}).items())):
            try:
                map_sampling(keys)
            except InvalidInput as err:
                raise InvalidInput(prefix + err.field.removeprefix("sampling_params"), err.message) from None


def _total_optimizer_steps(cfg: SkyRLTrainConfig) -> int | None:
    return optimizer_steps(cfg.trainer, cfg.trainer.max_training_steps)


def embedded_backend(cfg: FloeSkyRLConfig) -> tuple[dict[str, Any], SkyRLHardware]:
    """The embedded backend's BackendConfig dict and what the recipe's hardware keys asked for:
    model, seed, optimizer and reference from SkyRL's keys, device / dtype / engine / placement
    from hardware.py, then ``floe.backend`` on top. InvalidInput naming the key otherwise."""
    trainer = cfg.trainer
    policy_path = trainer.policy.model.path
    if not policy_path:
        raise InvalidInput("trainer.policy.model.path", "the embedded floe backend needs the policy model path")
    ref_path = trainer.ref.model.path
    use_ref = trainer.algorithm.use_kl_loss or trainer.algorithm.use_kl_in_reward
    overrides = dict(cfg.floe.backend or {})
    hardware = skyrl_hardware(asdict(trainer), asdict(cfg.generator), overrides.get("device"))
    backend = {
        "model": policy_path, "seed": trainer.seed, "state_dir": str(Path(trainer.ckpt_path) / "floe_states"),
        "optimizer": map_optimizer(asdict(trainer.policy.optimizer_config), _total_optimizer_steps(cfg)),
        "reference": {"enabled": bool(use_ref), "checkpoint": ref_path if ref_path and ref_path != policy_path else None},
        **hardware.backend,
    }
    return with_overrides(backend, overrides, "floe.backend"), hardware


def connect_floe(cfg: FloeSkyRLConfig) -> floe.Client:
    """The floe client the config asks for (see the module doc)."""
    block = cfg.floe
    if block.url:
        if block.backend:
            raise InvalidInput("floe.backend", "configures the embedded backend; a floe.url server has its own "
                               "configuration: drop one of them")
        client = floe.connect(block.url, token=block.token)
        trainer = cfg.trainer
        recipe_lora = skyrl_lora(asdict(trainer.policy.model.lora))
        check_server_lora(recipe_lora, client.info().capabilities.get("lora"), "trainer.policy.model.lora.rank")
        return client
    backend, _ = embedded_backend(cfg)
    log.warning("%s", describe(backend))
    return floe.connect(parse_config(floe.BackendConfig, backend, where="floe.backend"))


class JsonlTracking(Tracking):
    """SkyRL's tracker that also appends each record, at full precision, to a JSONL file."""

    def __init__(self, *args: Any, jsonl_path: Path, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.jsonl_path = jsonl_path

    def log(self, data: dict[str, Any], step: int, commit: bool = False) -> None:
        super().log(data, step, commit=commit)
        record = {"step": step, **{k: v for k, v in data.items() if isinstance(v, (int, float, str, bool))}}
        with self.jsonl_path.open("a") as f:  # append-only log, one complete line per record
            f.write(json.dumps(record) + "\n")


class FloeExp(BasePPOExp):
    """SkyRL's PPO experiment with the policy, reference and sampler in floe."""

    def __init__(self, cfg: FloeSkyRLConfig):
        for module in cfg.floe.import_modules:
            importlib.import_module(module)
        self.floe_loss = check_supported(cfg)
        self.floe_calls: Counter[str] = Counter()
        self.floe_client = connect_floe(cfg)
        super().__init__(cfg)

    # SkyRL's base builds each dataset with 8 preprocessing processes; on small machines that
    # costs more than the work. Same rows either way.
    def _dataset(self, files: list[str]) -> PromptDataset:
        return PromptDataset(datasets=files, tokenizer=self.tokenizer, max_prompt_length=self.cfg.trainer.max_prompt_length,
                             num_workers=max(1, min(8, os.cpu_count() or 1)))

    def get_train_dataset(self) -> PromptDataset:
        ds = self._dataset(self.cfg.data.train_data)
        if len(ds) < self.cfg.trainer.train_batch_size:
            raise InvalidInput("data.train_data", f"{len(ds)} rows, fewer than trainer.train_batch_size={self.cfg.trainer.train_batch_size}")
        return ds

    def get_eval_dataset(self) -> PromptDataset | None:
        if self.cfg.trainer.eval_interval > 0 and self.cfg.data.val_data:
            return self._dataset(self.cfg.data.val_data)
        return None

    def get_tracker(self) -> JsonlTracking:
        os.makedirs(self.cfg.trainer.export_path, exist_ok=True)
        return JsonlTracking(project_name=self.cfg.trainer.project_name, experiment_name=self.cfg.trainer.run_name,
                             backend=self.cfg.trainer.logger, config=self.cfg, tags=self.cfg.trainer.tags,
                             jsonl_path=Path(self.cfg.trainer.export_path) / METRICS_FILE)

    def get_colocate_pg(self, timeout: int = 0) -> None:
        return None  # floe places its own zones; no GPU placement group

    def get_inference_client(self) -> FloeInferenceClient:
        """Sampling goes through a fork of the floe client (its own ordered stream), so that under
        the fully-async trainer it runs while the trainer thread trains on the main one."""
        self.sampler_client = self.floe_client.fork()
        return FloeInferenceClient(self.sampler_client, self.tokenizer, str(self.cfg.trainer.policy.model.path), self.floe_calls)

    def get_generator(self, cfg: Any, tokenizer: Any, inference_engine_client: Any) -> Any:
        """SkyRL's generator; under the fully-async trainer wrapped to carry floe's weights
        versions (fully_async.VersionedGenerator)."""
        generator = super().get_generator(cfg, tokenizer, inference_engine_client)
        return VersionedGenerator(generator) if cfg.trainer.fully_async.enabled else generator

    def get_trainer(self, cfg: Any, tracker: Any, tokenizer: Any, train_dataset: Any, eval_dataset: Any,
                    inference_engine_client: Any, generator: Any, colocate_pg: Any) -> FloeTrainerMixin:
        """SkyRL's RayPPOTrainer, or its FullyAsyncRayPPOTrainer with ``trainer.fully_async.enabled``, on floe."""
        trainer_class = FloeFullyAsyncTrainer if cfg.trainer.fully_async.enabled else FloeRayPPOTrainer
        return trainer_class(
            cfg=cfg, tracker=tracker, tokenizer=tokenizer, train_dataset=train_dataset, eval_dataset=eval_dataset,
            inference_engine_client=inference_engine_client, generator=generator, colocate_pg=colocate_pg,
            floe_client=self.floe_client, floe_loss=self.floe_loss, floe_calls=self.floe_calls,
        )

    def _setup_trainer(self) -> FloeTrainerMixin:
        """SkyRL's ``_setup_trainer`` without its FSDP/Megatron worker imports (which need CUDA
        and flash-attn): the models are floe's."""
        os.makedirs(self.cfg.trainer.export_path, exist_ok=True)
        os.makedirs(self.cfg.trainer.ckpt_path, exist_ok=True)
        tracker = self.get_tracker()
        inference_engine_client = self.get_inference_client()
        generator = self.get_generator(self.cfg, self.tokenizer, inference_engine_client)
        trainer = self.get_trainer(cfg=self.cfg, tracker=tracker, tokenizer=self.tokenizer, train_dataset=self.train_dataset,
                                   eval_dataset=self.eval_dataset, inference_engine_client=inference_engine_client,
                                   generator=generator, colocate_pg=self.colocate_pg)
        trainer.trajectory_logger = self.get_trajectory_logger()
        self.trainer = trainer
        trainer.build_models(None, None, None)
        return trainer

    def run(self) -> None:
        try:
            super().run()
        finally:
            out = Path(self.cfg.trainer.export_path) / CALLS_FILE
            atomic_write_text(out, json.dumps(dict(sorted(self.floe_calls.items())), indent=1) + "\n")
            if getattr(self, "sampler_client", None) is not None:
                self.sampler_client.close()
            self.floe_client.close()


@ray.remote(num_cpus=1)
def floe_skyrl_entrypoint(cfg: FloeSkyRLConfig) -> None:
    FloeExp(cfg).run()


def parse(argv: list[str]) -> FloeSkyRLConfig:
    """The SkyRL command line (less ``trainer.override_entrypoint``) as a validated config."""
    cfg = FloeSkyRLConfig.from_cli_overrides([a for a in argv if not a.startswith(OVERRIDE_KEY)])
    validate_cfg(cfg)
    check_supported(cfg)
    # SkyRL's scraper of its own vLLM engines' Prometheus endpoints: floe's sampler is not one of
    # them (its metrics are floe's: /metrics of `floe serve`), and with Ray's default build the
    # scraper's port is -1, which fails the first training step.
    cfg.generator.inference_engine.enable_ray_prometheus_stats = False
    return cfg


def skyrl_ray_config(cfg: FloeSkyRLConfig, backend: dict[str, Any] | None) -> FloeSkyRLConfig:
    """The config SkyRL's ``initialize_ray`` is given. Its ``prepare_runtime_environment`` probes
    NCCL peer access whenever one of the recipe's GPU counts is above 1 (every stock recipe's are
    4), on a machine without CUDA by waiting up to 180 s for a 2-GPU node; what it finds sets NCCL
    variables for GPU workers. A run whose floe backend uses no GPU of this cluster (a CPU backend,
    or `floe.url`: `backend` None) has no such workers, so there its copy reads counts of 1."""
    if backend is not None and str(backend.get("device", "cpu")).startswith("cuda"):
        return cfg
    out = copy.deepcopy(cfg)
    placement = out.trainer.placement
    placement.policy_num_gpus_per_node = placement.critic_num_gpus_per_node = placement.ref_num_gpus_per_node = 1
    out.generator.inference_engine.tensor_parallel_size = 1
    return out


def main() -> None:
    """Entry point called by SkyRL's ``main_base`` for ``trainer.override_entrypoint=floe.integrations.skyrl.entrypoint``.

    The training task runs the embedded backend: on one GPU with every zone in its process it
    is given that GPU (Ray shows a GPU only to the task it gives it to); with a Ray placement
    the backend's own actors take the GPUs. Fewer GPUs in the cluster than the recipe asks for
    is refused here, before any model loads."""
    cfg = parse(sys.argv[1:])
    backend, hardware = (None, None) if cfg.floe.url else embedded_backend(cfg)
    gpu_hint = "SkyRL places the policy on GPUs; to train on the CPU add floe.backend.device=cpu"
    if hardware is not None and hardware.gpus and not torch.cuda.is_available():
        # No GPU here: the cluster's are counted now, so that a missing GPU is this refusal, not
        # SkyRL's 180 s wait for a 2-GPU node in initialize_ray (skyrl_ray_config).
        ray.init()
        try:
            check_cluster_gpus(hardware.gpus, "trainer.placement.policy_num_gpus_per_node", gpu_hint)
        finally:
            ray.shutdown()
    initialize_ray(skyrl_ray_config(cfg, backend))
    task = floe_skyrl_entrypoint
    if backend is not None and hardware is not None:
        check_cluster_gpus(hardware.gpus, "trainer.placement.policy_num_gpus_per_node", gpu_hint)
        check_installed(backend, "generator.inference_engine.backend", "trainer.flash_attn")
        if needs_gpu_process(backend):
            task = task.options(num_gpus=1)
    ray.get(task.remote(cfg))


if __name__ == "__main__":
    main()
