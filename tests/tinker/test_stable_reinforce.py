"""floe's stable_reinforce (core suite, no SDK): the Tinker datums rl_loop.py and rl/train.py send
(provenance spans, zero targets on the prompt) through `convert` onto floe's registry give the
loss and gradient of a plain truncated-importance-sampling REINFORCE written here,
ℓ_t = −sg(min(exp(logp_t − q_t), C))·A_t·logp_t summed over sampled positions, with q_t the
sampler's recorded log-prob (not the client's copy). Tolerance: relative error < 1e-5 of the whole
gradient vector and of the loss (fp32). Also: every refusal names its field, and the records are
owned, bounded per key and dropped with their session."""

from __future__ import annotations

import math
import random

import pytest
import torch

from floe.errors import InvalidInput
from floe.server.principals import Principal
from floe.server.protocols.tinker import convert
from floe.server.protocols.tinker.stability import StabilityRecords
from tests.conftest import backend_of
from tests.tinker.wire import add_datum, request

ALICE, BOB = Principal("key-alice", operator=False), Principal("key-bob", operator=False)


def rl_loop_datum(msg, prompt: list[int], sampled: list[int], client_lp: list[float], advantage: float,
                  sequence_id: str, provenance: bool = True) -> None:
    """A datum exactly as tinker-cookbook's rl_loop.py builds it (its `with_sampled_provenance`)."""
    ob = len(prompt) - 1
    inputs = {"target_tokens": [0] * ob + sampled, "logprobs": [0.0] * ob + client_lp,
              "advantages": [0.0] * ob + [advantage] * len(sampled)}
    spans = [("prompt_tokens", sequence_id, 1, len(prompt) - 1), ("sampled_tokens", sequence_id, 0, len(sampled))]
    add_datum(msg, prompt + sampled[:-1], inputs, spans if provenance else None)


def convert_with(msg, records: StabilityRecords, who: Principal = ALICE) -> convert.FloeCall:
    return convert.forward_request_to_floe(msg, lambda sid: records.get(who, sid), records.max_tokens)


# -- the loss against a plain reference --------------------------------------------------------


def scenario(vocab: int):
    """rl_loop-shaped datums over two sampled groups, and records whose q sits far from the
    current log-probs (so some ratios pass the cap C and are truncated, others stay below it);
    the client's copies differ from the records."""
    rng = random.Random(3)
    data = []
    for g in range(2):
        prompt = [rng.randrange(8, vocab) for _ in range(5 + 3 * g)]
        for i in range(3):
            sampled = [rng.randrange(8, vocab) for _ in range(2 + i + g)]
            data.append((prompt, sampled, f"req{g}:{i}", rng.uniform(-2, 2)))
    return data


def recorded_q(current: list[float], rng: random.Random) -> list[float]:
    # r = exp(logp - q): q = logp - 1.5 gives r ≈ 4.5 (truncated at C), q = logp + 1.0 gives r ≈ 0.37.
    return [lp + (-1.5 if rng.random() < 0.5 else 1.0) + rng.uniform(-0.1, 0.1) for lp in current]


def plain_logprobs(model, tokens: list[int], targets: list[int]) -> list[torch.Tensor]:
    """log p(targets[t] | tokens[:t + 1]) from one plain HF forward of `tokens` (with grad)."""
    logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[t, targets[t]] for t in range(len(tokens))]


def plain_truncated_is(model, datums, q_of, cap: float) -> torch.Tensor:
    """Σ_datums Σ_{sampled t} −sg(min(exp(logp_t − q_t), C))·A·logp_t, in plain Python."""
    total = torch.zeros(())
    for prompt, sampled, sid, adv in datums:
        tokens = prompt + sampled[:-1]
        lps = plain_logprobs(model, tokens, tokens[1:] + [sampled[-1]])
        ob = len(prompt) - 1
        for k in range(len(sampled)):
            lp = lps[ob + k]
            ratio = torch.exp(lp - q_of[sid][k]).detach()
            total = total - torch.minimum(ratio, torch.tensor(cap)) * adv * lp
    return total


def grads(params) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])


def clear(backend) -> None:
    for p in backend.policy.params:
        p.grad = None
    backend.policy.pending_calls = 0


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("cap", [None, 1.5])
def test_stable_reinforce_is_truncated_is_reinforce_on_the_recorded_logprobs(make_client, cap) -> None:
    client = make_client()
    backend = backend_of(client)
    model, params = backend.policy.model, backend.policy.params
    datums = scenario(backend.vocab_size)
    rng = random.Random(11)
    records, q_of, client_copy = StabilityRecords(10_000), {}, {}
    with torch.no_grad():
        for prompt, sampled, sid, _ in datums:
            tokens = prompt + sampled[:-1]
            current = [float(x) for x in plain_logprobs(model, tokens, tokens[1:] + [sampled[-1]])[len(prompt) - 1:]]
            q_of[sid] = recorded_q(current, rng)
            client_copy[sid] = [x + 0.7 for x in q_of[sid]]  # what a client might hold: not the record
            records.put(ALICE.id, "session", sid, sampled, q_of[sid])
    msg = request("stable_reinforce", None if cap is None else {"ratio_cap": cap})
    for prompt, sampled, sid, adv in datums:
        rl_loop_datum(msg, prompt, sampled, client_copy[sid], adv, sid)
    call = convert_with(msg, records)
    assert (call.loss, call.loss_config) == ("cispo", {"aggregation": "sum", "clip_low": 1.0,
                                                       "clip_high": (cap or 2.0) - 1.0})
    for g, (prompt, sampled, sid, _) in zip(call.batch.groups, datums):  # q is the record, not the client's
        assert g.samples[0].logprobs[len(prompt) - 1:] == pytest.approx(q_of[sid], abs=1e-6)

    clear(backend)
    expected_loss = plain_truncated_is(model, datums, q_of, cap or 2.0)
    expected_loss.backward()
    expected = grads(params).clone()
    clear(backend)
    with_client_copy = plain_truncated_is(model, datums, client_copy, cap or 2.0)
    with_client_copy.backward()
    other = grads(params).clone()
    clear(backend)

    result = client.forward_backward(call.batch, call.loss, call.loss_config)
    got = grads(params).clone()
    clear(backend)
    assert 0 < result.metrics["clip_fraction"] < 1  # some ratios were truncated at C, some not
    assert rel_err(got, expected) < 1e-5
    assert math.isclose(result.metrics["loss"], float(expected_loss.detach()), rel_tol=1e-5)
    assert rel_err(other, expected) > 1e-2  # the client's copy would have given another gradient


# -- refusals ------------------------------------------------------------------------------------


def one_datum(records: StabilityRecords, **change):
    """An rl_loop datum over a recorded sequence "r:0", with one thing changed."""
    prompt, sampled = [5, 6, 7, 8], [9, 10, 11]
    records.put(ALICE.id, "s", "r:0", sampled, [-1.0, -2.0, -3.0])
    msg = request("stable_reinforce", change.pop("config", None))
    ob = len(prompt) - 1
    inputs = {"target_tokens": [0] * ob + sampled, "logprobs": [0.0] * ob + [-1.0, -2.0, -3.0],
              "advantages": [0.0] * ob + [1.0] * 3}
    inputs.update(change.pop("inputs", {}))
    spans = change.pop("spans", [("prompt_tokens", "r:0", 1, 3), ("sampled_tokens", "r:0", 0, 3)])
    add_datum(msg, prompt + sampled[:-1], inputs, spans)
    return msg


@pytest.mark.parametrize(
    ("change", "who", "field", "match"),
    [
        ({"spans": [("prompt_tokens", "r:0", 1, 3), ("sampled_tokens", "gone:0", 0, 3)]}, ALICE,
         "data[0].loss_fn_input_spans[1].sequence_id", "record_stability_info=True"),
        ({}, BOB, "data[0].loss_fn_input_spans[1].sequence_id", "no stability info"),  # another key's sequence
        ({"spans": None}, ALICE, "data[0].loss_fn_inputs.advantages", "no loss_fn_input_spans"),
        ({"spans": [("prompt_tokens", "r:0", 1, 4), ("sampled_tokens", "r:0", 1, 2)]}, ALICE,
         "data[0].loss_fn_inputs.advantages", "position 3 has advantage"),
        ({"spans": [("prompt_tokens", "r:0", 1, 3), ("sampled_tokens", "r:0", 0, 2)]}, ALICE,
         "data[0].loss_fn_input_spans", "tile"),
        ({"spans": [("prompt_tokens", "r:0", 1, 2), ("sampled_tokens", "r:0", 0, 4)]}, ALICE,
         "data[0].loss_fn_input_spans[1]", "which has 3"),
        ({"inputs": {"target_tokens": [0, 0, 0, 9, 12, 11]}}, ALICE, "data[0].loss_fn_inputs.target_tokens",
         "sampled token 1 of sequence 'r:0', which is 10"),
        ({"config": {"kl_coeff": 0.1}}, ALICE, "loss_fn_config.kl_coeff", "cannot honour"),
        ({"config": {"ratio_cap": 0.5}}, ALICE, "loss_fn_config.ratio_cap", ">= 1"),
        ({"config": {"clip_high_threshold": 1.2}}, ALICE, "loss_fn_config.clip_high_threshold", "ratio_cap"),
        ({"inputs": {"weights": [1.0] * 6}}, ALICE, "data[0].loss_fn_inputs.weights", "not an input"),
    ],
)
def test_stable_reinforce_refusals_name_the_field(change, who, field, match) -> None:
    records = StabilityRecords(100)
    msg = one_datum(records, **change)
    with pytest.raises(InvalidInput, match=match) as err:
        convert_with(msg, records, who)
    assert err.value.field == field


def test_kl_coeff_zero_and_no_client_logprobs_are_accepted() -> None:
    records = StabilityRecords(100)
    msg = one_datum(records, config={"kl_coeff": 0.0, "ratio_cap": 3.0})
    del msg.data[0].loss_fn_inputs["logprobs"]  # the record is what counts
    call = convert_with(msg, records)
    sample = call.batch.groups[0].samples[0]
    assert call.loss_config["clip_high"] == 2.0
    assert sample.logprobs[3:] == [-1.0, -2.0, -3.0] and sample.weights == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]


def test_records_are_owned_bounded_per_key_and_dropped_with_their_session() -> None:
    records = StabilityRecords(10)
    records.put(ALICE.id, "s1", "a:0", [1, 2, 3, 4], [-1.0] * 4)
    records.put(ALICE.id, "s2", "a:1", [5, 6, 7, 8], [-2.0] * 4)
    records.put(BOB.id, "s3", "b:0", list(range(10)), [-3.0] * 10)  # Bob's bound is his own
    assert records.get(ALICE, "a:0") is not None and records.get(BOB, "a:0") is None
    records.put(ALICE.id, "s2", "a:2", [9, 9, 9], [-0.5] * 3)  # 11 > 10: Alice's oldest goes
    assert records.get(ALICE, "a:0") is None and records.get(ALICE, "a:1") is not None
    assert records.tokens_of(ALICE.id) == 7 and records.tokens_of(BOB.id) == 10
    records.drop_session("s2")
    assert records.get(ALICE, "a:1") is None and records.get(ALICE, "a:2") is None
    assert records.tokens_of(ALICE.id) == 0 and records.get(BOB, "b:0") is not None
    records.put(ALICE.id, "s4", "a:3", list(range(11)), [-1.0] * 11)  # longer than the bound: not kept
    assert records.get(ALICE, "a:3") is None and records.tokens_of(ALICE.id) == 0
