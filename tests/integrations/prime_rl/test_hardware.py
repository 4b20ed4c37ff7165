"""prime-rl's GPU split and [inference.vllm] as floe serve's [backend] (hardware.prime_hardware).

The stock recipes' tables are prime-rl's own files (the prime-rl suite, `stock_*`); the rest
runs in the core suite on tables written here. Every mapped backend is validated by floe's own
BackendConfig (no GPU needed to validate a GPU placement), and every refusal names its key.
"""

from __future__ import annotations

import pytest
import tomllib

from floe.config import BackendConfig
from floe.errors import InvalidInput
from floe.integrations.prime_rl.hardware import SHARED_GPU_MEMORY, prime_hardware
from floe.integrations.prime_rl.lora import parse_lora, server_lora


def backend_of(raw: dict, gpus: int, overlay: dict | None = None) -> tuple[BackendConfig, list[str]]:
    hw = prime_hardware(raw, gpus, overlay or {})
    return BackendConfig.model_validate({"model": "m", **hw.backend, **(overlay or {})}), hw.notes


def test_no_gpu_and_no_split_trains_on_the_cpu_with_floes_defaults() -> None:
    config, notes = backend_of({"inference": {}, "trainer": {"model": {"ac": {"freq": 1}}}}, 0)
    assert config.device == "cpu" and config.dtype == "float32" and config.placement.kind == "local"
    assert config.sampler.engine.name == "torch" and config.compute.gradient_checkpointing and notes == []
    config, _ = backend_of({"trainer": {"model": {"ac": None}}}, 0)
    assert not config.compute.gradient_checkpointing  # `ac` unset = prime-rl's default (on); null = off


def test_a_gpu_split_becomes_policy_ranks_and_vllm_replicas() -> None:
    raw = {"deployment": {"num_train_gpus": 2, "num_infer_gpus": 4},
           "inference": {"vllm": {"tensor_parallel_size": 2, "max_model_len": 4096, "gpu_memory_utilization": 0.8,
                                  "dtype": "float16", "enforce_eager": True}}}
    config, notes = backend_of(raw, 8)
    assert config.device == "cuda" and config.dtype == "bfloat16" and notes == []
    p = config.placement
    assert p.kind == "ray" and not p.colocate and p.reference.colocate_with_policy
    assert (p.policy.workers, p.policy.gpus, p.sampler.workers, p.sampler.gpus) == (2, 1, 2, 2)
    e = config.sampler.engine
    assert (e.name, e.tensor_parallel_size, e.max_model_len, e.gpu_memory_utilization, e.dtype, e.enforce_eager) == (
        "vllm", 2, 4096, 0.8, "float16", True)  # float16 samples; training stays bf16


def test_prime_rls_default_split_on_one_gpu_shares_it() -> None:
    config, notes = backend_of({}, 1)
    assert config.placement.kind == "local" and config.device == "cuda"
    assert config.sampler.engine.name == "vllm" and config.sampler.engine.gpu_memory_utilization == SHARED_GPU_MEMORY
    assert any("gpu_memory_utilization" in n for n in notes)
    config, _ = backend_of({}, 2)  # the default split itself: 1 + 1
    assert config.placement.kind == "ray" and config.placement.sampler.workers == 1


@pytest.mark.parametrize(("raw", "gpus", "field"), [
    ({"deployment": {"num_train_gpus": 2, "num_infer_gpus": 6}}, 0, "deployment.num_train_gpus"),
    ({"deployment": {"num_train_gpus": 2, "num_infer_gpus": 6}}, 4, "deployment.num_train_gpus"),
    ({}, 0 + 0, None),  # no split, no GPU: the CPU (not refused)
    ({"deployment": {"num_infer_gpus": 3}, "inference": {"vllm": {"tensor_parallel_size": 2}}}, 8,
     "inference.vllm.tensor_parallel_size"),
    ({"deployment": {"num_infer_gpus": 4}, "inference": {"vllm": {"data_parallel_size": 3}}}, 8,
     "inference.vllm.data_parallel_size"),
    ({"inference": {"vllm": {"dtype": "int8"}}}, 2, "inference.vllm.dtype"),
    ({"inference": {"router": {"type": "vllm-router"}}}, 0, "inference.router"),
    ({"inference": {"vllm": {"quantization": "fp8"}}}, 0, "inference.vllm.quantization"),
    ({"inference": {"vllm": {"enable_lora": True}}}, 0, "inference.vllm.enable_lora"),
    ({"trainer": {"model": {"optimization_dtype": "bfloat16"}}}, 0, "trainer.model.optimization_dtype"),
    ({"deployment": {"num_train_gpus": 0}}, 8, "deployment.num_train_gpus"),
])
def test_refusals_name_the_key(raw: dict, gpus: int, field: str | None) -> None:
    if field is None:
        assert prime_hardware(raw, gpus, {}).gpus == 0
        return
    with pytest.raises(InvalidInput) as err:
        prime_hardware(raw, gpus, {})
    assert err.value.field == field


def test_the_overlay_places_floe_serve_and_the_gpu_keys_are_listed() -> None:
    raw = {"deployment": {"num_train_gpus": 2, "num_infer_gpus": 6},
           "inference": {"vllm": {"data_parallel_size": 6, "tool_call_parser": "hermes"}}}
    config, notes = backend_of(raw, 0, {"device": "cpu"})
    assert config.device == "cpu" and config.placement.kind == "local"
    listed = " ".join(notes)
    for key in ("inference.vllm.data_parallel_size", "deployment.num_train_gpus", "deployment.num_infer_gpus",
                "inference.vllm.tool_call_parser"):
        assert key in listed, (key, notes)


STOCK = {  # recipe -> (GPUs of a machine with enough, policy ranks, sampler replicas, engine keys)
    "reverse-text": (2, 1, 1, {}),
    "alphabet-sort": (2, 1, 1, {}),
    "hendrycks-sanity": (8, 4, 4, {"max_model_len": 8192}),
    "wiki-search": (8, 2, 6, {}),
    "wordle": (8, 2, 6, {}),
}


@pytest.mark.prime_rl
@pytest.mark.parametrize("recipe", sorted(STOCK))
def test_stock_recipes_map_onto_a_gpu_box_and_are_refused_cleanly_on_the_cpu(recipe: str) -> None:
    from tests.integrations.prime_rl.test_prime_rl_schedule import prime_rl_root  # noqa: PLC0415 - prime-rl's env

    raw = tomllib.loads((prime_rl_root() / "examples/basic" / recipe / "rl.toml").read_text())
    gpus, ranks, replicas, engine = STOCK[recipe]
    hw = prime_hardware(raw, gpus, {})
    lora = parse_lora(((raw.get("trainer") or {}).get("model") or {}).get("lora"))
    config = BackendConfig.model_validate({"model": "m", **server_lora(lora, hw.backend)})  # as the launcher does
    assert (config.lora is None) == (lora is None)  # LoRA recipes (alphabet-sort, wiki-search) train it on the ranks
    assert hw.gpus == gpus and config.placement.kind == "ray" and config.device == "cuda"
    assert (config.placement.policy.workers, config.placement.sampler.workers) == (ranks, replicas)
    assert config.sampler.engine.name == "vllm"
    assert {k: getattr(config.sampler.engine, k) for k in engine} == engine
    if "deployment" in raw:  # a GPU split on this CPU machine: refused before anything starts
        with pytest.raises(InvalidInput) as err:
            prime_hardware(raw, 0, {})
        assert err.value.field == "deployment.num_train_gpus"
        assert prime_hardware(raw, 0, {"device": "cpu"}).gpus == 0  # ... unless the overlay places floe serve
    else:
        assert prime_hardware(raw, 0, {}).gpus == 0
