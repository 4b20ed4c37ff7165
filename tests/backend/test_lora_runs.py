"""Multi-tenant LoRA runs on one base model (floe.backend.runs), without any SDK: runs are
isolated, the math is floe's and matches a naive peft model, AdamW follows the per-call
hyper-parameters, state round-trips, bad input changes nothing. Full fine-tune runs (the
`tinker_full_finetune` setting): every weight trains like a plain AdamW on a plain HF model,
samplers are frozen copies, weights save/load/export, one such run at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import floe
from floe.backend.runs import AdamStep, RunManager
from floe.errors import InvalidInput, StateError
from floe.models import load_tokenizer
from floe.models.lora import LoraSpec


@pytest.fixture
def runs(tiny_model: Path, tmp_path: Path) -> RunManager:
    cfg = floe.BackendConfig(model=str(tiny_model), state_dir=str(tmp_path / "states"), seed=0)
    return RunManager(cfg, load_tokenizer(str(tiny_model)), tmp_path / "states" / "tinker")


def _batch(seed: int = 0) -> floe.Batch:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (6, 9, 4)]
    return floe.Batch([floe.Group(s[:1], [floe.Sample(tokens=s[1:], weights=[1.0] * (len(s) - 1))]) for s in seqs])


def _naive_logprobs(model: torch.nn.Module, batch: floe.Batch) -> list[list[float]]:
    out = []
    for group in batch.groups:
        seq = group.prompt + group.samples[0].tokens
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0].float(), -1)
        out.append([float(logp[i - 1, seq[i]]) for i in range(len(group.prompt), len(seq))])
    return out


def test_a_trained_adapter_matches_a_naive_peft_model_and_leaves_others_alone(runs: RunManager, tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    runs.create_run("a", LoraSpec(rank=4, seed=1))  # attention, MLP and unembedding
    runs.create_run("b", LoraSpec(rank=2, seed=2, train_unembed=False))
    batch = _batch()
    before_b = runs.forward("b", batch).logprobs
    before_base = runs.prompt_logprobs(runs.base_sampler(), batch.groups[0].prompt + batch.groups[0].samples[0].tokens)
    for _ in range(2):
        runs.forward_backward("a", batch, "cross_entropy", {"aggregation": "sum"})
        runs.optim_step("a", AdamStep(learning_rate=2e-2))
    after_a = [g[0] for g in runs.forward("a", batch).logprobs]

    runs.export_hf("a", tmp_path / "export")
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model)), str(tmp_path / "export"))
    naive = _naive_logprobs(peft_model.eval(), batch)
    for got, want in zip(after_a, naive):
        assert got == pytest.approx(want, abs=1e-5)
    assert runs.forward("b", batch).logprobs == before_b
    seq = batch.groups[0].prompt + batch.groups[0].samples[0].tokens
    assert runs.prompt_logprobs(runs.base_sampler(), seq) == before_base
    assert after_a[0] != pytest.approx([lp for lp in before_b[0][0]], abs=1e-3)


def test_optim_step_is_adamw_with_this_calls_hyper_parameters(runs: RunManager) -> None:
    run = runs.create_run("a", LoraSpec(rank=4, seed=3))
    batch = _batch(1)
    adam = AdamStep(learning_rate=3e-3, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, grad_clip_norm=0.05)
    for step in range(2):
        runs.forward_backward("a", batch, "cross_entropy", {"aggregation": "sum"})
        params = list(run.zone.params)
        if step == 0:
            shadow = [p.detach().clone().requires_grad_(True) for p in params]
            reference = torch.optim.AdamW(shadow, lr=3e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
        for s, p in zip(shadow, params):
            s.grad = p.grad.detach().clone()
        torch.nn.utils.clip_grad_norm_(shadow, 0.05)
        reference.step()
        result = runs.optim_step("a", adam)
        assert result.lr == 3e-3 and result.grad_norm > 0.05  # the clip really bit
        for s, p in zip(shadow, params):
            torch.testing.assert_close(p.detach(), s.detach(), rtol=1e-5, atol=1e-7)


def test_state_round_trip_continues_identically(runs: RunManager, tmp_path: Path) -> None:
    runs.create_run("a", LoraSpec(rank=4, seed=4))
    batch = _batch(2)
    runs.forward_backward("a", batch, "cross_entropy", {"aggregation": "sum"})
    runs.optim_step("a", AdamStep(learning_rate=1e-2))
    runs.save_state("a", tmp_path / "ckpt")
    runs.load_state("b", tmp_path / "ckpt", with_optimizer=True)
    for run_id in ("a", "b"):
        runs.forward_backward(run_id, batch, "cross_entropy", {"aggregation": "sum"})
        runs.optim_step(run_id, AdamStep(learning_rate=1e-2))
    assert runs.runs["b"].version == runs.runs["a"].version == 2
    assert runs.forward("a", batch).logprobs == runs.forward("b", batch).logprobs


def test_snapshots_are_frozen_and_stamped_with_their_version(runs: RunManager) -> None:
    runs.create_run("a", LoraSpec(rank=4, seed=5))
    batch = _batch(3)
    seq = batch.groups[1].prompt + batch.groups[1].samples[0].tokens
    snap0 = runs.snapshot("a")
    frozen = runs.prompt_logprobs(snap0, seq)
    runs.forward_backward("a", batch, "cross_entropy", {"aggregation": "sum"})
    runs.optim_step("a", AdamStep(learning_rate=1e-2))
    snap1 = runs.snapshot("a")
    assert (snap0.version, snap1.version) == (0, 1)
    assert runs.prompt_logprobs(snap0, seq) == frozen
    assert runs.prompt_logprobs(snap1, seq) != pytest.approx(frozen, abs=1e-4)
    group = runs.sample(snap1, seq[:3], 2, floe.SamplingParams(max_tokens=4, seed=0))
    assert [s.weights_version for s in group.samples] == [1, 1]


@pytest.mark.parametrize(
    ("spec", "field"),
    [(LoraSpec(rank=0), "lora_config.rank"),
     (LoraSpec(rank=4, train_attn=False, train_mlp=False, train_unembed=False), "lora_config")],
)
def test_bad_lora_configs_are_refused_and_create_nothing(runs: RunManager, spec: LoraSpec, field: str) -> None:
    with pytest.raises(InvalidInput) as err:
        runs.create_run("a", spec)
    assert err.value.field == field
    assert runs.runs == {}


def test_bad_adam_params_change_nothing(runs: RunManager) -> None:
    run = runs.create_run("a", LoraSpec(rank=4, seed=6))
    runs.forward_backward("a", _batch(), "cross_entropy", {"aggregation": "sum"})
    before = [p.detach().clone() for p in run.zone.params]
    with pytest.raises(InvalidInput) as err:
        runs.optim_step("a", AdamStep(beta1=1.5))
    assert err.value.field == "adam_params.beta1"
    assert all(torch.equal(a, p) for a, p in zip(before, run.zone.params)) and run.version == 0
    assert runs.optim_step("a", AdamStep()).step == 1  # the pending gradients are still there


def test_reload_replaces_a_run_and_close_frees_its_adapters(runs: RunManager, tmp_path: Path) -> None:
    run = runs.create_run("a", LoraSpec(rank=4, seed=7))
    batch = _batch(4)
    runs.save_state("a", tmp_path / "step0")
    start = runs.forward("a", batch).logprobs
    runs.forward_backward("a", batch, "cross_entropy", {"aggregation": "sum"})
    runs.optim_step("a", AdamStep(learning_rate=1e-2))
    snap = runs.snapshot("a")
    assert runs.forward("a", batch).logprobs != start
    reloaded = runs.reload("a", tmp_path / "step0", with_optimizer=True)
    assert runs.forward("a", batch).logprobs == start and reloaded.version == 0
    assert run.adapter not in runs.host.specs and set(runs.runs) == {"a"}
    runs.close_run("a")
    assert set(runs.host.specs) == {snap.weights} and runs.runs == {}  # a sampler stays until it is released
    runs.release_sampler(snap)
    assert runs.host.specs == {}
    again = runs.create_run("a", LoraSpec(rank=4, seed=7))  # the host works again after its last adapter went
    assert runs.forward("a", batch).logprobs == start and again.version == 0


# -- full fine-tune runs -------------------------------------------------------------------------


@pytest.fixture
def full_runs(tiny_model: Path, tmp_path: Path) -> RunManager:
    cfg = floe.BackendConfig(model=str(tiny_model), state_dir=str(tmp_path / "states"), seed=0)
    return RunManager(cfg, load_tokenizer(str(tiny_model)), tmp_path / "states" / "tinker", full_finetune=True)


def test_a_full_run_trains_every_weight_as_plain_adamw_and_leaves_the_base_alone(full_runs: RunManager, tiny_model):
    from transformers import AutoModelForCausalLM

    run = full_runs.create_run("f", None)
    batch = _batch(5)
    seq = batch.groups[0].prompt + batch.groups[0].samples[0].tokens
    base_before = full_runs.prompt_logprobs(full_runs.base_sampler(), seq)
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    # eps well above float noise: rows of rare tokens get gradients near 0, where a tiny eps
    # would turn rounding differences into visible steps.
    adamw = torch.optim.AdamW(reference.parameters(), lr=3e-3, betas=(0.8, 0.9), eps=1e-4, weight_decay=0.1)
    adam = AdamStep(learning_rate=3e-3, beta1=0.8, beta2=0.9, eps=1e-4, weight_decay=0.1)
    for _ in range(2):
        result = full_runs.forward_backward("f", batch, "cross_entropy", {"aggregation": "sum"})
        loss = -sum(sum(lp) for lp in _naive_logprobs_grad(reference, batch))
        loss.backward()
        assert result.metrics["loss"] == pytest.approx(loss.item(), abs=1e-4)
        adamw.step()
        adamw.zero_grad()
        assert full_runs.optim_step("f", adam).step == run.version
    trained = dict(run.zone.model.named_parameters())
    assert len(trained) == len(dict(reference.named_parameters())) == len(run.zone.params)  # every weight
    for name, want in reference.named_parameters():
        # a step moves weights by ~lr (3e-3); summation order differs by ~1e-6 at most
        torch.testing.assert_close(trained[name].detach(), want.detach(), rtol=1e-4, atol=1e-5)
    assert full_runs.prompt_logprobs(full_runs.base_sampler(), seq) == base_before
    assert full_runs.forward("f", batch).logprobs[0][0] != pytest.approx(base_before, abs=1e-3)


def _naive_logprobs_grad(model: torch.nn.Module, batch: floe.Batch) -> list[torch.Tensor]:
    out = []
    for group in batch.groups:
        seq = group.prompt + group.samples[0].tokens
        logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0].float(), -1)
        out.append(torch.stack([logp[i - 1, seq[i]] for i in range(len(group.prompt), len(seq))]))
    return out


def test_full_run_snapshots_are_frozen_copies_and_sample(full_runs: RunManager) -> None:
    full_runs.create_run("f", None)
    batch = _batch(6)
    seq = batch.groups[1].prompt + batch.groups[1].samples[0].tokens
    snap0 = full_runs.snapshot("f")
    frozen = full_runs.prompt_logprobs(snap0, seq)
    assert frozen == pytest.approx(full_runs.forward("f", floe.Batch([batch.groups[1]])).logprobs[0][0], abs=1e-6)
    full_runs.forward_backward("f", batch, "cross_entropy", {"aggregation": "sum"})
    full_runs.optim_step("f", AdamStep(learning_rate=1e-2))
    snap1 = full_runs.snapshot("f")
    assert (snap0.version, snap1.version, snap0.full) == (0, 1, True)
    assert full_runs.prompt_logprobs(snap0, seq) == frozen
    assert full_runs.prompt_logprobs(snap1, seq) != pytest.approx(frozen, abs=1e-4)
    group = full_runs.sample(snap1, seq[:3], 2, floe.SamplingParams(max_tokens=4, seed=0))
    assert [s.weights_version for s in group.samples] == [1, 1] and all(len(s.tokens) == 4 for s in group.samples)
    later = []
    for _ in range(2):  # newer snapshots leave the older ones as they were (no cap here: the caller's residency)
        full_runs.forward_backward("f", batch, "cross_entropy", {"aggregation": "sum"})
        full_runs.optim_step("f", AdamStep(learning_rate=1e-2))
        later.append(full_runs.snapshot("f"))
    assert full_runs.prompt_logprobs(snap0, seq) == frozen
    full_runs.release_sampler(snap0)
    with pytest.raises(StateError, match="released"):
        full_runs.prompt_logprobs(snap0, seq)
    full_runs.close_run("f")
    assert len(full_runs.frozen) == 3  # samplers outlive their run until released
    for snap in (snap1, *later):
        full_runs.release_sampler(snap)
    assert full_runs.frozen == {}


def test_full_run_state_reloads_in_place_and_continues_identically(full_runs: RunManager, tmp_path: Path) -> None:
    run = full_runs.create_run("f", None, {"who": "test"})
    batch = _batch(7)
    full_runs.forward_backward("f", batch, "cross_entropy", {"aggregation": "sum"})
    full_runs.optim_step("f", AdamStep(learning_rate=1e-2))
    full_runs.save_state("f", tmp_path / "step1")
    full_runs.forward_backward("f", batch, "cross_entropy", {"aggregation": "sum"})
    full_runs.optim_step("f", AdamStep(learning_rate=1e-2))
    continued = full_runs.forward("f", batch).logprobs
    assert full_runs.reload("f", tmp_path / "step1", with_optimizer=True) is run and run.version == 1
    full_runs.forward_backward("f", batch, "cross_entropy", {"aggregation": "sum"})
    full_runs.optim_step("f", AdamStep(learning_rate=1e-2))
    assert full_runs.forward("f", batch).logprobs == continued and run.version == 2
    # A new run from the state (once the slot is free) has the same weights, step and metadata.
    full_runs.close_run("f")
    loaded = full_runs.load_state("g", tmp_path / "step1", with_optimizer=False)
    assert loaded.full and loaded.version == 1 and loaded.user_metadata == {"who": "test"}
    assert loaded.zone.optimizer.state_dict()["state"] == {}  # without the optimizer: fresh AdamW moments


def test_one_full_run_at_a_time_and_only_with_the_setting(full_runs: RunManager, tiny_model, tmp_path: Path) -> None:
    full_runs.create_run("f", None)
    with pytest.raises(StateError, match="tinker_full_finetune") as err:
        full_runs.create_run("g", None)
    assert "'f'" in str(err.value) and set(full_runs.runs) == {"f"}
    full_runs.create_run("lora", LoraSpec(rank=2, seed=1))  # LoRA runs are not limited by it
    full_runs.save_state("lora", tmp_path / "lora-state")
    with pytest.raises(StateError, match="LoRA run's state"):
        full_runs.reload("f", tmp_path / "lora-state", with_optimizer=True)
    full_runs.close_run("f")
    assert full_runs.create_run("g", None).full  # the slot is free again

    cfg = floe.BackendConfig(model=str(tiny_model), state_dir=str(tmp_path / "off"), seed=0)
    off = RunManager(cfg, load_tokenizer(str(tiny_model)), tmp_path / "off" / "tinker")
    with pytest.raises(StateError, match="tinker_full_finetune"):
        off.create_run("f", None)
    assert off.runs == {}


def test_full_run_export_is_a_plain_hf_model_with_the_same_logprobs(full_runs: RunManager, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    full_runs.create_run("f", None)
    batch = _batch(8)
    full_runs.forward_backward("f", batch, "cross_entropy", {"aggregation": "sum"})
    full_runs.optim_step("f", AdamStep(learning_rate=1e-2))
    assert full_runs.save_sampler_weights("f", tmp_path / "export") == 1
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    AutoTokenizer.from_pretrained(str(tmp_path / "export"))  # a complete model directory
    want = [g[0] for g in full_runs.forward("f", batch).logprobs]
    for got, expected in zip(_naive_logprobs(exported, batch), want):
        assert got == pytest.approx(expected, abs=1e-5)
    sampler = full_runs.load_sampler(tmp_path / "export")
    assert (sampler.full, sampler.version, sampler.run_id) == (True, 1, "f")
    again = full_runs.load_sampler(tmp_path / "export")  # each load is a sampler of its own, until released
    assert again.weights != sampler.weights and (again.full, again.version) == (True, 1)
    full_runs.release_sampler(again)
    seq = batch.groups[0].prompt + batch.groups[0].samples[0].tokens
    assert full_runs.prompt_logprobs(sampler, seq) == pytest.approx(want[0], abs=1e-6)
