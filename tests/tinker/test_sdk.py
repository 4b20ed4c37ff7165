"""The unmodified tinker 0.38 SDK against `floe serve`: values equal floe's own computation on the
same data and adapter, runs are isolated, exported adapters load in peft, errors are clear."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch

import floe
from floe.backend.runs import AdamStep, RunManager
from floe.models import load_tokenizer
from floe.models.lora import LoraSpec
from tests.tinker.conftest import API_KEY

pytestmark = pytest.mark.tinker

SEQS = [[5, 9, 14, 20, 7, 33, 12], [40, 41, 42, 8, 9], [3, 17, 25, 26, 27, 28, 29, 30], [11, 12], [60, 61, 62, 63]]
WEIGHTS = [[0, 0, 1, 1, 1, 1], [0, 1, 1, 1], [1, 0.5, 1, 1, 1, 1, 2], [1], [0, 0, 1]]
ADAM = {"learning_rate": 5e-3, "beta1": 0.85, "beta2": 0.97, "eps": 1e-7, "weight_decay": 0.01, "grad_clip_norm": 0.5}


def _datums(types, seqs=SEQS, weights=WEIGHTS):
    return [
        types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                    loss_fn_inputs={"target_tokens": s[1:], "weights": [float(x) for x in w]})
        for s, w in zip(seqs, weights)
    ]


def _native_batch(seqs=SEQS, weights=WEIGHTS) -> floe.Batch:
    return floe.Batch([floe.Group([s[0]], [floe.Sample(tokens=s[1:], weights=[float(x) for x in w])])
                       for s, w in zip(seqs, weights)])


def test_plain_sdk_script_equals_floe_native(tinker_server, tinker_service, tinker_model: Path, tmp_path: Path) -> None:
    from tinker import types  # noqa: PLC0415

    server = tinker_server("tinker_chunk_datums = 2")  # 5 datums -> 3 chunks, sent out of order
    service = tinker_service(server.url)
    training = service.create_lora_training_client(base_model=str(tinker_model), rank=4, seed=7).result()
    fb_future = training.forward_backward(_datums(types), "cross_entropy")
    step_future = training.optim_step(types.AdamParams(**ADAM))
    fb = fb_future.result()
    step_future.result()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([5, 9, 14])
    sample = sampler.sample(prompt, num_samples=3, sampling_params=types.SamplingParams(max_tokens=6, seed=11)).result()
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(SEQS[0])).result()

    # floe's own computation: a run with the same adapter spec on the same base, same data.
    cfg = floe.BackendConfig(model=str(tinker_model), state_dir=str(tmp_path / "native"), seed=0)
    runs = RunManager(cfg, load_tokenizer(str(tinker_model)), tmp_path / "native")
    runs.create_run("native", LoraSpec(rank=4, seed=7))
    native = runs.forward_backward("native", _native_batch(), "cross_entropy", {"aggregation": "sum"})
    runs.optim_step("native", AdamStep(**ADAM))
    snap = runs.snapshot("native")

    assert fb.metrics["loss:sum"] == pytest.approx(native.metrics["loss"], abs=1e-5)
    for out, expected in zip(fb.loss_fn_outputs, native.logprobs):
        assert out["logprobs"].tolist() == pytest.approx(expected[0], abs=1e-5)
    expected_scores = runs.prompt_logprobs(snap, SEQS[0])
    assert scored[0] is None and scored[1:] == pytest.approx(expected_scores, abs=1e-5)
    group = runs.sample(snap, [5, 9, 14], 3, floe.SamplingParams(max_tokens=6, seed=11))
    assert [list(s.tokens) for s in sample.sequences] == [s.tokens for s in group.samples]
    for got, want in zip(sample.sequences, group.samples):
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
        assert got.stop_reason == ("length" if want.stop_reason == "length" else "stop")
    posts = [line for line in server.log_path.read_text().splitlines() if '"/api/v1/forward_backward"' in line]
    assert len(posts) == 3  # the batch really arrived as three chunks
    # The update moved the adapter: the trained log-probs differ from the first pass.
    assert not torch.allclose(torch.tensor(scored[1:]), torch.tensor(native.logprobs[0][0]), atol=1e-4)


def _train(service, model: Path, seed: int, seqs, steps: int) -> str:
    from tinker import types  # noqa: PLC0415

    training = service.create_lora_training_client(base_model=str(model), rank=4, seed=seed).result()
    weights = [[1.0] * (len(s) - 1) for s in seqs]
    for _ in range(steps):
        fb = training.forward_backward(_datums(types, seqs, weights), "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=1e-2))
        fb.result()
        step.result()
    return training.save_weights_for_sampler(f"final-{seed}").result().path


def _adapter(state_dir: Path, path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file  # noqa: PLC0415

    run, kind, name = path.removeprefix("tinker://").split("/")
    return load_file(str(state_dir / ".tinker" / "runs" / run / kind / name / "adapter_model.safetensors"))


def test_two_runs_trained_concurrently_equal_each_trained_alone(tinker_server, tinker_service, tinker_model: Path) -> None:
    server = tinker_server()
    data = {1: SEQS[:3], 2: SEQS[2:]}
    alone = {seed: _adapter(server.state_dir, _train(tinker_service(server.url), tinker_model, seed, data[seed], 3))
             for seed in (1, 2)}
    together: dict[int, str] = {}

    def worker(seed: int) -> None:
        together[seed] = _train(tinker_service(server.url), tinker_model, seed, data[seed], 3)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(together) == [1, 2]
    for seed in (1, 2):
        got = _adapter(server.state_dir, together[seed])
        assert got.keys() == alone[seed].keys() and len(got) > 0
        for key in got:
            assert torch.equal(got[key], alone[seed][key]), (seed, key)
    # Different data and seeds: the two runs really hold different weights.
    key = next(iter(alone[1]))
    assert not torch.equal(alone[1][key], alone[2][key])


def test_exported_adapter_loads_in_peft_with_the_same_logprobs(tinker_server, tinker_service, tinker_model: Path) -> None:
    from peft import PeftModel  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from tinker import types  # noqa: PLC0415

    server = tinker_server()
    service = tinker_service(server.url)
    path = _train(service, tinker_model, 3, SEQS, 2)
    sampler = service.create_sampling_client(model_path=path).result()
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(SEQS[2])).result()
    run, kind, name = path.removeprefix("tinker://").split("/")
    directory = server.state_dir / ".tinker" / "runs" / run / kind / name
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tinker_model)), str(directory)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([SEQS[2]])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    naive = [float(logp[i - 1, SEQS[2][i]]) for i in range(1, len(SEQS[2]))]
    assert scored[1:] == pytest.approx(naive, abs=1e-5)
    base = AutoModelForCausalLM.from_pretrained(str(tinker_model)).eval()
    with torch.no_grad():
        base_logp = torch.log_softmax(base(input_ids=torch.tensor([SEQS[2]])).logits[0].float(), -1)
    assert not math.isclose(float(base_logp[0, SEQS[2][1]]), naive[0], abs_tol=1e-4)  # trained, not the base


def test_errors_reach_the_sdk_as_clear_failures(tinker_server, tinker_service, tinker_model: Path) -> None:
    import tinker  # noqa: PLC0415
    from tinker import types  # noqa: PLC0415

    server = tinker_server(f'tinker_api_keys = ["{API_KEY}"]')
    service = tinker_service(server.url)
    with pytest.raises(Exception, match=str(tinker_model)) as wrong_model:
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    assert "base_model" in str(wrong_model.value)
    training = service.create_lora_training_client(base_model=str(tinker_model), rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match="clip_low_thresold"):
        training.forward_backward(
            [types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                         loss_fn_inputs={"target_tokens": [2, 3, 4], "logprobs": [-1.0] * 3, "advantages": [1.0] * 3})],
            "ppo", {"clip_low_thresold": 0.9},
        ).result()
    training.save_state("ckpt").result()
    with pytest.raises(tinker.RequestFailedError, match="overwrite=True"):
        training.save_state("ckpt").result()
    assert training.save_state("ckpt", overwrite=True).result().path.endswith("/weights/ckpt")
    bad_key = tinker.ServiceClient(base_url=server.url, api_key="tml-wrong-key")
    with pytest.raises(Exception, match="X-API-Key"):
        bad_key.create_lora_training_client(base_model=str(tinker_model), rank=4).result()


def test_forward_backward_custom_applies_the_gradient_of_the_client_side_loss(tinker_server, tinker_service,
                                                                               tinker_model: Path, tmp_path: Path) -> None:
    """The SDK's forward_backward_custom (forward, the loss and its gradient on the client, then a
    backward with signed per-token weights) moves the adapter exactly as autograd on a plain
    peft model with torch's AdamW does."""
    from peft import PeftModel, get_peft_model_state_dict  # noqa: PLC0415
    from safetensors.torch import load_file  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from tinker import types  # noqa: PLC0415

    server = tinker_server("tinker_chunk_datums = 2")  # 5 datums: 3 forward chunks, then 3 backward chunks
    service = tinker_service(server.url)
    training = service.create_lora_training_client(base_model=str(tinker_model), rank=4, seed=7).result()
    init = training.save_weights_for_sampler("init").result().path
    datums = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:]})
              for s in SEQS]

    def spread(data, logprobs_list):  # gradient 2(lp - mean): both signs, so not a plain cross_entropy
        loss = sum(((lp - lp.detach().mean()) ** 2).sum() for lp in logprobs_list)
        return loss, {"spread": loss.item()}

    adam = types.AdamParams(learning_rate=1e-2, eps=1e-3)  # eps above float noise: small gradients stay comparable
    fb_future = training.forward_backward_custom(datums, spread)
    step_future = training.optim_step(adam)
    fb = fb_future.result()
    step_future.result()
    after = training.save_weights_for_sampler("after").result().path

    run, kind, _ = init.removeprefix("tinker://").split("/")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tinker_model)),
                                      str(server.state_dir / ".tinker" / "runs" / run / kind / "init"), is_trainable=True)
    logps = []
    for s in SEQS:
        logp = torch.log_softmax(model(input_ids=torch.tensor([s])).logits[0].float(), -1)
        logps.append(torch.stack([logp[i - 1, s[i]] for i in range(1, len(s))]))
    loss, _ = spread(None, logps)
    assert fb.metrics["loss:sum"] == pytest.approx(loss.item(), abs=1e-4)
    assert fb.metrics["spread"] == pytest.approx(loss.item(), abs=1e-4) and "surrogate_loss:sum" in fb.metrics
    for out, want in zip(fb.loss_fn_outputs, logps):
        assert out["logprobs"].tolist() == pytest.approx(want.tolist(), abs=1e-5)
    grads = torch.cat([(2 * (lp - lp.mean())).detach() for lp in logps])
    assert (grads > 0).any() and (grads < 0).any()
    loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    torch.optim.AdamW(trainable, lr=1e-2, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.0).step()
    expected = get_peft_model_state_dict(model, save_embedding_layers=False)
    got = load_file(str(server.state_dir / ".tinker" / "runs" / run / kind / "after" / "adapter_model.safetensors"))
    assert got.keys() == expected.keys()
    moved = 0
    for key, value in got.items():
        torch.testing.assert_close(value, expected[key].detach(), rtol=1e-4, atol=2e-5)  # a step is up to 1e-2
        moved += int(not torch.equal(value, load_file(str(server.state_dir / ".tinker" / "runs" / run / kind / "init" /
                                                                "adapter_model.safetensors"))[key]))
    assert moved > 0
    assert after.endswith("/after")


def test_full_finetune_setting_trains_the_whole_model_through_the_sdk(tinker_server, tinker_service, tinker_model: Path,
                                                                      tmp_path: Path) -> None:
    """`[server] tinker_full_finetune = true`: the SDK's training client trains every weight (values
    equal floe's native full run), samples with them, saves / loads them and exports a plain HF
    model; a second run at once is refused naming the setting."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from tinker import types  # noqa: PLC0415

    server = tinker_server("tinker_full_finetune = true")
    service = tinker_service(server.url)
    training = service.create_lora_training_client(base_model=str(tinker_model), rank=4, seed=7).result()
    assert training.get_info().is_lora is False
    with pytest.raises(Exception, match="tinker_full_finetune"):
        service.create_lora_training_client(base_model=str(tinker_model), rank=4).result()
    fb_future = training.forward_backward(_datums(types), "cross_entropy")
    step_future = training.optim_step(types.AdamParams(**ADAM))
    fb = fb_future.result()
    step_future.result()
    saved = training.save_state("step1").result().path
    sampler = training.save_weights_and_get_sampling_client().result()
    sample = sampler.sample(types.ModelInput.from_ints([5, 9, 14]), num_samples=2,
                            sampling_params=types.SamplingParams(max_tokens=5, seed=3)).result()
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(SEQS[2])).result()
    exported = training.save_weights_for_sampler("full-1").result().path

    cfg = floe.BackendConfig(model=str(tinker_model), state_dir=str(tmp_path / "native"), seed=0)
    runs = RunManager(cfg, load_tokenizer(str(tinker_model)), tmp_path / "native", full_finetune=True)
    runs.create_run("native", None)
    native = runs.forward_backward("native", _native_batch(), "cross_entropy", {"aggregation": "sum"})
    runs.optim_step("native", AdamStep(**ADAM))
    snap = runs.snapshot("native")
    assert fb.metrics["loss:sum"] == pytest.approx(native.metrics["loss"], abs=1e-5)
    for out, expected in zip(fb.loss_fn_outputs, native.logprobs):
        assert out["logprobs"].tolist() == pytest.approx(expected[0], abs=1e-5)
    assert scored[1:] == pytest.approx(runs.prompt_logprobs(snap, SEQS[2]), abs=1e-5)
    group = runs.sample(snap, [5, 9, 14], 2, floe.SamplingParams(max_tokens=5, seed=3))
    assert [list(s.tokens) for s in sample.sequences] == [s.tokens for s in group.samples]

    run, kind, name = exported.removeprefix("tinker://").split("/")
    model = AutoModelForCausalLM.from_pretrained(str(server.state_dir / ".tinker" / "runs" / run / kind / name)).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([SEQS[2]])).logits[0].float(), -1)
    assert scored[1:] == pytest.approx([float(logp[i - 1, SEQS[2][i]]) for i in range(1, len(SEQS[2]))], abs=1e-5)
    from_path = service.create_sampling_client(model_path=exported).result()
    assert from_path.compute_logprobs(types.ModelInput.from_ints(SEQS[2])).result()[1:] == pytest.approx(scored[1:], abs=1e-6)

    # Train on, then load the step-1 state back into the same run: its step-1 weights return.
    fb2 = training.forward_backward(_datums(types), "cross_entropy")
    step2 = training.optim_step(types.AdamParams(**ADAM))
    fb2.result()
    step2.result()
    moved = training.save_weights_and_get_sampling_client().result()
    assert moved.compute_logprobs(types.ModelInput.from_ints(SEQS[2])).result()[1:] != pytest.approx(scored[1:], abs=1e-4)
    training.load_state_with_optimizer(saved).result()
    back = training.save_weights_and_get_sampling_client().result()
    assert back.compute_logprobs(types.ModelInput.from_ints(SEQS[2])).result()[1:] == pytest.approx(scored[1:], abs=1e-6)
