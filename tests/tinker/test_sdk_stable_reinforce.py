"""The unmodified tinker 0.38 SDK against `floe serve` for stable_reinforce and for targets that are
not the input shifted by one: a sampler with record_stability_info records its sequences, a
rl_loop.py-shaped datum naming them trains exactly like floe's own cispo with the ratio in [0, 2]
on the *recorded* log-probs (the client's copy is ignored), another key cannot use them, and
forward returns the exact log-prob of every target (checked against a plain forward)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import floe
from floe.backend.runs import AdamStep, RunManager
from floe.models import load_tokenizer
from floe.models.lora import LoraSpec
from tests.tinker.conftest import API_KEY

pytestmark = pytest.mark.tinker

OTHER_KEY = "tml-floe-other"
PROMPT = [5, 17, 9, 23, 40, 11]


def _datum(prompt: list[int], sequence, advantage: float, client_logprobs: list[float] | None = None):
    """A datum exactly as tinker-cookbook's rl_loop.py builds one (its `with_sampled_provenance`)."""
    from tinker import types  # noqa: PLC0415

    tokens, lps = list(sequence.tokens), client_logprobs or list(sequence.logprobs)
    ob = len(prompt) - 1
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + tokens[:-1]),
        loss_fn_inputs={"target_tokens": [0] * ob + tokens, "logprobs": [0.0] * ob + lps,
                        "advantages": [0.0] * ob + [advantage] * len(tokens)},
    )
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sequence.sequence_id, length=len(prompt)),
                     types.SampledProvenanceSpan(sequence_id=sequence.sequence_id, length=len(tokens) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sequence.sequence_id, offset=1, length=ob),
                        types.SampledProvenanceSpan(sequence_id=sequence.sequence_id, length=len(tokens))],
    )


def test_stable_reinforce_trains_on_the_recorded_logprobs(tinker_server, tinker_service, tinker_model: Path,
                                                          tmp_path: Path) -> None:
    import tinker  # noqa: PLC0415
    from tinker import types  # noqa: PLC0415

    server = tinker_server(f'tinker_api_keys = ["{API_KEY}", "{OTHER_KEY}"]')
    service = tinker_service(server.url, API_KEY)
    training = service.create_lora_training_client(base_model=str(tinker_model), rank=4, seed=5).result()
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    sequences = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=3, sampling_params=params).result().sequences
    advantages = [1.0, -0.5, 0.25]
    # The client's copy of the log-probs is wrong on purpose: the server's record counts.
    datums = [_datum(PROMPT, s, a, [lp - 2.0 for lp in s.logprobs]) for s, a in zip(sequences, advantages)]
    fb = training.forward_backward(datums, "stable_reinforce").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    probe = PROMPT + list(sequences[0].tokens)
    after = training.save_weights_and_get_sampling_client().result().compute_logprobs(
        types.ModelInput.from_ints(probe)).result()

    cfg = floe.BackendConfig(model=str(tinker_model), state_dir=str(tmp_path / "native"), seed=0)
    runs = RunManager(cfg, load_tokenizer(str(tinker_model)), tmp_path / "native")
    runs.create_run("native", LoraSpec(rank=4, seed=5))
    ob = len(PROMPT) - 1
    batch = floe.Batch([floe.Group(PROMPT[:1], [floe.Sample(
        tokens=PROMPT[1:] + list(s.tokens), logprobs=[0.0] * ob + list(s.logprobs), advantage=[0.0] * ob + [a] * len(s.tokens),
        weights=[0.0] * ob + [1.0] * len(s.tokens))]) for s, a in zip(sequences, advantages)])
    prompt_targets = runs.target_logprobs("native", [(PROMPT, list(range(ob)), [0] * ob)])[0]
    native = runs.forward_backward("native", batch, "cispo", {"aggregation": "sum", "clip_low": 1.0, "clip_high": 1.0})
    runs.optim_step("native", AdamStep(learning_rate=1e-2))
    assert fb.metrics["loss:sum"] == pytest.approx(native.metrics["loss"], rel=1e-5, abs=1e-6)
    assert native.metrics["loss"] != 0
    for out, expected in zip(fb.loss_fn_outputs, native.logprobs):
        got = out["logprobs"].tolist()
        assert got[ob:] == pytest.approx(expected[0][ob:], abs=1e-5)
        assert got[:ob] == pytest.approx(prompt_targets, abs=1e-5)  # the log-prob of target 0 there
    assert after[1:] == pytest.approx(runs.prompt_logprobs(runs.snapshot("native"), probe), abs=1e-5)

    # Sequences sampled without record_stability_info, or by another key, have no record.
    plain = training.save_weights_and_get_sampling_client().result()
    unrecorded = plain.sample(types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=params).result()
    with pytest.raises(tinker.RequestFailedError, match=r"loss_fn_input_spans\[1\].sequence_id.*record_stability_info"):
        training.forward_backward([_datum(PROMPT, unrecorded.sequences[0], 1.0)], "stable_reinforce").result()
    other = tinker_service(server.url, OTHER_KEY)
    theirs = other.create_lora_training_client(base_model=str(tinker_model), rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match="no stability info"):
        theirs.forward_backward([_datum(PROMPT, sequences[0], 1.0)], "stable_reinforce").result()


def test_forward_returns_the_logprob_of_every_target(tinker_server, tinker_service, tinker_model: Path) -> None:
    """rl_loop.py's zero targets on the prompt, and arbitrary ones, are scored exactly (a new run
    is the base model: checked against a plain forward of it)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    import tinker  # noqa: PLC0415
    from tinker import types  # noqa: PLC0415

    server = tinker_server()
    training = tinker_service(server.url, API_KEY).create_lora_training_client(
        base_model=str(tinker_model), rank=4).result()
    tokens = PROMPT + [30, 31, 32]
    targets = [0, 0, 7, 0, 0, 30, 31, 32, 45]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs={"target_tokens": targets})
    got = training.forward([datum], "cross_entropy").result()
    base = AutoModelForCausalLM.from_pretrained(str(tinker_model)).eval()
    with torch.no_grad():
        logp = torch.log_softmax(base(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)
    want = [float(logp[i, t]) for i, t in enumerate(targets)]
    assert got.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx(want, abs=1e-5)
    assert got.metrics["loss:sum"] == pytest.approx(-sum(want), rel=1e-5)
    with pytest.raises(tinker.RequestFailedError, match=r"data\[0\].loss_fn_inputs.target_tokens.*not the next input"):
        training.forward_backward([datum], "cross_entropy").result()  # weight 1 on a target floe cannot train
