"""`[lora]`: the core backend's policy trains a peft LoRA adapter (floe.backend.policy_lora).

Checked against a peft model built directly with the same init seed: the loss, the adapter's
gradients and one AdamW step; the base stays frozen and the reference stays the base; a sync
gives the sampler the merged weights (its log-probs equal the policy's); a resumed state
continues bit-identically; bad keys and mismatched states are refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

import floe
from floe.errors import InvalidInput, StateError
from floe.models import load_model, make_tiny
from tests.conftest import backend_of

LORA = {"rank": 4, "alpha": 8.0}
OPT = {"lr": 1e-2, "grad_clip": None}


def _batch(tok) -> floe.Batch:
    return floe.Batch([floe.Group(tok.encode("q:"), [floe.Sample(tok.encode("abcd")), floe.Sample(tok.encode("dcb"))]),
                       floe.Group(tok.encode("xy"), [floe.Sample(tok.encode("zz"))])])


def _peft_reference(model_path: Path, seed: int) -> PeftModel:
    base = load_model(str(model_path))
    for p in base.parameters():
        p.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(base, LoraConfig(r=4, lora_alpha=8.0, target_modules="all-linear", lora_dropout=0.0))


def _sum_nll(model: torch.nn.Module, batch: floe.Batch) -> torch.Tensor:
    """Σ over sample tokens of −log p(token | prompt, earlier tokens): cross_entropy, aggregation sum."""
    total = torch.zeros(())
    for g in batch.groups:
        for s in g.samples:
            ids = torch.tensor([g.prompt + s.tokens])
            logits = model(input_ids=ids).logits[0].float()
            logp = torch.log_softmax(logits[len(g.prompt) - 1:-1], dim=-1)
            total = total - logp.gather(1, torch.tensor(s.tokens)[:, None]).sum()
    return total


def test_loss_gradients_and_step_equal_a_peft_model(make_client, tiny_model):
    client = make_client(lora=LORA, optimizer=OPT, seed=3)
    batch = _batch(client.tokenizer())
    ref = _peft_reference(tiny_model, seed=3)
    policy = backend_of(client).policy
    ours = policy.model.state_dict()
    theirs = {k.replace(".default.", "."): p for k, p in ref.named_parameters() if p.requires_grad}
    assert ours.keys() == theirs.keys() and len(ours) > 0
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k  # same init from the same seed

    res = client.forward_backward(batch, "cross_entropy", {"aggregation": "sum"})
    loss = _sum_nll(ref, batch)
    loss.backward()
    assert res.metrics["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    names = list(policy.model.state_dict())
    by_name = dict(zip(names, policy.params))
    assert len(policy.params) == len(theirs)  # the optimizer holds the adapter alone
    for k, p in theirs.items():
        # fp32 sums over the batch's tokens in another order (floe's packed rows, the reference's
        # one sample at a time): within 1e-5 of the tensor's largest entry; an entry-wise 1e-7
        # floor failed on an AMD EPYC by 1.4e-7 on an entry of 4e-3
        torch.testing.assert_close(by_name[k].grad, p.grad, rtol=1e-5, atol=1e-5 * float(p.grad.abs().max()))

    opt = torch.optim.AdamW(list(theirs.values()), lr=OPT["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    opt.step()
    client.optim_step()
    after = policy.model.state_dict()
    for k, p in theirs.items():
        torch.testing.assert_close(after[k], p.detach(), rtol=1e-5, atol=1e-6)


def test_base_frozen_reference_is_base_and_sampler_gets_merged_weights(make_client, tiny_model):
    client = make_client(lora=LORA, optimizer=OPT)
    tok = client.tokenizer()
    backend = backend_of(client)
    base = load_model(str(tiny_model))
    batch = _batch(tok)
    before_ref = client.forward(batch, zone="reference").logprobs
    for _ in range(2):
        client.forward_backward(batch, "cross_entropy")
        client.optim_step()
    host = backend.policy.host
    for name, t in base.state_dict().items():  # every base weight as loaded
        key = name.replace("proj.weight", "proj.base_layer.weight") if "proj" in name else name
        live = dict(host.model.state_dict())
        live_t = live.get(key, live.get(name))
        assert live_t is not None and torch.equal(live_t, t), name
    assert client.forward(batch, zone="reference").logprobs == before_ref  # the reference is the frozen base
    assert client.info().capabilities["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear",
                                                  "missing_targets": "error", "exclude_modules": [], "init": "kaiming"}

    client.sync_weights()
    merged = host.merged_state_dict("policy")
    sampler_sd = backend.sampler.model.state_dict()
    assert merged.keys() == sampler_sd.keys()
    changed = [k for k in merged if not torch.equal(merged[k], base.state_dict()[k])]
    assert changed and all(torch.equal(sampler_sd[k], merged[k]) for k in merged)
    out = client.sample([tok.encode("q:"), tok.encode("xy")], 2, floe.SamplingParams(max_tokens=6, temperature=1.0, seed=5))
    sampled = floe.Batch([floe.Group(p, [floe.Sample(s.tokens) for s in g.samples])
                          for p, g in zip([tok.encode("q:"), tok.encode("xy")], out.groups)])
    policy_lp = client.forward(sampled).logprobs
    for g, lps in zip(out.groups, policy_lp):
        for s, lp in zip(g.samples, lps):
            assert s.weights_version == 1
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(lp), rtol=0, atol=1e-5)


@pytest.mark.parametrize("lora", [LORA, {**LORA, "exclude_modules": ["o_proj"]}, {**LORA, "exclude_modules": r".*\.o_proj"}],
                         ids=["all-linear", "excluded", "excluded-by-regex"])
def test_resume_is_exact_and_the_state_is_a_peft_adapter(make_client, tiny_model, lora):
    a = make_client(lora=lora, optimizer=OPT, seed=1)
    batch = _batch(a.tokenizer())
    for _ in range(2):
        a.forward_backward(batch, "cross_entropy")
        a.optim_step()
    path = Path(a.save_state("ckpt").path)
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors"} <= {p.name for p in path.iterdir()}
    assert "policy.safetensors" not in {p.name for p in path.iterdir()}
    res_a = a.forward_backward(batch, "cross_entropy")
    step_a = a.optim_step()
    weights_a = backend_of(a).policy.model.state_dict()

    b = make_client(lora=lora, optimizer=OPT, seed=2)  # another init seed: the state decides
    assert b.load_state("ckpt").step == 2
    res_b = b.forward_backward(batch, "cross_entropy")
    step_b = b.optim_step()
    assert res_b.metrics["loss"] == res_a.metrics["loss"] and res_b.logprobs == res_a.logprobs
    assert step_b.grad_norm == step_a.grad_norm and step_b.step == step_a.step == 3
    weights_b = backend_of(b).policy.model.state_dict()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)

    # peft itself loads the saved adapter onto the base and computes what floe computed then
    b.load_state("ckpt")
    peft_model = PeftModel.from_pretrained(load_model(str(tiny_model)), str(path))
    saved = load_file(str(path / "adapter_model.safetensors"))
    assert len(saved) == len(weights_a)

    def adapted(names: Iterable[str]) -> set[str]:  # module paths (below the peft wrappers) that carry an adapter
        return {n.split("base_model.model.")[-1].rsplit(".lora_A", 1)[0] for n in names if ".lora_A" in n}

    assert adapted(peft_model.state_dict()) == adapted(weights_a)  # peft adapts exactly floe's layers
    assert (not any(n.endswith("o_proj") for n in adapted(weights_a))) == ("exclude_modules" in lora)
    if lora.get("exclude_modules") == ["o_proj"]:  # a state saved before the fix holds the str() of peft's set: still resumes
        config = json.loads((path / "adapter_config.json").read_text())
        assert config["exclude_modules"] == ["o_proj"]
        old = json.dumps({**config, "exclude_modules": "{'o_proj'}"})
        (path / "adapter_config.json").write_text(old)
        meta = json.loads((path / "state.json").read_text())
        meta["files"]["adapter_config.json"] = len(old.encode())  # as that state listed its own file
        (path / "state.json").write_text(json.dumps(meta))
        assert b.load_state("ckpt").step == 2
    nll = _sum_nll(peft_model, batch)
    res = b.forward_backward(batch, "cross_entropy", {"aggregation": "sum"})
    assert res.metrics["loss"] == pytest.approx(float(nll), rel=1e-5)


def test_bfloat16_lora_trains_and_syncs(make_client):
    client = make_client(lora=LORA, optimizer=OPT, dtype="bfloat16")
    batch = _batch(client.tokenizer())
    client.forward_backward(batch, "cross_entropy")
    client.optim_step()
    assert client.sync_weights().version == 1
    sampler_sd = backend_of(client).sampler.model.state_dict()
    merged = backend_of(client).policy.host.merged_state_dict("policy")
    assert all(torch.equal(sampler_sd[k], merged[k].to(sampler_sd[k].dtype)) for k in merged)


def test_target_modules_and_exclude_modules_choose_the_adapted_layers(make_client, tiny_model):
    def adapted(lora: dict) -> set[str]:
        names = set(backend_of(make_client(lora={**LORA, **lora})).policy.model.state_dict())
        return {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names}

    assert adapted({"target_modules": ["q_proj", "v_proj"]}) == {"q_proj", "v_proj"}
    everything = adapted({})  # "all-linear": every linear layer but the LM head
    assert "lm_head" not in everything and {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= everything
    assert adapted({"exclude_modules": ["down_proj", "o_proj"]}) == everything - {"down_proj", "o_proj"}
    # a string is peft's regular expression over whole module paths, as verl and SkyRL pass it to peft
    assert adapted({"exclude_modules": r".*\.(down|o)_proj"}) == everything - {"down_proj", "o_proj"}
    with pytest.raises(InvalidInput) as e:  # peft would exclude nothing (its fullmatch of the whole path)
        make_client(lora={**LORA, "exclude_modules": "o_proj"})
    assert e.value.field == "lora.exclude_modules" and "whole path" in e.value.message
    peft_model = get_peft_model(load_model(str(tiny_model)), LoraConfig(r=4, target_modules="all-linear",
                                                                        exclude_modules=r".*\.(down|o)_proj"))
    assert {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in peft_model.named_parameters()
            if ".lora_A" in n} == everything - {"down_proj", "o_proj"}  # peft's own reading of the same string
    # a list written for several architectures (prime-rl's default): names this model lacks match nothing
    assert adapted({"target_modules": ["q_proj", "experts", "fc1_latent_proj"], "missing_targets": "ignore"}) == {"q_proj"}


@pytest.mark.parametrize(("lora", "field"), [
    ({"rank": 0, "alpha": 8}, "lora.rank"),
    ({"rank": 4}, "lora.alpha"),
    ({"rank": 4, "alpha": 8, "dropout": 0.05}, "lora.dropout"),
    ({"rank": 4, "alpha": 8, "target_modules": []}, "lora"),
    ({"rank": 4, "alpha": 8, "target_modules": "all"}, "lora.target_modules"),
    ({"rank": 4, "alpha": 8, "target_modules": ["q_proj"], "exclude_modules": ["q_proj"]}, "lora"),
    ({"rank": 4, "alpha": 8, "init": "pissa"}, "lora.init"),
    ({"rank": 4, "alpha": 8, "scale": 2}, "lora.scale"),
])
def test_bad_lora_keys_are_refused_by_name(lora, field):
    with pytest.raises(InvalidInput) as e:
        floe.BackendConfig(model="m", lora=lora)
    assert e.value.field == f"BackendConfig.{field}"


def test_lora_names_the_models_modules_and_refuses_tied_heads(make_client, tmp_path):
    with pytest.raises(InvalidInput) as e:
        make_client(lora={**LORA, "target_modules": ["qkv_proj"]})
    assert e.value.field == "lora.target_modules" and "q_proj" in str(e.value)
    with pytest.raises(InvalidInput) as e:  # "ignore" still needs one name that matches
        make_client(lora={**LORA, "target_modules": ["qkv_proj", "experts"], "missing_targets": "ignore"})
    assert e.value.field == "lora.target_modules" and "q_proj" in str(e.value)
    with pytest.raises(InvalidInput) as e:
        make_client(lora={**LORA, "exclude_modules": ["nope"]})
    assert e.value.field == "lora.exclude_modules"
    # the Ray placement trains it on FSDP2 ranks (tests/backend/test_fsdp_lora.py, tests/ray/test_lora.py)
    assert floe.BackendConfig(model="m", lora=LORA, placement={"kind": "ray"}).lora is not None
    tied = make_tiny(tmp_path / "tied", hidden_size=32, num_hidden_layers=1, tie_word_embeddings=True)
    with pytest.raises(InvalidInput) as e:
        make_client(model=str(tied), lora={**LORA, "target_modules": ["q_proj", "lm_head"]})
    assert e.value.field == "lora.target_modules" and "tied" in str(e.value)


def test_states_of_the_other_kind_or_another_adapter_are_refused(make_client):
    full = make_client()
    batch = _batch(full.tokenizer())
    full.forward_backward(batch, "cross_entropy")
    full.optim_step()
    full.save_state("full")
    lora = make_client(lora=LORA)
    lora.forward_backward(batch, "cross_entropy")
    lora.optim_step()
    lora.save_state("lora")
    before = {k: v.clone() for k, v in backend_of(lora).policy.model.state_dict().items()}
    with pytest.raises(StateError, match="full policy"):
        lora.load_state("full")
    with pytest.raises(StateError, match="LoRA adapter"):
        full.load_state("lora")
    other = make_client(lora={"rank": 4, "alpha": 16.0})
    with pytest.raises(StateError, match="lora_alpha"):
        other.load_state("lora")
    assert all(torch.equal(before[k], v) for k, v in backend_of(lora).policy.model.state_dict().items())
    assert backend_of(lora).policy.step == 1


def test_gradient_checkpointing_changes_no_number(make_client):
    plain = make_client(lora=LORA, optimizer=OPT)
    checkpointed = make_client(lora=LORA, optimizer=OPT, compute={"gradient_checkpointing": True})
    batch = _batch(plain.tokenizer())
    a, b = plain.forward_backward(batch, "cross_entropy"), checkpointed.forward_backward(batch, "cross_entropy")
    assert a.metrics["loss"] == pytest.approx(b.metrics["loss"], rel=1e-6)
    assert backend_of(checkpointed).policy.host.model.is_gradient_checkpointing
    for p, q in zip(backend_of(plain).policy.params, backend_of(checkpointed).policy.params):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_a_plugin_refuses_a_server_that_trains_another_adapter(make_client):
    from floe.integrations.hardware import check_server_lora

    served = make_client(lora=LORA).info().capabilities["lora"]
    full = make_client().info().capabilities["lora"]
    assert full is None
    check_server_lora({"rank": 4, "alpha": 8.0, "target_modules": "all-linear"}, served, "k")  # the same adapter
    check_server_lora(None, full, "k")
    for recipe, server in (({"rank": 8, "alpha": 8.0, "target_modules": "all-linear"}, served),
                           ({"rank": 4, "alpha": 8.0, "target_modules": ["q_proj"]}, served),
                           (None, served), ({"rank": 4, "alpha": 8.0}, full)):
        with pytest.raises(InvalidInput) as e:
            check_server_lora(recipe, server, "actor_rollout_ref.model.lora_rank")
        assert e.value.field == "actor_rollout_ref.model.lora_rank"
