"""SkyRL's placement, precision, memory and engine keys -> the embedded backend's BackendConfig
(floe.integrations.skyrl.hardware, pure; core suite, no SkyRL import). Each key's effect, every
refusal by its SkyRL name, and that each result is a valid floe config. SkyRL's own config
dataclasses go through it in the SkyRL environment (test_skyrl_run.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

import floe
from floe.integrations.hardware import with_overrides
from floe.integrations.skyrl.hardware import skyrl_hardware

# SkyRL 0.4.0's defaults (asdict(SkyRLTrainConfig()).trainer / .generator) for the keys hardware.py reads.
TRAINER: dict[str, Any] = {
    "strategy": "fsdp", "bf16": True, "gradient_checkpointing": True, "flash_attn": True,
    "max_tokens_per_microbatch": -1, "logprobs_chunk_size": 1024,
    "placement": {"colocate_all": True, "colocate_policy_ref": True, "policy_num_nodes": 1,
                  "policy_num_gpus_per_node": 1, "ref_num_nodes": 1, "ref_num_gpus_per_node": 1},
    "policy": {"sequence_parallel_size": 1,
               "fsdp_config": {"cpu_offload": False, "reshard_after_forward": True, "fsdp_size": -1,
                               "mixed_precision": None}},
    "ref": {"sequence_parallel_size": 1,
            "fsdp_config": {"cpu_offload": False, "reshard_after_forward": True, "fsdp_size": -1,
                            "mixed_precision": None}},
}
GENERATOR: dict[str, Any] = {"inference_engine": {
    "model_dtype": "bfloat16", "fp8_weight_sync_mode": None, "run_engines_locally": True, "num_engines": 1,
    "backend": "vllm", "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "expert_parallel_size": 1,
    "data_parallel_size": 1, "enable_prefix_caching": True, "enable_chunked_prefill": True,
    "enable_return_routed_experts": False, "max_num_batched_tokens": 8192, "enforce_eager": False,
    "gpu_memory_utilization": 0.8, "max_num_seqs": 1024, "speculative_config": None,
    "external_proxy_url": None, "external_server_urls": None, "enable_pd": False,
}}


def sections(**changes: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(trainer, generator) with dotted changes, e.g. sections(**{"trainer.bf16": False})."""
    cfg = {"trainer": copy.deepcopy(TRAINER), "generator": copy.deepcopy(GENERATOR)}
    for dotted, value in changes.items():
        node = cfg
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return cfg["trainer"], cfg["generator"]


def backend_of(device: str | None = None, **changes: Any) -> dict[str, Any]:
    backend = {"model": "m", **skyrl_hardware(*sections(**changes), device=device).backend}
    floe.BackendConfig.model_validate(backend)
    return backend


def test_skyrls_defaults_train_on_the_gpu_in_bf16_with_vllm_taking_turns():
    backend = backend_of()
    assert (backend["device"], backend["dtype"], backend["attn_implementation"]) == ("cuda", "bfloat16",
                                                                                    "flash_attention_2")
    # colocate_all (SkyRL's default): policy and sampler take turns on the one GPU
    assert backend["placement"]["kind"] == "ray" and backend["placement"]["colocate"] is True
    assert backend["placement"]["policy"]["workers"] == 1
    assert backend["sampler"]["engine"] == {
        "name": "vllm", "gpu_memory_utilization": 0.8, "enforce_eager": False, "max_num_seqs": 1024,
        "enable_prefix_caching": True, "max_num_batched_tokens": 8192, "enable_chunked_prefill": True,
        "enable_sleep_mode": True}
    assert backend["compute"] == {"gradient_checkpointing": True, "logprob_chunk_tokens": 1024}
    assert skyrl_hardware(*sections()).gpus == 1


def test_one_gpu_not_colocated_keeps_every_zone_resident():
    backend = backend_of(**{"trainer.placement.colocate_all": False})
    assert backend["placement"] == {"kind": "local"} and "enable_sleep_mode" not in backend["sampler"]["engine"]


@pytest.mark.parametrize("key", ["trainer.policy.fsdp_config.cpu_offload", "trainer.ref.fsdp_config.cpu_offload"])
def test_cpu_offload_takes_turns(key):
    backend = backend_of(**{"trainer.placement.colocate_all": False, key: True})
    assert backend["placement"]["kind"] == "ray"


def test_floe_backend_device_cpu_is_a_local_cpu_backend():
    backend = backend_of(device="cpu")
    assert (backend["device"], backend["placement"], backend["attn_implementation"]) == ("cpu", {"kind": "local"}, "auto")
    assert "enable_chunked_prefill" not in backend["sampler"]["engine"]
    assert skyrl_hardware(*sections(), device="cpu").gpus == 0


@pytest.mark.parametrize(
    ("changes", "path", "value"),
    [
        ({"trainer.bf16": False, "generator.inference_engine.model_dtype": "float32"}, "dtype", "float32"),
        ({"trainer.bf16": False}, "sampler.engine.dtype", "bfloat16"),
        ({"generator.inference_engine.model_dtype": "float16"}, "sampler.engine.dtype", "float16"),  # sampling only
        ({"trainer.policy.fsdp_config.mixed_precision": {"param_dtype": "fp32", "reduce_dtype": "fp32"},
          "generator.inference_engine.model_dtype": "fp32"}, "dtype", "float32"),
        ({"trainer.gradient_checkpointing": False}, "compute.gradient_checkpointing", False),
        ({"trainer.flash_attn": False}, "attn_implementation", "auto"),
        ({"trainer.max_tokens_per_microbatch": 4096}, "compute.max_tokens_per_microbatch", 4096),
        ({"trainer.logprobs_chunk_size": 256}, "compute.logprob_chunk_tokens", 256),
        ({"generator.inference_engine.gpu_memory_utilization": 0.5}, "sampler.engine.gpu_memory_utilization", 0.5),
        ({"generator.inference_engine.enforce_eager": True}, "sampler.engine.enforce_eager", True),
        ({"generator.inference_engine.max_num_seqs": 32}, "sampler.engine.max_num_seqs", 32),
        ({"generator.inference_engine.enable_prefix_caching": False}, "sampler.engine.enable_prefix_caching", False),
        ({"generator.inference_engine.enable_chunked_prefill": False}, "sampler.engine.enable_chunked_prefill", False),
        ({"trainer.placement.policy_num_gpus_per_node": 4, "trainer.placement.policy_num_nodes": 2,
          "generator.inference_engine.num_engines": 4, "generator.inference_engine.tensor_parallel_size": 2},
         "placement.sampler.workers", 8),
    ],
)
def test_each_key_takes_effect(changes, path, value):
    node: Any = backend_of(**changes)
    for part in path.split("."):
        node = node[part]
    assert node == value


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"trainer.strategy": "megatron"}, "trainer.strategy"),
        ({"trainer.placement.colocate_policy_ref": False}, "trainer.placement.colocate_policy_ref"),
        ({"trainer.placement.policy_num_gpus_per_node": 0}, "trainer.placement.policy_num_gpus_per_node"),
        ({"trainer.policy.sequence_parallel_size": 2}, "trainer.policy.sequence_parallel_size"),
        ({"trainer.ref.fsdp_config.fsdp_size": 2}, "trainer.ref.fsdp_config.fsdp_size"),
        ({"trainer.policy.fsdp_config.mixed_precision": {"param_dtype": "fp16"}},
         "trainer.policy.fsdp_config.mixed_precision.param_dtype"),
        ({"trainer.policy.fsdp_config.mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "bf16"}},
         "trainer.policy.fsdp_config.mixed_precision.reduce_dtype"),
        ({"generator.inference_engine.backend": "sglang"}, "generator.inference_engine.backend"),
        ({"generator.inference_engine.num_engines": 3, "trainer.placement.policy_num_gpus_per_node": 4},
         "generator.inference_engine.num_engines"),
        ({"generator.inference_engine.pipeline_parallel_size": 2}, "generator.inference_engine.pipeline_parallel_size"),
        ({"generator.inference_engine.fp8_weight_sync_mode": "fp8"}, "generator.inference_engine.fp8_weight_sync_mode"),
        ({"generator.inference_engine.speculative_config": {"method": "eagle"}},
         "generator.inference_engine.speculative_config"),
        ({"generator.inference_engine.external_server_urls": ["http://x"]},
         "generator.inference_engine.external_server_urls"),
        ({"generator.inference_engine.run_engines_locally": False}, "generator.inference_engine.run_engines_locally"),
        ({"generator.inference_engine.enable_pd": True}, "generator.inference_engine.enable_pd"),
    ],
)
def test_what_floe_cannot_honour_is_refused_by_its_skyrl_key(changes, field):
    with pytest.raises(floe.InvalidInput) as info:
        skyrl_hardware(*sections(**changes))
    assert info.value.field == field


def test_floe_backend_applies_last_and_another_engine_replaces_the_table():
    backend = {"model": "m", **skyrl_hardware(*sections()).backend}
    merged = with_overrides(backend, {"sampler": {"engine": {"name": "torch"}}, "placement": {"kind": "local"},
                                      "compute": {"prefix_dedup": "on"}}, "floe.backend")
    assert merged["sampler"] == {"engine": {"name": "torch"}} and merged["placement"] == {"kind": "local"}
    assert merged["compute"] == {"gradient_checkpointing": True, "logprob_chunk_tokens": 1024, "prefix_dedup": "on"}
    with pytest.raises(floe.InvalidInput) as info:
        with_overrides(backend, {"model": "other"}, "floe.backend")
    assert info.value.field == "floe.backend.model"
    with pytest.raises(floe.InvalidInput) as info:
        skyrl_hardware(*sections(), device="tpu")
    assert info.value.field == "floe.backend.device"


# -- LoRA (trainer.policy.model.lora; skyrl_lora) -----------------------------------------------------------------

L = "trainer.policy.model.lora"
# SkyRL 0.4.0's SkyRLLoraConfig defaults with a rank
SKYRL_LORA = {"rank": 32, "alpha": 32, "dropout": 0.0, "lora_sync_path": "/tmp/skyrl_lora_sync", "sync_mode": "disk",
              "target_modules": "all-linear", "exclude_modules": None, "init_method": "kaiming",
              "share_expert_adapters": True, "max_loras": 1, "max_cpu_loras": None}


def _lora(**changes: Any) -> dict[str, Any]:
    return {**SKYRL_LORA, **changes}


def test_skyrl_lora_keys_become_floes_lora_table():
    assert "lora" not in backend_of("cpu", **{L: _lora(rank=0)})
    assert backend_of("cpu", **{L: _lora()})["lora"] == {"rank": 32, "alpha": 32.0, "target_modules": "all-linear",
                                                         "init": "kaiming"}
    # SkyRL's exclude_modules is a string, which peft matches as a regular expression against whole
    # module paths: floe passes it on unchanged
    lora = backend_of("cpu", **{L: _lora(exclude_modules=r".*\.o_proj", init_method="gaussian")})["lora"]
    assert lora == {"rank": 32, "alpha": 32.0, "target_modules": "all-linear", "exclude_modules": r".*\.o_proj",
                    "init": "gaussian"}
    assert backend_of("cpu", **{L: _lora(target_modules=["q_proj", "o_proj"])})["lora"]["target_modules"] == ["q_proj", "o_proj"]
    one_gpu = backend_of(**{L: _lora(), "trainer.placement.colocate_all": False})
    assert one_gpu["lora"]["rank"] == 32 and one_gpu["placement"] == {"kind": "local"}


@pytest.mark.parametrize(("changes", "key"), [
    ({"alpha": -1}, "alpha"),
    ({"dropout": 0.1}, "dropout"),
    ({"init_method": "pissa"}, "init_method"),
    ({"target_modules": "q_proj|v_proj"}, "target_modules"),
    ({"lora_sync_path": "/mnt/lora"}, "lora_sync_path"),
    ({"sync_mode": "memory"}, "sync_mode"),
    ({"max_loras": 4}, "max_loras"),
])
def test_skyrl_lora_settings_floe_cannot_honour_are_refused_by_their_skyrl_key(changes, key):
    with pytest.raises(floe.InvalidInput) as e:
        skyrl_hardware(*sections(**{L: _lora(**changes)}), device="cpu")
    assert e.value.field == f"{L}.{key}"


def test_skyrl_lora_maps_to_the_ray_placement_too():
    # SkyRL's default (one GPU shared by training and generation) is the Ray placement, colocated:
    # its FSDP2 ranks train the adapter (backend.policy_sharded_lora)
    backend = backend_of(**{L: _lora()})
    assert backend["placement"]["kind"] == "ray" and backend["placement"]["colocate"] is True
    assert backend["lora"]["rank"] == 32
    assert floe.BackendConfig.model_validate(backend).lora is not None
