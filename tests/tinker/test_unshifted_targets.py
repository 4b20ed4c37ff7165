"""Tinker datums whose targets are not the model input shifted by one (core suite, no SDK):
rl_loop.py sends target 0 on prompt positions. floe returns the exact log-prob of every target
(log p(target | prefix), checked here against a plain peft forward of the trained adapter to
1e-5), computes a forward-only loss on them, and in forward_backward refuses such a position
that carries loss, naming the datum field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import floe
from floe.backend.runs import AdamStep, RunManager
from floe.errors import InvalidInput
from floe.models import load_tokenizer
from floe.models.lora import LoraSpec
from floe.server.protocols.tinker import convert
from floe.server.protocols.tinker.service import TinkerService
from tests.tinker.wire import add_datum, request

PROMPT, SAMPLED = [5, 17, 9, 23, 40], [31, 12, 8, 44]


@pytest.fixture(scope="module")
def trained(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """A LoRA run after one optimizer step (its adapter is not zero), and that adapter loaded
    with peft on a plain copy of the base model."""
    from peft import PeftModel  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    root = tmp_path_factory.mktemp("runs")
    runs = RunManager(floe.BackendConfig(model=str(tiny_model), state_dir=str(root), seed=0),
                      load_tokenizer(str(tiny_model)), root)
    runs.create_run("r", LoraSpec(rank=4, seed=3))
    seq = PROMPT + SAMPLED
    runs.forward_backward("r", floe.Batch([floe.Group(seq[:1], [floe.Sample(tokens=seq[1:])])]), "cross_entropy",
                          {"aggregation": "sum"})
    runs.optim_step("r", AdamStep(learning_rate=1e-2))
    runs.save_sampler_weights("r", root / "export")
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model)), str(root / "export")).eval()
    return runs, plain


def plain_logprobs(model, tokens: list[int], targets: list[int]) -> list[float]:
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)
    return [float(logp[t, targets[t]]) for t in range(len(tokens))]


def rl_loop_inputs(advantage: float = 1.0) -> tuple[list[int], dict[str, list[float]]]:
    ob = len(PROMPT) - 1
    return PROMPT + SAMPLED[:-1], {"target_tokens": [0] * ob + SAMPLED, "logprobs": [0.0] * ob + [-3.0] * len(SAMPLED),
                                   "advantages": [0.0] * ob + [advantage] * len(SAMPLED)}


def test_target_logprobs_are_a_plain_forwards(trained) -> None:
    runs, plain = trained
    tokens = PROMPT + SAMPLED
    positions, targets = [0, 2, 2, 5, 7], [3, 0, 61, 8, 10]
    got = runs.target_logprobs("r", [(tokens, positions, targets), (tokens, positions, targets)])
    every = {t: plain_logprobs(plain, tokens, [t] * len(tokens)) for t in set(targets)}
    want = [every[t][p] for p, t in zip(positions, targets)]
    assert got[0] == pytest.approx(want, abs=1e-5) and got[1] == got[0]
    with plain.disable_adapter():
        base = plain_logprobs(plain, tokens, [3] * len(tokens))
    assert abs(base[0] - want[0]) > 1e-4  # the trained adapter, not the base model
    with pytest.raises(InvalidInput, match="outside the vocabulary"):
        runs.target_logprobs("r", [(tokens, [1], [runs.vocab_size])])


def test_forward_returns_every_targets_logprob_and_its_loss(trained) -> None:
    """forward (forward_only) with cross_entropy on rl_loop's datum: the log-probs are the
    targets' (0 on the prompt), and the loss is −Σ w·logp of those, weighted positions included."""
    runs, plain = trained
    tokens, inputs = rl_loop_inputs()
    weights = [0.5, 0.0, 1.0, 0.0, 1.0, 1.0, 2.0, 1.0]
    msg = request("cross_entropy", forward_only=True)
    add_datum(msg, tokens, {"target_tokens": inputs["target_tokens"], "weights": weights})
    call = convert.forward_request_to_floe(msg)
    assert call.retarget == [([0, 1, 2, 3], [0, 0, 0, 0])]
    exact = runs.target_logprobs("r", call.target_queries())
    logprobs = call.patched([g[0] for g in runs.forward("r", call.batch).logprobs], exact)
    want = plain_logprobs(plain, tokens, inputs["target_tokens"])
    assert logprobs[0] == pytest.approx(want, abs=1e-5)
    loss = TinkerService._forward_loss(call, logprobs)
    assert loss == pytest.approx(-sum(w * lp for w, lp in zip(weights, want)), rel=1e-5)


def test_forward_backward_trains_the_sampled_tokens_and_returns_the_prompt_targets(trained) -> None:
    runs, plain = trained
    tokens, inputs = rl_loop_inputs()
    msg = request("importance_sampling")
    add_datum(msg, tokens, inputs)
    call = convert.forward_request_to_floe(msg)
    exact = runs.target_logprobs("r", call.target_queries())
    result = runs.forward_backward("r", call.batch, call.loss, call.loss_config)
    logprobs = call.patched([g[0] for g in result.logprobs], exact)
    want = plain_logprobs(plain, tokens, inputs["target_tokens"])
    assert logprobs[0] == pytest.approx(want, abs=1e-5)
    ratios = [np.exp(lp - old) * a for lp, old, a in zip(want, inputs["logprobs"], inputs["advantages"])]
    assert result.metrics["loss"] == pytest.approx(-sum(ratios), rel=1e-5)  # the prompt positions add nothing


@pytest.mark.parametrize(
    ("loss", "inputs", "config", "field"),
    [
        ("cross_entropy", {"weights": [1.0] * 8}, None, "data[0].loss_fn_inputs.weights"),
        ("cross_entropy", {}, None, "data[0].loss_fn_inputs.target_tokens"),  # absent weights are 1
        ("importance_sampling", {"advantages": [0.3] + [0.0] * 3 + [1.0] * 4}, None, "data[0].loss_fn_inputs.advantages"),
        ("ppo", {"advantages": [0.0, -1.0] + [0.0] * 2 + [1.0] * 4}, None, "data[0].loss_fn_inputs.advantages"),
        ("gspo", {"sequence_ratio_mask": [0.0, 0.0, 1.0, 0.0] + [1.0] * 4}, None,
         "data[0].loss_fn_inputs.sequence_ratio_mask"),
        ("dro", {}, {"beta": 0.1}, "data[0].loss_fn_inputs.target_tokens"),
    ],
)
def test_a_position_with_another_target_carries_no_loss_in_forward_backward(loss, inputs, config, field) -> None:
    tokens, base = rl_loop_inputs()
    values = {"target_tokens": base["target_tokens"]}
    if loss != "cross_entropy":
        values.update(logprobs=base["logprobs"], advantages=base["advantages"])
    values.update(inputs)
    msg = request(loss, config)
    add_datum(msg, tokens, values)
    with pytest.raises(InvalidInput, match="not the next input token") as err:
        convert.forward_request_to_floe(msg)
    assert err.value.field == field
    msg.forward_only = True  # forward computes the loss exactly: nothing to refuse
    assert convert.forward_request_to_floe(msg).retarget[0][0] == [0, 1, 2, 3]


def test_a_target_outside_the_vocabulary_is_refused_naming_the_datum_field() -> None:
    tokens, inputs = rl_loop_inputs()
    msg = request("importance_sampling")
    add_datum(msg, tokens, dict(inputs, target_tokens=[0, 500, 0, 0, *SAMPLED]))
    with pytest.raises(InvalidInput, match="position 1: token id 500") as err:
        convert.forward_request_to_floe(msg, vocab_size=108)
    assert err.value.field == "data[0].loss_fn_inputs.target_tokens"


@pytest.mark.parametrize(("loss", "config"), [("importance_sampling", None), ("ppo", None), ("cispo", None),
                                              ("gspo", None), ("dro", {"beta": 0.0})])
def test_rl_loop_datums_are_accepted_for_every_rl_loss(loss, config) -> None:
    tokens, inputs = rl_loop_inputs()
    msg = request(loss, config)
    add_datum(msg, tokens, inputs)
    call = convert.forward_request_to_floe(msg)
    assert call.batch.groups[0].samples[0].tokens == PROMPT[1:] + SAMPLED
    assert call.retarget == [([0, 1, 2, 3], [0, 0, 0, 0])]
