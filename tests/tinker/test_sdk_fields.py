"""The unmodified tinker 0.38 SDK (and the cookbook) against `floe serve` for the loss, optimizer
and sampling fields beyond the basics: gspo equals floe's own computation, refused losses and
fields fail with errors that name them, a zero learning rate is a step, the prompt
distributions (top-k, target ids, alternative draws) are the sampler's, and fields the SDK
cannot send wrong are checked on the raw HTTP routes."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

import floe
from floe.backend.runs import AdamStep, RunManager
from floe.models import load_tokenizer
from floe.models.lora import LoraSpec
from tests.tinker.conftest import API_KEY

pytestmark = pytest.mark.tinker

# (model_input + one more token, first position with an advantage, advantages there, mask or None)
GSPO_DATA = [
    ([5, 9, 14, 20, 7, 33, 12], 2, [1.0, -0.5, 2.0, 0.7], True),
    ([40, 41, 42, 8, 9], 1, [-1.0, -0.3, 0.0], False),
    ([3, 17, 25, 26, 27, 28, 29, 30], 3, [0.4, 0.4, 0.4, -1.2], True),
]


def _gspo_inputs(base_lp: list[float], start: int, adv: list[float], masked: bool) -> dict[str, list[float]]:
    """Cookbook-shaped RL inputs: zeros on the prompt, sampler log-probs off the current ones."""
    n = len(base_lp)
    inputs = {"logprobs": [0.0] * start + [lp - 0.4 * (i % 3) for i, lp in enumerate(base_lp[start:])],
              "advantages": [0.0] * start + adv}
    if masked:
        inputs["sequence_ratio_mask"] = [0.0] * start + [1.0] * (n - start)
    return inputs


def test_gspo_through_the_sdk_equals_floe_native(tinker_server, tinker_service, tinker_model: Path, tmp_path: Path) -> None:
    from tinker import types  # noqa: PLC0415

    server = tinker_server()
    service = tinker_service(server.url)
    training = service.create_lora_training_client(base_model=str(tinker_model), rank=4, seed=7).result()
    first = training.forward([types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                                          loss_fn_inputs={"target_tokens": s[1:]}) for s, *_ in GSPO_DATA],
                             "cross_entropy").result()
    inputs = [_gspo_inputs(out["logprobs"].tolist(), start, adv, masked)
              for out, (_, start, adv, masked) in zip(first.loss_fn_outputs, GSPO_DATA)]
    datums = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:], **x})
              for (s, *_), x in zip(GSPO_DATA, inputs)]
    config = {"clip_low_threshold": 0.75, "clip_high_threshold": 1.25}  # exact in binary: epsilons 0.25
    fb = training.forward_backward(datums, "gspo", config).result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = training.save_weights_and_get_sampling_client().result().compute_logprobs(
        types.ModelInput.from_ints(GSPO_DATA[0][0])).result()

    cfg = floe.BackendConfig(model=str(tinker_model), state_dir=str(tmp_path / "native"), seed=0)
    runs = RunManager(cfg, load_tokenizer(str(tinker_model)), tmp_path / "native")
    runs.create_run("native", LoraSpec(rank=4, seed=7))
    batch = floe.Batch([floe.Group(s[:1], [floe.Sample(
        tokens=s[1:], logprobs=x["logprobs"], advantage=x["advantages"],
        weights=x.get("sequence_ratio_mask") or [float(a != 0) for a in x["advantages"]])])
        for (s, *_), x in zip(GSPO_DATA, inputs)])
    native = runs.forward_backward("native", batch, "gspo", {"aggregation": "sum", "clip_low": 0.25,
                                                             "clip_high": 0.25, "ratio_gradient": "token"})
    runs.optim_step("native", AdamStep(learning_rate=1e-2))
    assert native.metrics["clip_fraction"] > 0  # a clip branch was taken
    assert fb.metrics["loss:sum"] == pytest.approx(native.metrics["loss"], abs=1e-5)
    for out, expected in zip(fb.loss_fn_outputs, native.logprobs):
        assert out["logprobs"].tolist() == pytest.approx(expected[0], abs=1e-5)
    assert after[1:] == pytest.approx(runs.prompt_logprobs(runs.snapshot("native"), GSPO_DATA[0][0]), abs=1e-5)


def test_refused_losses_and_fields_name_themselves(tinker_server, tinker_service, tinker_model: Path) -> None:
    import tinker  # noqa: PLC0415
    from tinker import types  # noqa: PLC0415

    server = tinker_server()
    training = tinker_service(server.url).create_lora_training_client(base_model=str(tinker_model), rank=4).result()
    rl = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                     loss_fn_inputs={"target_tokens": [2, 3, 4], "logprobs": [-1.0] * 3, "advantages": [1.0] * 3})
    with pytest.raises(tinker.RequestFailedError, match=r"data\[0\].loss_fn_inputs.advantages.*no loss_fn_input_spans"):
        training.forward_backward([rl], "stable_reinforce").result()  # no provenance: nothing says what q is
    masked = types.Datum(model_input=rl.model_input,
                         loss_fn_inputs={**rl.loss_fn_inputs, "mask": np.ones(3, dtype=np.float32)})
    with pytest.raises(tinker.RequestFailedError, match=r"data\[0\].loss_fn_inputs.mask"):
        training.forward_backward([masked], "importance_sampling").result()
    with pytest.raises(tinker.RequestFailedError, match="loss_fn_config.beta"):
        training.forward_backward([rl], "dro", {"beta": float("nan")}).result()
    with pytest.raises(tinker.RequestFailedError, match="loss_fn_config.kl_coeff"):
        training.forward_backward([rl], "stable_reinforce", {"kl_coeff": 0.5}).result()
    assert training.forward_backward([rl], "importance_sampling").result().metrics["loss:sum"] != 0


def test_a_zero_learning_rate_steps_and_absurd_ones_change_nothing(tinker_server, tinker_service, tinker_model: Path) -> None:
    import tinker  # noqa: PLC0415
    from tinker import types  # noqa: PLC0415

    server = tinker_server()
    training = tinker_service(server.url).create_lora_training_client(base_model=str(tinker_model), rank=4, seed=1).result()
    seq = [5, 9, 14, 20, 7, 33, 12]
    datum = types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs={"target_tokens": seq[1:]})

    def scores() -> list[float]:
        sampler = training.save_weights_and_get_sampling_client().result()
        return sampler.compute_logprobs(types.ModelInput.from_ints(seq)).result()[1:]

    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # B != 0: any real step moves the scores
    trained = scores()
    training.forward_backward([datum], "cross_entropy").result()
    zero = training.optim_step(types.AdamParams(learning_rate=0.0)).result()
    assert zero.metrics["learning_rate:mean"] == 0.0 and zero.metrics["step:max"] == 2.0
    assert scores() == trained  # the step moved nothing
    training.forward_backward([datum], "cross_entropy").result()
    for lr in (math.inf, math.nan, 1e308, -1e-4):
        with pytest.raises((tinker.RequestFailedError, tinker.UnprocessableEntityError), match="adam_params.learning_rate"):
            training.optim_step(types.AdamParams(learning_rate=lr)).result()
    assert scores() == trained
    step = training.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # the gradients were kept
    assert step.metrics["step:max"] == 3.0 and scores() != pytest.approx(trained, abs=1e-4)


@pytest.mark.filterwarnings("ignore:DEPRECATED.*load_state:FutureWarning")  # the SDK's load into a live run
def test_a_refused_request_gives_up_its_place_in_the_sequence(tinker_server, tinker_service, tinker_model: Path) -> None:
    """Each training request carries the next seq_id and runs in that order. One refused before
    it is queued (its fields checked at once: 422, or 404 for a checkpoint that does not exist)
    frees its seq_id, so the next request runs at once instead of waiting the gap timeout
    (sequence_timeout_s, 600 s here: a held request would outlast each result's timeout)."""
    import tinker  # noqa: PLC0415
    from tinker import types  # noqa: PLC0415

    server = tinker_server("sequence_timeout_s = 600\ntinker_min_ttl_s = 60\n")
    training = tinker_service(server.url).create_lora_training_client(base_model=str(tinker_model), rank=4).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 9, 14]), loss_fn_inputs={"target_tokens": [9, 14, 20]})
    refusals = [  # (the refused call, what its error names): one per kind of queued request
        (lambda: training.optim_step(types.AdamParams(learning_rate=math.inf)), "adam_params.learning_rate"),
        (lambda: training.save_state("../escape"), "path"),
        (lambda: training.save_weights_for_sampler("w", ttl_seconds=1), "ttl_seconds"),
        (lambda: training.load_state(f"tinker://{training.model_id}/weights/missing"), "no checkpoint"),
        (lambda: training.forward_backward([types.Datum(model_input=types.ModelInput.from_ints([5, 10**6]),
                                                        loss_fn_inputs={"target_tokens": [9, 14]})], "cross_entropy"),
         "vocabulary"),
    ]
    for refused, field in refusals:
        with pytest.raises(tinker.TinkerError, match=field):
            refused().result(timeout=120)
        # the next request of the sequence runs now (a held one would time out here)
        assert training.forward_backward([datum], "cross_entropy").result(timeout=120).metrics["loss:sum"] > 0
    assert training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120).metrics["step:max"] == 1.0


PROMPT = [7, 12, 3, 44, 9, 21, 30, 5, 17, 40, 2, 33]


def test_prompt_distributions_are_the_samplers(tinker_server, tinker_service, tinker_model: Path) -> None:
    """topk_prompt_logprobs (k = 20, the cookbook's sdft width) with prompt_logprobs_last_n,
    target_prompt_logprobs dense and sparse, prompt_alt_tokens_k: against a plain peft model with
    the sampler's adapter."""
    from peft import PeftModel  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from tinker import types  # noqa: PLC0415

    server = tinker_server()
    service = tinker_service(server.url)
    training = service.create_lora_training_client(base_model=str(tinker_model), rank=4, seed=2).result()
    seq = PROMPT[:8]
    training.forward_backward([types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                                           loss_fn_inputs={"target_tokens": seq[1:]})], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = training.save_weights_for_sampler("dist").result().path
    sampler = service.create_sampling_client(model_path=path).result()
    run, kind, name = path.removeprefix("tinker://").split("/")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tinker_model)),
                                      str(server.state_dir / ".tinker" / "runs" / run / kind / name)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT])).logits[0, :-1].float()
    logp = torch.log_softmax(logits, -1)
    prompt = types.ModelInput.from_ints(PROMPT)
    one = types.SamplingParams(max_tokens=1, seed=3)

    r = sampler.sample(prompt, num_samples=1, sampling_params=one, include_prompt_logprobs=True,
                       topk_prompt_logprobs=20, prompt_logprobs_last_n=4).result()
    topk = r.topk_prompt_logprobs
    assert topk is not None and len(topk) == len(PROMPT)
    assert all(row is None for row in topk[: len(PROMPT) - 4])
    for i in range(len(PROMPT) - 4, len(PROMPT)):
        row = topk[i]
        assert row is not None and len(row) == 20
        assert [lp for _, lp in row] == pytest.approx(torch.topk(logp[i - 1], 20).values.tolist(), abs=1e-5)
        assert [float(logp[i - 1, t]) for t, _ in row] == pytest.approx([lp for _, lp in row], abs=1e-5)
    assert r.prompt_logprobs[-4:] == pytest.approx([float(logp[i - 1, PROMPT[i]]) for i in range(8, 12)], abs=1e-5)

    ids = torch.full((len(PROMPT) - 1, 2), -1, dtype=torch.int64)
    ids[3, 0], ids[3, 1], ids[7, 0], ids[10, 1] = 8, 50, 8, 0
    want = torch.where(ids < 0, torch.tensor(0.0), logp.gather(-1, ids.clamp_min(0)))
    for target in (types.TensorData.from_torch(ids), types.TensorData.from_torch_sparse(ids, pad_value=-1)):
        got = sampler.sample(prompt, num_samples=1, sampling_params=one, target_prompt_logprobs=target).result()
        assert got.target_prompt_logprobs is not None
        assert torch.allclose(got.target_prompt_logprobs.to_torch().to_dense(), want, atol=1e-5)

    warm = types.SamplingParams(max_tokens=1, seed=3, temperature=0.8)
    alts = [sampler.sample(prompt, num_samples=1, sampling_params=warm, prompt_alt_tokens_k=4).result()
            for _ in range(2)]
    tokens = [a.prompt_alt_tokens.tokens.to_torch() for a in alts]
    assert tokens[0].shape == (len(PROMPT) - 1, 4) and torch.equal(tokens[0], tokens[1])  # seeded
    scaled = torch.log_softmax(logits / 0.8, -1)
    assert torch.allclose(alts[0].prompt_alt_tokens.logprobs.to_torch(), scaled.gather(-1, tokens[0]), atol=1e-5)


def _post(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    return client.post(f"/api/v1/{path}", json=body, headers={"X-API-Key": API_KEY})


def _result(client: httpx.Client, response: httpx.Response) -> dict:
    """The future of a model-touching POST, polled to its JSON answer."""
    assert response.status_code == 200, response.text
    while True:
        answer = _post(client, "retrieve_future", {"request_id": response.json()["request_id"]}).json()
        if answer.get("type") != "try_again":
            return answer


def _refused(client: httpx.Client, response: httpx.Response) -> str:
    """The refusal of a request: answered at once (422, checked before any work is queued) or,
    for checks that need the run, through its future as a user error."""
    if response.status_code == 422:
        return json.dumps(response.json())
    failed = _result(client, response)
    assert failed["category"] == "user", failed
    return failed["error"]


def test_fields_the_sdk_cannot_send_wrong_are_checked_on_the_wire(tinker_server, tinker_model: Path) -> None:
    server = tinker_server()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        session = _post(client, "create_session", {"tags": [], "user_metadata": {}})
        sid = session.json()["session_id"]
        bad = _refused(client, _post(client, "create_model", {
            "session_id": sid, "model_seq_id": 0, "base_model": str(tinker_model),
            "lora_config": {"rank": 4, "train_attn": "no"}}))
        assert "lora_config.train_attn" in bad
        created = _result(client, _post(client, "create_model", {
            "session_id": sid, "model_seq_id": 1, "base_model": str(tinker_model), "lora_config": {"rank": 4}}))
        model_id = created["model_id"]
        for value in ("1e-4", None, True):
            refused = _refused(client, _post(client, "optim_step", {
                "model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": value}}))
            assert "adam_params.learning_rate" in refused, value
        sampler = _post(client, "create_sampling_session", {"session_id": sid, "sampling_session_seq_id": 0,
                                                             "base_model": str(tinker_model)}).json()
        base = {"sampling_session_id": sampler["sampling_session_id"], "seq_id": 0, "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                "sampling_params": {"max_tokens": 2}}
        for extra, field in (({"prompt_logprobs": True, "prompt_logprobs_last_n": -1}, "prompt_logprobs_last_n"),
                             ({"prompt_logprobs": True, "prompt_logprobs_last_n": 1.5}, "prompt_logprobs_last_n"),
                             ({"topk_prompt_logprobs": 21}, "topk_prompt_logprobs"),
                             ({"sampling_params": {"max_tokens": "2"}}, "sampling_params.max_tokens")):
            failed = _refused(client, _post(client, "asample", {**base, **extra}))
            assert field in failed, failed
        wrong_count = _post(client, "asample", {**base, "num_samples": "2"})
        assert wrong_count.status_code == 422 and "num_samples" in json.dumps(wrong_count.json())  # invalid input


def test_cookbook_rl_trains_with_gspo(tinker_server, tinker_model: Path, tmp_path: Path) -> None:
    """rl/train.py with loss_fn="gspo" (its datums carry no sequence_ratio_mask: the tokens with a
    nonzero advantage form the ratio) trains. (Its default, stable_reinforce:
    tests/tinker/test_cookbook_recipes.py.)"""
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder  # noqa: PLC0415
    from tinker_cookbook.rl import train  # noqa: PLC0415

    server = tinker_server()
    dataset = ArithmeticDatasetBuilder(batch_size=2, model_name_for_tokenizer=str(tinker_model),
                                       renderer_name="role_colon", n_batches=4, group_size=2)
    config = train.Config(learning_rate=1e-3, model_name=str(tinker_model), recipe_name="floe_test", max_tokens=4,
                          log_path=str(tmp_path / "gspo"), dataset_builder=dataset, renderer_name="role_colon",
                          eval_every=0, save_every=0, lora_rank=4, base_url=server.url, loss_fn="gspo", max_steps=2)
    asyncio.run(train.main(config))
    rows = [json.loads(line) for line in (tmp_path / "gspo" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert {r["step"] for r in rows} >= {0, 1}
