"""verl's device, precision, memory and engine keys -> the plugin's BackendConfig
(floe.integrations.verl.hardware, pure; core suite). Each key's effect on the resulting
BackendConfig, every refusal by its verl name, and that each result is a valid floe config.
verl's own composed defaults go through the same mapping in
tests/integrations/verl/test_hardware_defaults.py (verl's environment)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

import floe
from floe.integrations.verl.backend_config import floe_target
from floe.integrations.verl.hardware import verl_hardware

# verl 0.9.1's defaults (verl/trainer/config/_generated_ppo_trainer.yaml) for the keys hardware.py reads,
# with the GPU count of a typical single-node recipe.
GPU_RECIPE: dict[str, Any] = {
    "trainer": {"device": "cuda", "n_gpus_per_node": 8, "nnodes": 1},
    "actor_rollout_ref": {
        "model": {"path": "Qwen/Qwen3-0.6B", "enable_gradient_checkpointing": True, "enable_activation_offload": False,
                  "use_remove_padding": True, "trust_remote_code": False},
        "actor": {"strategy": "fsdp", "use_dynamic_bsz": False, "ppo_max_token_len_per_gpu": 16384,
                  "ulysses_sequence_parallel_size": 1,
                  "fsdp_config": {"param_offload": False, "optimizer_offload": False, "offload_policy": False,
                                  "fsdp_size": -1, "model_dtype": "fp32", "dtype": "bfloat16",
                                  "ulysses_sequence_parallel_size": 1}},
        "ref": {"fsdp_config": {"param_offload": False, "model_dtype": "fp32", "dtype": "bfloat16"},
                "ulysses_sequence_parallel_size": 1},
        "rollout": {"name": "vllm", "dtype": "bfloat16", "gpu_memory_utilization": 0.5, "enforce_eager": False,
                    "free_cache_engine": True, "tensor_model_parallel_size": 2, "data_parallel_size": 1,
                    "expert_parallel_size": 1, "pipeline_model_parallel_size": 1, "max_num_batched_tokens": 8192,
                    "max_model_len": None, "max_num_seqs": 256, "enable_chunked_prefill": True,
                    "enable_prefix_caching": True, "logprobs_mode": "processed_logprobs", "load_format": "dummy",
                    "quantization": None},
    },
}


def recipe(**changes: Any) -> dict[str, Any]:
    """GPU_RECIPE with dotted-key changes, e.g. recipe(**{"trainer.device": "cpu"})."""
    cfg = copy.deepcopy(GPU_RECIPE)
    for dotted, value in changes.items():
        node = cfg
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return cfg


def backend_of(cfg: dict[str, Any]) -> dict[str, Any]:
    """The plugin's BackendConfig dict for `cfg`, checked to be a valid floe config."""
    target = floe_target(cfg)
    assert target.backend is not None
    floe.BackendConfig.model_validate(target.backend)
    return target.backend


def test_a_stock_gpu_recipe_trains_and_samples_on_its_gpus_in_bf16_with_vllm():
    backend = backend_of(recipe())
    assert backend["device"] == "cuda" and backend["dtype"] == "bfloat16"
    assert backend["compute"] == {"gradient_checkpointing": True}
    # verl's hybrid engine (free_cache_engine): training and generation take turns on all 8 GPUs.
    assert backend["placement"] == {
        "kind": "ray", "address": "auto", "colocate": True, "policy": {"workers": 8, "gpus": 0.5},
        "sampler": {"workers": 8, "gpus": 0.5}, "reference": {"colocate_with_policy": True}}
    assert backend["sampler"]["engine"] == {
        "name": "vllm", "gpu_memory_utilization": 0.5, "enforce_eager": False, "max_num_seqs": 256,
        "enable_prefix_caching": True, "max_num_batched_tokens": 8192, "enable_chunked_prefill": True,
        "enable_sleep_mode": True}
    assert verl_hardware(recipe()).gpus == 8


def test_one_gpu_without_offload_keeps_every_zone_resident_in_one_process():
    backend = backend_of(recipe(**{"trainer.n_gpus_per_node": 1, "actor_rollout_ref.rollout.free_cache_engine": False,
                                   "actor_rollout_ref.rollout.tensor_model_parallel_size": 1}))
    assert backend["placement"] == {"kind": "local"} and backend["device"] == "cuda"
    assert "enable_sleep_mode" not in backend["sampler"]["engine"]


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.fsdp_config.param_offload",
                                 "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
                                 "actor_rollout_ref.actor.fsdp_config.offload_policy",
                                 "actor_rollout_ref.ref.fsdp_config.param_offload",
                                 "actor_rollout_ref.rollout.free_cache_engine"])
def test_offload_on_one_gpu_takes_turns_in_the_colocated_placement(key):
    base = {"trainer.n_gpus_per_node": 1, "actor_rollout_ref.rollout.free_cache_engine": False,
            "actor_rollout_ref.rollout.tensor_model_parallel_size": 1}
    backend = backend_of(recipe(**{**base, key: True}))
    assert backend["placement"]["kind"] == "ray" and backend["placement"]["colocate"] is True
    assert backend["placement"]["policy"]["workers"] == backend["placement"]["sampler"]["workers"] == 1


def test_on_the_cpu_everything_is_local_and_chunked_prefill_is_left_to_the_engine():
    backend = backend_of(recipe(**{"trainer.device": "cpu"}))
    assert backend["device"] == "cpu" and backend["placement"] == {"kind": "local"}
    assert "enable_chunked_prefill" not in backend["sampler"]["engine"]
    assert "enable_sleep_mode" not in backend["sampler"]["engine"]
    assert verl_hardware(recipe(**{"trainer.device": "cpu"})).gpus == 0


@pytest.mark.parametrize(
    ("changes", "path", "value"),
    [
        ({"actor_rollout_ref.actor.fsdp_config.dtype": "float32", "actor_rollout_ref.ref.fsdp_config.dtype": "fp32",
          "actor_rollout_ref.rollout.dtype": "float32"}, "dtype", "float32"),
        ({"actor_rollout_ref.rollout.dtype": "float32"}, "sampler.engine.dtype", "float32"),
        ({"actor_rollout_ref.rollout.dtype": "fp16"}, "sampler.engine.dtype", "float16"),  # sampling only
        ({"actor_rollout_ref.model.enable_gradient_checkpointing": False}, "compute.gradient_checkpointing", False),
        ({"actor_rollout_ref.actor.use_dynamic_bsz": True, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 4096},
         "compute.max_tokens_per_microbatch", 4096),
        ({"actor_rollout_ref.model.trust_remote_code": True}, "trust_remote_code", True),
        ({"actor_rollout_ref.rollout.gpu_memory_utilization": 0.7}, "sampler.engine.gpu_memory_utilization", 0.7),
        ({"actor_rollout_ref.rollout.enforce_eager": True}, "sampler.engine.enforce_eager", True),
        ({"actor_rollout_ref.rollout.max_num_seqs": 64}, "sampler.engine.max_num_seqs", 64),
        ({"actor_rollout_ref.rollout.max_model_len": 4096}, "sampler.engine.max_model_len", 4096),
        ({"actor_rollout_ref.rollout.enable_prefix_caching": False}, "sampler.engine.enable_prefix_caching", False),
        ({"actor_rollout_ref.rollout.max_num_batched_tokens": 2048}, "sampler.engine.max_num_batched_tokens", 2048),
        ({"actor_rollout_ref.rollout.enable_chunked_prefill": False}, "sampler.engine.enable_chunked_prefill", False),
        ({"actor_rollout_ref.rollout.name": "floe"}, "sampler.engine", {"name": "torch"}),
        ({"trainer.n_gpus_per_node": 4, "trainer.nnodes": 2}, "placement.policy.workers", 8),
        ({"actor_rollout_ref.rollout.tensor_model_parallel_size": 4}, "placement.sampler.workers", 8),
    ],
)
def test_each_key_takes_effect(changes, path, value):
    node: Any = backend_of(recipe(**changes))
    for part in path.split("."):
        node = node[part]
    assert node == value


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"trainer.device": "npu"}, "trainer.device"),
        ({"trainer.n_gpus_per_node": 0}, "trainer.n_gpus_per_node"),
        ({"actor_rollout_ref.actor.fsdp_config.dtype": "fp16"}, "actor_rollout_ref.actor.fsdp_config.dtype"),
        ({"actor_rollout_ref.actor.fsdp_config.dtype": "int8"}, "actor_rollout_ref.actor.fsdp_config.dtype"),
        ({"actor_rollout_ref.actor.fsdp_config.model_dtype": "bf16"}, "actor_rollout_ref.actor.fsdp_config.model_dtype"),
        ({"actor_rollout_ref.ref.fsdp_config.dtype": "float32"}, "actor_rollout_ref.ref.fsdp_config.dtype"),
        ({"actor_rollout_ref.actor.strategy": "megatron"}, "actor_rollout_ref.actor.strategy"),
        ({"actor_rollout_ref.actor.fsdp_config.fsdp_size": 4}, "actor_rollout_ref.actor.fsdp_config.fsdp_size"),
        ({"actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2},
         "actor_rollout_ref.actor.ulysses_sequence_parallel_size"),
        ({"actor_rollout_ref.model.enable_activation_offload": True}, "actor_rollout_ref.model.enable_activation_offload"),
        ({"actor_rollout_ref.actor.fsdp_config.qat": {"enable": True}}, "actor_rollout_ref.actor.fsdp_config.qat.enable"),
        ({"actor_rollout_ref.model.mtp": {"enable": True}}, "actor_rollout_ref.model.mtp.enable"),
        ({"actor_rollout_ref.rollout.engine_kwargs": {"vllm": {"swap_space": 4}}},
         "actor_rollout_ref.rollout.engine_kwargs.vllm"),
        ({"actor_rollout_ref.rollout.name": "sglang"}, "actor_rollout_ref.rollout.name"),
        ({"actor_rollout_ref.rollout.tensor_model_parallel_size": 3},
         "actor_rollout_ref.rollout.tensor_model_parallel_size"),
        ({"actor_rollout_ref.rollout.pipeline_model_parallel_size": 2},
         "actor_rollout_ref.rollout.pipeline_model_parallel_size"),
        ({"actor_rollout_ref.rollout.logprobs_mode": "raw_logprobs"}, "actor_rollout_ref.rollout.logprobs_mode"),
        ({"actor_rollout_ref.rollout.quantization": "fp8"}, "actor_rollout_ref.rollout.quantization"),
        ({"actor_rollout_ref.rollout.free_cache_engine": "yes"}, "actor_rollout_ref.rollout.free_cache_engine"),
    ],
)
def test_what_floe_cannot_honour_is_refused_by_its_verl_key(changes, field):
    with pytest.raises(floe.InvalidInput) as info:
        floe_target(recipe(**changes))
    assert info.value.field == field


def test_floe_backend_keys_apply_last():
    cfg = recipe(**{"floe.backend": {"sampler": {"engine": {"name": "torch", "max_batch_sequences": 32}},
                                     "placement": {"kind": "local"}, "device": "cuda:1"}})
    backend = backend_of(cfg)
    # another engine or placement kind replaces the recipe's table instead of merging into it
    assert backend["sampler"]["engine"] == {"name": "torch", "max_batch_sequences": 32}
    assert backend["placement"] == {"kind": "local"} and backend["device"] == "cuda:1"
    backend = backend_of(recipe(**{"floe.backend": {"sampler": {"engine": {"max_num_seqs": 8}}}}))
    assert backend["sampler"]["engine"]["max_num_seqs"] == 8 and backend["sampler"]["engine"]["name"] == "vllm"


def test_a_floe_url_server_keeps_its_own_configuration_but_the_keys_are_still_checked():
    target = floe_target(recipe(**{"floe.url": "http://127.0.0.1:7000"}))
    assert target.backend is None and target.hardware.gpus == 8
    with pytest.raises(floe.InvalidInput) as info:
        floe_target(recipe(**{"floe.url": "http://127.0.0.1:7000", "actor_rollout_ref.rollout.name": "sglang"}))
    assert info.value.field == "actor_rollout_ref.rollout.name"


def test_floe_backend_device_cpu_is_how_a_verl_run_asks_for_the_cpu():
    # verl 0.9.1's main_ppo hands the trainer trainer.device=cuda on every machine (auto_set_device)
    target = floe_target(recipe(**{"floe.backend": {"device": "cpu"}}))
    assert target.hardware.gpus == 0 and target.backend is not None
    assert (target.backend["device"], target.backend["placement"]) == ("cpu", {"kind": "local"})
    assert "enable_sleep_mode" not in target.backend["sampler"]["engine"]
    floe.BackendConfig.model_validate(target.backend)
    with pytest.raises(floe.InvalidInput) as info:
        floe_target(recipe(**{"floe.backend": {"device": "tpu"}}))
    assert info.value.field == "floe.backend.device"


# -- LoRA (actor_rollout_ref.model.lora_*; verl_lora) -------------------------------------------------------------

M = "actor_rollout_ref.model"
CPU = {"trainer.device": "cpu"}
VERL_LORA = {**CPU, f"{M}.lora_rank": 64, f"{M}.lora_alpha": 32, f"{M}.target_modules": "all-linear",
             f"{M}.exclude_modules": None, f"{M}.lora_adapter_path": None, f"{M}.use_shm": True,
             "actor_rollout_ref.rollout.layered_summon": True, "actor_rollout_ref.rollout.load_format": "safetensors"}


def test_verl_lora_keys_become_floes_lora_table():
    assert "lora" not in backend_of(recipe(**CPU))  # lora_rank 0 (verl's default): every weight trains
    backend = backend_of(recipe(**VERL_LORA))
    assert backend["lora"] == {"rank": 64, "alpha": 32.0, "target_modules": "all-linear"}
    backend = backend_of(recipe(**{**VERL_LORA, f"{M}.target_modules": ["q_proj", "v_proj"]}))
    assert backend["lora"]["target_modules"] == ["q_proj", "v_proj"] and "exclude_modules" not in backend["lora"]
    # verl hands a string to peft, which matches it as a regular expression against whole module
    # paths: floe passes it on unchanged (a plain "down_proj" matches none: the backend refuses it)
    backend = backend_of(recipe(**{**VERL_LORA, f"{M}.exclude_modules": r".*\.down_proj"}))
    assert backend["lora"]["target_modules"] == "all-linear" and backend["lora"]["exclude_modules"] == r".*\.down_proj"
    backend = backend_of(recipe(**{**VERL_LORA, f"{M}.exclude_modules": ["down_proj"]}))
    assert backend["lora"]["exclude_modules"] == ["down_proj"]
    one_gpu = backend_of(recipe(**{**VERL_LORA, "trainer.device": "cuda", "trainer.n_gpus_per_node": 1,
                                   "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
                                   "actor_rollout_ref.rollout.free_cache_engine": False}))
    assert one_gpu["lora"]["rank"] == 64 and one_gpu["placement"] == {"kind": "local"}
    # 8 GPUs map to the Ray placement, whose FSDP2 ranks train the adapter too (backend.policy_sharded_lora)
    eight = backend_of(recipe(**{**VERL_LORA, "trainer.device": "cuda"}))
    assert eight["placement"]["kind"] == "ray" and eight["lora"]["rank"] == 64
    assert floe.BackendConfig.model_validate(eight).lora is not None  # the config takes it as it is


@pytest.mark.parametrize(("changes", "field"), [
    ({f"{M}.lora_rank": -1}, f"{M}.lora_rank"),
    ({f"{M}.lora_alpha": 0}, f"{M}.lora_alpha"),
    ({f"{M}.target_modules": ".*proj"}, f"{M}.target_modules"),
    ({f"{M}.exclude_modules": ["q_proj", "(v|k)_proj"]}, f"{M}.exclude_modules"),
    ({f"{M}.target_parameters": ["experts.weight"]}, f"{M}.target_parameters"),
    ({f"{M}.lora_adapter_path": "/adapters/a"}, f"{M}.lora_adapter_path"),
    ({f"{M}.lora": {"rank": 8}}, f"{M}.lora.rank"),
])
def test_verl_lora_settings_floe_cannot_honour_are_refused_by_their_verl_key(changes, field):
    with pytest.raises(floe.InvalidInput) as e:
        floe_target(recipe(**{**VERL_LORA, **changes}))
    assert e.value.field == field
