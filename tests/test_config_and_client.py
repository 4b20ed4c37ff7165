"""Configs (TOML layers, overrides, strictness), connect() targets, the async client, the
reference zone, info()."""

from __future__ import annotations

import asyncio
import shutil

import pytest

import floe
from floe.config import BackendConfig, load_layers, parse_config, parse_override_value
from floe.models import make_tiny


def test_toml_layers_overlays_and_overrides(tmp_path):
    (tmp_path / "base.toml").write_text('model = "m"\n[optimizer]\nlr = 1e-4\nbetas = [0.9, 0.95]\n')
    (tmp_path / "child.toml").write_text('extends = "base.toml"\nseed = 3\n[optimizer]\nlr = 2e-4\n')
    (tmp_path / "over.toml").write_text('[compute]\ngradient_checkpointing = true\n')
    data = load_layers([tmp_path / "child.toml", tmp_path / "over.toml"], {"optimizer.weight_decay": 0.1, "dtype": "bfloat16"})
    cfg = parse_config(BackendConfig, data)
    assert cfg.seed == 3 and cfg.optimizer.lr == 2e-4 and cfg.optimizer.betas == (0.9, 0.95)
    assert cfg.optimizer.weight_decay == 0.1 and cfg.compute.gradient_checkpointing and cfg.dtype == "bfloat16"


def test_unknown_and_mistyped_keys_are_errors(tmp_path):
    with pytest.raises(floe.InvalidInput) as e:
        parse_config(BackendConfig, {"model": "m", "optimizer": {"learning_rate": 1}})
    assert e.value.field == "config.optimizer.learning_rate" and "unknown key" in e.value.message
    with pytest.raises(floe.InvalidInput) as e:
        parse_config(BackendConfig, {"model": "m", "optimizer": {"lr": "fast"}})
    assert e.value.field == "config.optimizer.lr"
    with pytest.raises(floe.InvalidInput) as e:
        parse_config(BackendConfig, {})
    assert e.value.field == "config.model"
    (tmp_path / "bad.toml").write_text("model = \n")
    with pytest.raises(floe.InvalidInput, match="not valid TOML"):
        load_layers([tmp_path / "bad.toml"])


def test_override_values_parse_like_toml():
    assert parse_override_value("3") == 3 and parse_override_value("1e-3") == 1e-3
    assert parse_override_value("true") is True and parse_override_value("[1, 2]") == [1, 2]
    assert parse_override_value("hello") == "hello" and parse_override_value('"a b"') == "a b"


def test_async_client_runs_calls_in_order(tiny_model, tmp_path):
    async def run() -> list:
        c = floe.connect_async(floe.BackendConfig(model=str(tiny_model), state_dir=str(tmp_path), optimizer={"lr": 1e-2}))
        tok = c.tokenizer()
        batch = floe.Batch([floe.Group(tok.encode("a"), [floe.Sample(tok.encode("bc"))])])
        # Fire everything at once; execution must still follow submission order.
        futures = [
            asyncio.ensure_future(c.forward_backward(batch, "cross_entropy")),
            asyncio.ensure_future(c.optim_step()),
            asyncio.ensure_future(c.forward_backward(batch, "cross_entropy")),
            asyncio.ensure_future(c.optim_step()),
            asyncio.ensure_future(c.sync_weights()),
            asyncio.ensure_future(c.info()),
        ]
        out = await asyncio.gather(*futures)
        await c.close()
        return out

    fb1, st1, fb2, st2, sync, info = asyncio.run(run())
    assert (st1.step, st2.step, sync.version, info.step, info.sampler_version) == (1, 2, 1, 2, 1)
    assert fb2.metrics["loss"] < fb1.metrics["loss"]


def test_reference_zone_is_frozen_initial_model(make_client):
    client = make_client(optimizer={"lr": 1e-2})
    tok = client.tokenizer()
    batch = floe.Batch([floe.Group(tok.encode("ref"), [floe.Sample(tok.encode("erence"))])])
    ref_before = client.forward(batch, zone="reference").logprobs
    assert ref_before == client.forward(batch, zone="policy").logprobs
    client.forward_backward(batch, "cross_entropy")
    client.optim_step()
    assert client.forward(batch, zone="reference").logprobs == ref_before
    assert client.forward(batch, zone="policy").logprobs != ref_before
    ent = client.forward(batch, zone="reference", with_entropy=True)
    assert ent.entropy is not None and all(e > 0 for e in ent.entropy[0][0])


def test_reference_from_checkpoint_and_disabled(make_client, tiny_model, tmp_path):
    other = make_tiny(tmp_path / "other", hidden_size=64, num_hidden_layers=2, seed=5)
    client = make_client(reference={"checkpoint": str(other)})
    tok = client.tokenizer()
    batch = floe.Batch([floe.Group(tok.encode("x"), [floe.Sample(tok.encode("yz"))])])
    assert client.forward(batch, zone="reference").logprobs != client.forward(batch).logprobs
    off = make_client(reference={"enabled": False})
    assert "reference" not in off.info().zones
    with pytest.raises(floe.InvalidInput) as e:
        off.forward(batch, zone="reference")
    assert e.value.field == "zone"


def test_info_reports_model_and_versions(make_client, tiny_model):
    info = make_client().info()
    assert info.model == str(tiny_model) and info.zones == ["policy", "sampler", "reference"]
    assert (info.step, info.policy_version, info.sampler_version) == (0, 0, 0)
    assert info.vocab_size == 105 and info.dtype == "float32" and "ppo" in info.capabilities["losses"]


def test_groups_list_is_accepted_as_batch(make_client):
    client = make_client()
    tok = client.tokenizer()
    groups = [floe.Group(tok.encode("a"), [floe.Sample(tok.encode("b"))])]
    assert client.forward(groups).logprobs == client.forward(floe.Batch(groups)).logprobs


@pytest.mark.parametrize("target", ["localhost:7000", "127.0.0.1:7000", "my-host.lan:80/floe", "[::1]:7000"])
def test_an_address_without_scheme_is_refused(target, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no such path here
    for connect in (floe.connect, floe.connect_async):
        with pytest.raises(floe.InvalidInput) as e:
            connect(target)
        assert e.value.field == "target" and f"needs a scheme: http://{target}" in e.value.message
    with pytest.raises(floe.InvalidInput, match="scheme 'grpc' is not supported"):
        floe.connect("grpc://localhost:7000")


def test_an_existing_path_that_looks_like_an_address_is_a_model(tiny_model, tmp_path, monkeypatch):
    shutil.copytree(tiny_model, tmp_path / "tiny:7000")
    monkeypatch.chdir(tmp_path)
    with floe.connect("tiny:7000") as client:
        assert client.info().model == "tiny:7000"


def test_constructing_a_config_with_bad_input_is_one_invalid_input():
    cases = [
        ({"model": "m", "optimiser": {"lr": 1e-3}}, "BackendConfig.optimiser", "unknown key"),
        ({"model": "m", "optimizer": {"lr": -1}}, "BackendConfig.optimizer.lr", "greater than 0"),
        ({"model": "m", "dtype": "float16"}, "BackendConfig.dtype", 'use dtype = "bfloat16"'),
        ({"model": "m", "compute": {"max_tokens_per_microbatch": 0}},
         "BackendConfig.compute.max_tokens_per_microbatch", "greater than 0"),
        ({"model": "m", "sampler": {"engine": {"name": "torch", "max_batch_sequences": 0}}},
         "BackendConfig.sampler.engine.max_batch_sequences", "greater than 0"),
        ({}, "BackendConfig.model", "missing"),
    ]
    for kwargs, field, words in cases:
        with pytest.raises(floe.InvalidInput) as e:
            BackendConfig(**kwargs)
        assert isinstance(e.value, ValueError)
        assert e.value.field == field and words in e.value.message, (kwargs, str(e.value))
        assert "\n" not in str(e.value) and "errors.pydantic.dev" not in str(e.value)
    with pytest.raises(floe.InvalidInput) as e:
        floe.OptimizerConfig(lr=1e-3, schedule="cosine")  # a model validator's error, on a nested config class
    assert e.value.field == "OptimizerConfig" and "needs total_steps" in e.value.message
    # The direct-construction error names the class; parse_config still names the key path under `where`.
    with pytest.raises(floe.InvalidInput) as e:
        parse_config(BackendConfig, {"model": "m", "optimiser": {}}, "backend")
    assert e.value.field == "backend.optimiser"
    good = BackendConfig(model="m", optimizer={"lr": 1e-3}, sampler={"engine": {"max_batch_sequences": 4}})
    assert good.optimizer.lr == 1e-3 and good.sampler.engine.max_batch_sequences == 4
    assert good == BackendConfig.model_validate(good.model_dump())


def test_assigning_a_bad_value_is_an_invalid_input_and_changes_nothing():
    cfg = BackendConfig(model="m", optimizer={"lr": 1e-3})
    with pytest.raises(floe.InvalidInput) as e:
        cfg.optimizer.lr = -1.0
    assert e.value.field == "OptimizerConfig.lr" and cfg.optimizer.lr == 1e-3
    with pytest.raises(floe.InvalidInput) as e:
        cfg.seed = "x"
    assert e.value.field == "BackendConfig.seed" and cfg.seed == 0
    cfg.seed = 7
    assert cfg.seed == 7


def test_connect_checks_model_and_device_before_loading_anything(tiny_model, tmp_path):
    import torch

    threads = torch.get_num_threads()
    with pytest.raises(floe.InvalidInput) as e:
        floe.connect(BackendConfig(model=str(tmp_path / "nonexistent"), num_threads=threads + 1))
    assert e.value.field == "model" and e.value.message.startswith("no such model directory: ")
    (tmp_path / "empty").mkdir()
    with pytest.raises(floe.InvalidInput) as e:
        floe.connect(BackendConfig(model=str(tmp_path / "empty")))
    assert e.value.field == "model" and "has no config.json" in e.value.message
    with pytest.raises(floe.InvalidInput) as e:
        floe.connect(BackendConfig(model=str(tiny_model), reference={"checkpoint": str(tmp_path / "gone")}))
    assert e.value.field == "reference.checkpoint" and "no such model directory" in e.value.message
    # CUDA device 99 exists nowhere: a CPU-only torch says so, a CUDA torch counts its devices.
    with pytest.raises(floe.InvalidInput) as e:
        floe.connect(BackendConfig(model=str(tiny_model), device="cuda:99", num_threads=threads + 1))
    assert e.value.field == "device" and e.value.message.startswith("'cuda:99'")
    if not torch.cuda.is_available():
        assert "is not available: torch" in e.value.message and "device='cpu'" in e.value.message
    assert torch.get_num_threads() == threads  # refused before the backend touched torch's settings
