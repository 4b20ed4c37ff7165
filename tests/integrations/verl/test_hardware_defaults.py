"""verl's own composed config (Hydra, verl 0.9.1's ppo_trainer.yaml with its defaults) through the
plugin's hardware mapping: a stock GPU recipe's device, precision, offload and vLLM keys become
a valid floe BackendConfig that trains and samples on its GPUs (no GPU needed to check that).
Runs in verl's environment (scripts/ci/verl.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest

import floe
from floe.integrations.verl.backend_config import floe_target

pytestmark = pytest.mark.verl

# The device, memory and engine keys of verl's examples/grpo_trainer/run_qwen2-7b_math.sh, as given there.
STOCK_GRPO_GPU = [
    "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct", "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "trainer.n_gpus_per_node=4", "trainer.nnodes=1",
]


def composed(overrides: list[str]) -> dict:
    import verl  # noqa: PLC0415 - verl's environment
    from hydra import compose, initialize_config_dir  # noqa: PLC0415
    from omegaconf import OmegaConf  # noqa: PLC0415

    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        cfg = compose("ppo_trainer", overrides=overrides)
    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)
    return out


def test_a_stock_grpo_gpu_recipe_maps_to_a_gpu_backend():
    cfg = composed(STOCK_GRPO_GPU)
    target = floe_target(cfg)
    backend = target.backend
    assert backend is not None and target.hardware.gpus == 4
    floe.BackendConfig.model_validate(backend)
    assert (backend["device"], backend["dtype"]) == ("cuda", "bfloat16")  # verl's default trainer.device and FSDP dtype
    assert backend["compute"]["gradient_checkpointing"] is True
    engine = backend["sampler"]["engine"]
    assert engine["name"] == "vllm" and engine["gpu_memory_utilization"] == 0.6 and engine["enable_sleep_mode"] is True
    assert engine["max_num_batched_tokens"] == 8192 and engine["enable_chunked_prefill"] is True
    # ref offload and verl's default free_cache_engine: training and generation take turns on the 4 GPUs
    placement = backend["placement"]
    assert placement["kind"] == "ray" and placement["colocate"] is True
    assert placement["policy"]["workers"] == placement["sampler"]["workers"] == 4


def test_verls_cpu_settings_map_to_a_local_cpu_backend():
    cfg = composed([*STOCK_GRPO_GPU[:-2], "trainer.device=cpu", "trainer.n_gpus_per_node=1",
                    "actor_rollout_ref.actor.fsdp_config.dtype=float32", "actor_rollout_ref.ref.fsdp_config.dtype=float32"])
    backend = floe_target(cfg).backend
    assert backend is not None
    floe.BackendConfig.model_validate(backend)
    assert (backend["device"], backend["dtype"], backend["placement"]) == ("cpu", "float32", {"kind": "local"})
    assert backend["sampler"]["engine"]["dtype"] == "bfloat16"  # verl's rollout.dtype default, kept as given


def test_verls_own_fp16_choice_is_refused_by_its_key():
    cfg = composed([*STOCK_GRPO_GPU, "actor_rollout_ref.actor.fsdp_config.dtype=float16"])
    with pytest.raises(floe.InvalidInput) as info:
        floe_target(cfg)
    assert info.value.field == "actor_rollout_ref.actor.fsdp_config.dtype"
