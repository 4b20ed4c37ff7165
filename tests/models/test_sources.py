"""The start-up checks in floe.models.loading (`check_model_source`, `check_device`): shared by
the Backend and the CLI's preflight; each refusal is one InvalidInput naming the field."""

from __future__ import annotations

import pytest
import torch

from floe.devices import check_device
from floe.errors import InvalidInput
from floe.models.loading import check_model_source


def test_a_model_directory_passes_and_anything_else_names_the_field(tiny_model, tmp_path, monkeypatch):
    check_model_source(str(tiny_model))  # a real model directory: no error
    with pytest.raises(InvalidInput) as e:
        check_model_source(str(tmp_path / "missing"))
    assert e.value.field == "model" and "no such model directory" in e.value.message
    with pytest.raises(InvalidInput) as e:
        check_model_source(str(tmp_path), "recipe.model.path")
    assert e.value.field == "recipe.model.path" and "has no config.json" in e.value.message
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InvalidInput) as e:
        check_model_source("floe-test/no-such-model")
    assert e.value.field == "model" and "not in the local Hugging Face cache and HF_HUB_OFFLINE is set" in e.value.message


def test_devices_this_torch_cannot_use_are_refused_with_the_fix():
    check_device("cpu")
    with pytest.raises(InvalidInput) as e:
        check_device("cuda:99", "recipe.backend.device", "--backend.device cpu")
    assert e.value.field == "recipe.backend.device" and e.value.message.startswith("'cuda:99'")
    if not torch.cuda.is_available():
        assert e.value.message.endswith("use --backend.device cpu, or install a CUDA build of torch")
    else:
        assert f"this machine has {torch.cuda.device_count()} CUDA device(s)" in e.value.message
    with pytest.raises(InvalidInput) as e:
        check_device("cuda:x")
    assert e.value.field == "device"
