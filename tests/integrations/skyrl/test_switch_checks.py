"""What the switch's `main` checks before anything starts, on SkyRL's own parsed config (in
process, SkyRL's environment: scripts/ci/skyrl.sh): sampling keys floe cannot honour, keys that
would change the model, the engine packages a recipe needs, SkyRL's metrics scraper of its own
engines, and the config SkyRL's `initialize_ray` probes GPUs with. The real runs of these paths
are in test_skyrl_run.py (a stock recipe's GPU counts on the CPU, refused and with
floe.backend.device=cpu)."""

from __future__ import annotations

import sys

import pytest

from floe.errors import InvalidInput
from tests.integrations.skyrl.assets import STOCK_GPUS, make_parquet

pytestmark = pytest.mark.skyrl


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("switch")
    train, val = make_parquet(root / "train.parquet", rows=8, seed=0), make_parquet(root / "val.parquet", rows=8, seed=1)
    return [f"data.train_data=['{train}']", f"data.val_data=['{val}']", f"trainer.policy.model.path={root / 'model'}",
            "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=2", "trainer.micro_train_batch_size_per_gpu=2",
            "trainer.micro_forward_batch_size_per_gpu=2", "generator.n_samples_per_prompt=2",
            f"trainer.ckpt_path={root / 'ckpt'}", f"trainer.export_path={root / 'export'}", "trainer.logger=console"]


def parse(base: list[str], *keys: str):
    from floe.integrations.skyrl.entrypoint import parse  # noqa: PLC0415 - SkyRL's environment only

    return parse([*base, *keys])


@pytest.mark.parametrize(("key", "field"), [
    ("generator.sampling_params.min_p=0.05", "generator.sampling_params.min_p"),
    ("generator.eval_sampling_params.min_p=0.05", "generator.eval_sampling_params.min_p"),
    ("generator.sampling_params.repetition_penalty=1.3", "generator.sampling_params.repetition_penalty"),
    ("generator.eval_sampling_params.repetition_penalty=0.9", "generator.eval_sampling_params.repetition_penalty"),
    ("generator.sampling_params.additional_kwargs.presence_penalty=0.5",
     "generator.sampling_params.additional_kwargs.presence_penalty"),
    ("generator.eval_sampling_params.additional_kwargs.min_tokens=4",
     "generator.eval_sampling_params.additional_kwargs.min_tokens"),
    ("trainer.policy.model_config_kwargs.attention_dropout=0.5", "trainer.policy.model_config_kwargs"),
    ("trainer.ref.model_config_kwargs.rope_theta=5e5", "trainer.ref.model_config_kwargs"),
    ("generator.inference_engine.engine_init_kwargs.max_model_len=64", "generator.inference_engine.engine_init_kwargs"),
    ("generator.inference_engine.delta_weight_sync.sync_dir=/tmp/d", "generator.inference_engine.delta_weight_sync"),
])
def test_keys_floe_cannot_honour_are_refused_before_anything_starts(base, key, field):
    with pytest.raises(InvalidInput) as err:
        parse(base, key)
    assert err.value.field == field, err.value


def test_honoured_sampling_keys_pass(base):
    cfg = parse(base, "generator.sampling_params.top_k=20", "generator.eval_sampling_params.top_p=0.7",
                "generator.sampling_params.temperature=0.8", "generator.sampling_params.additional_kwargs.seed=3")
    assert cfg.generator.sampling_params.top_k == 20


def test_skyrls_scraper_of_its_own_engines_is_off(base):
    from skyrl.train.config import SkyRLTrainConfig  # noqa: PLC0415

    assert SkyRLTrainConfig().generator.inference_engine.enable_ray_prometheus_stats is True  # SkyRL's default
    assert parse(base).generator.inference_engine.enable_ray_prometheus_stats is False


def test_initialize_ray_probes_gpus_only_for_a_backend_on_this_clusters_gpus(base):
    from floe.integrations.skyrl.entrypoint import embedded_backend, skyrl_ray_config  # noqa: PLC0415

    cpu = parse(base, *STOCK_GPUS, "floe.backend.device=cpu")
    probed = skyrl_ray_config(cpu, embedded_backend(cpu)[0])
    placement = probed.trainer.placement
    assert (placement.policy_num_gpus_per_node, placement.ref_num_gpus_per_node, placement.critic_num_gpus_per_node,
            probed.generator.inference_engine.tensor_parallel_size) == (1, 1, 1, 1)
    assert cpu.trainer.placement.policy_num_gpus_per_node == 4  # the run's own config is unchanged
    assert skyrl_ray_config(cpu, None).trainer.placement.policy_num_gpus_per_node == 1  # floe.url: the server's GPUs
    gpu = parse(base, *STOCK_GPUS)
    assert skyrl_ray_config(gpu, embedded_backend(gpu)[0]) is gpu  # SkyRL's probe runs as SkyRL runs it


def test_a_missing_engine_or_attention_package_is_named_by_the_recipes_key(base, tmp_path, monkeypatch):
    from floe.integrations.hardware import check_installed  # noqa: PLC0415
    from floe.integrations.skyrl.entrypoint import embedded_backend  # noqa: PLC0415

    assert "vllm" not in sys.modules and "flash_attn" not in sys.modules  # neither is in SkyRL's environment here
    backend, _ = embedded_backend(parse(base))  # SkyRL's defaults: vLLM, flash attention on the GPU
    keys = ("generator.inference_engine.backend", "trainer.flash_attn")
    with pytest.raises(InvalidInput) as err:
        check_installed(backend, *keys)
    assert err.value.field == "generator.inference_engine.backend"
    assert "floe.backend.sampler.engine.name=torch" in err.value.message
    torch_engine, _ = embedded_backend(parse(base, "floe.backend.sampler.engine.name=torch"))
    with pytest.raises(InvalidInput) as err:
        check_installed(torch_engine, *keys)
    assert err.value.field == "trainer.flash_attn" and "pip install flash-attn" in err.value.message
    check_installed(embedded_backend(parse(base, "floe.backend.sampler.engine.name=torch",
                                           "trainer.flash_attn=false"))[0], *keys)
    check_installed(embedded_backend(parse(base, "floe.backend.device=cpu", "floe.backend.sampler.engine.name=torch"))[0],
                    *keys)  # the CPU uses no flash attention
    # with a flash_attn package importable the recipe's flash attention is taken as it is
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_installed(torch_engine, *keys)
    assert torch_engine["attn_implementation"] == "flash_attention_2"
