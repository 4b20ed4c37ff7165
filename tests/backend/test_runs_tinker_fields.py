"""Tinker fields served by floe.backend.runs, without any SDK: a zero learning rate is a step
that moves no weight, a refused AdamParams changes nothing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import floe
from floe.backend.runs import AdamStep, RunManager
from floe.errors import InvalidInput
from floe.models import load_tokenizer
from floe.models.lora import LoraSpec


@pytest.fixture
def runs(tiny_model: Path, tmp_path: Path) -> RunManager:
    cfg = floe.BackendConfig(model=str(tiny_model), state_dir=str(tmp_path / "states"), seed=0)
    return RunManager(cfg, load_tokenizer(str(tiny_model)), tmp_path / "states" / "tinker")


def _batch() -> floe.Batch:
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (7, 5)]
    return floe.Batch([floe.Group(s[:1], [floe.Sample(tokens=s[1:], weights=[1.0] * (len(s) - 1))]) for s in seqs])


def _moments(run) -> list[torch.Tensor]:
    return [run.zone.optimizer.state[p]["exp_avg"].clone() for p in run.zone.optimizer.param_groups[0]["params"]]


def test_a_zero_learning_rate_is_a_step_that_moves_no_weight(runs: RunManager) -> None:
    run = runs.create_run("a", LoraSpec(rank=4, seed=1))
    runs.forward_backward("a", _batch(), "cross_entropy", {"aggregation": "sum"})
    runs.optim_step("a", AdamStep(learning_rate=1e-2))  # B != 0 from here: a step would move every weight
    before, moments = [p.detach().clone() for p in run.zone.params], _moments(run)
    runs.forward_backward("a", _batch(), "cross_entropy", {"aggregation": "sum"})
    result = runs.optim_step("a", AdamStep(learning_rate=0.0, weight_decay=0.1))
    assert (result.lr, result.step, run.version) == (0.0, 2, 2)
    assert all(torch.equal(a, p) for a, p in zip(before, run.zone.params))  # bit for bit
    assert not all(torch.equal(a, b) for a, b in zip(moments, _moments(run)))  # the moments advanced
    runs.forward_backward("a", _batch(), "cross_entropy", {"aggregation": "sum"})
    runs.optim_step("a", AdamStep(learning_rate=1e-2))
    assert not all(torch.equal(a, p) for a, p in zip(before, run.zone.params))


@pytest.mark.parametrize("lr", [math.inf, -math.inf, math.nan, 1e308, 2.0, -1e-4])
def test_a_refused_learning_rate_changes_nothing(runs: RunManager, lr: float) -> None:
    run = runs.create_run("a", LoraSpec(rank=4, seed=2))
    runs.forward_backward("a", _batch(), "cross_entropy", {"aggregation": "sum"})
    before = [p.detach().clone() for p in run.zone.params]
    grads = [p.grad.clone() for p in run.zone.params]
    with pytest.raises(InvalidInput) as err:
        runs.optim_step("a", AdamStep(learning_rate=lr))
    assert err.value.field == "adam_params.learning_rate"
    assert all(torch.equal(a, p) for a, p in zip(before, run.zone.params)) and run.version == 0
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, run.zone.params))  # the gradients still wait
    assert runs.optim_step("a", AdamStep()).step == 1
