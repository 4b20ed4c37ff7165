"""The Tinker protocol's parts that need no SDK (core suite): wire conversion onto floe's losses
and the per-run ordering of requests by seq_id."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

from floe.errors import InvalidInput
from floe.server.errors import ApiError
from floe.server.protocols.tinker import convert, schema
from floe.server.protocols.tinker.futures import Futures, Reply, Sequencer
from tests.tinker.wire import add_datum, request


def _request(loss: str, datums: list[tuple[list[int], dict[str, list[float]]]], config: dict | None = None):
    msg = request(loss, config)
    for tokens, inputs in datums:
        add_datum(msg, tokens, inputs)
    return msg


def test_ppo_thresholds_are_ratio_bounds_mapped_to_floe_epsilons() -> None:
    rl = {"target_tokens": [2, 3, 4], "logprobs": [-1.0, -2.0, -3.0], "advantages": [0.0, 1.0, -1.0]}
    call = convert.forward_request_to_floe(_request("ppo", [([1, 2, 3], rl)], {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}))
    assert call.loss == "ppo"
    assert call.loss_config["aggregation"] == "sum"
    assert call.loss_config["clip_low"] == pytest.approx(0.3) and call.loss_config["clip_high"] == pytest.approx(0.3)
    sample = call.batch.groups[0].samples[0]
    assert call.batch.groups[0].prompt == [1] and sample.tokens == [2, 3, 4]
    assert sample.logprobs == [-1.0, -2.0, -3.0] and sample.advantage == [0.0, 1.0, -1.0]
    default = convert.forward_request_to_floe(_request("cispo", [([1, 2, 3], rl)]))
    assert default.loss_config["clip_low"] == pytest.approx(0.2) and default.loss_config["clip_high"] == pytest.approx(0.2)


def test_signed_cross_entropy_weights_become_dro_at_beta_zero() -> None:
    call = convert.forward_request_to_floe(
        _request("cross_entropy", [([1, 2, 3], {"target_tokens": [2, 3, 4], "weights": [0.5, -1.0, 2.0]})])
    )
    sample = call.batch.groups[0].samples[0]
    assert (call.loss, call.loss_config) == ("dro", {"aggregation": "sum", "beta": 0.0})
    assert sample.advantage == [0.5, -1.0, 2.0] and sample.logprobs == [0.0, 0.0, 0.0] and sample.weights is None


@pytest.mark.parametrize(
    ("loss", "inputs", "config", "field"),
    [
        ("ppo", {"target_tokens": [2, 3], "logprobs": [0.0, 0.0], "advantages": [1.0, 1.0]}, {"clip_lo": 0.9},
         "loss_fn_config.clip_lo"),
        ("cross_entropy", {"target_tokens": [2, 3], "advantages": [1.0, 1.0]}, None, "data[0].loss_fn_inputs.advantages"),
        ("importance_sampling", {"target_tokens": [2, 3], "logprobs": [0.0, 0.0]}, None, "data[0].loss_fn_inputs.advantages"),
        ("cross_entropy", {"target_tokens": [9, 9]}, None, "data[0].loss_fn_inputs.target_tokens"),
        ("cross_entropy", {"target_tokens": [2]}, None, "data[0].loss_fn_inputs.target_tokens"),
        ("stable_reinforce", {"target_tokens": [2, 3]}, None, "data[0].loss_fn_inputs.advantages"),
        ("custom", {"target_tokens": [2, 3]}, None, "loss_fn"),
    ],
)
def test_bad_requests_name_the_field(loss, inputs, config, field) -> None:
    with pytest.raises(InvalidInput) as err:
        convert.forward_request_to_floe(_request(loss, [([1, 2], inputs)], config))
    assert err.value.field == field


def test_output_round_trips_through_the_schema() -> None:
    raw = convert.forward_output([[-1.0, -2.0], [-0.5]], {"loss:sum": 3.5})
    out = schema.ForwardBackwardOutput()
    out.ParseFromString(raw)
    record = out.loss_fn_outputs[0]
    assert record.num_datums == 2 and dict(out.metrics) == {"loss:sum": 3.5}
    offsets = np.frombuffer(record.fields["logprobs"].offsets, dtype=np.int64).tolist()
    assert offsets == [0, 8, 12]
    assert np.frombuffer(record.fields["logprobs"].data, dtype=np.float32).tolist() == [-1.0, -2.0, -0.5]


def _recorder(order: list[int], seq: int):
    def job() -> Reply:
        order.append(seq)
        return Reply(200, str(seq).encode(), "text/plain")
    return job


def _wait(futures: Futures, rids: list[str], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(futures._entries[r].reply is not None for r in rids):
            return
        time.sleep(0.01)
    raise TimeoutError


def test_requests_run_in_seq_id_order_whatever_the_arrival_order() -> None:
    futures = Futures(workers=4)
    seq = Sequencer(futures, "alice", gap_timeout_s=30)
    order: list[int] = []
    rids = [seq.submit(s, _recorder(order, s)) for s in (3, 4, 2)]
    time.sleep(0.2)
    assert order == []  # waiting for seq 1
    rids.append(seq.submit(1, _recorder(order, 1)))
    _wait(futures, rids)
    assert order == [1, 2, 3, 4]
    assert seq.submit(3, _recorder(order, 99)) == rids[0]  # a re-sent seq_id gets the first answer
    futures.close()


def test_a_reused_seq_id_with_other_data_is_refused_not_answered_with_the_old_result() -> None:
    futures = Futures(workers=1)
    seq = Sequencer(futures, "alice", gap_timeout_s=30)
    order: list[int] = []
    first = seq.submit(1, _recorder(order, 1), digest=b"a")
    assert seq.submit(1, _recorder(order, 1), digest=b"a") == first  # the same request again: a retry
    with pytest.raises(ApiError, match="seq_id 1") as err:
        seq.submit(1, _recorder(order, 2), digest=b"b")
    assert (err.value.status, err.value.error) == (400, "sequence_reused")
    _wait(futures, [first])
    assert order == [1]
    futures.close()


def test_a_future_is_known_only_to_its_owner() -> None:
    futures = Futures(workers=1, max_per_owner=3)
    mine = []
    for _ in range(5):
        mine.append(futures.new("alice"))
        futures.complete(mine[-1], Reply(200, b"", "text/plain"))
    theirs = futures.new("mallory")
    assert futures.known(mine[-1], "alice") and not futures.known(mine[-1], "mallory")
    assert futures.known(theirs, "mallory") and not futures.known(theirs, "alice")
    assert [futures.known(r, "alice") for r in mine] == [False, False, True, True, True]  # each owner's bound
    futures.close()


def test_a_pending_future_is_never_dropped_by_the_reply_bound() -> None:
    futures = Futures(workers=1, max_per_owner=2, max_entries=3)
    pending = futures.new("alice")  # its job has not finished: its reply must still arrive
    done = []
    for _ in range(4):
        done.append(futures.new("alice"))
        futures.complete(done[-1], Reply(200, b"", "text/plain"))
    assert futures.known(pending, "alice")
    assert [futures.known(r, "alice") for r in done] == [False, False, False, True]
    futures.complete(pending, Reply(200, b"late", "text/plain"))
    assert futures._entries[pending].reply is not None
    futures.close()


def test_workers_take_jobs_round_robin_over_owners_and_bound_each_owners_queue() -> None:
    futures = Futures(workers=1, max_queued_per_owner=5)
    gate = threading.Event()
    order: list[str] = []

    def job(name: str):
        def run() -> Reply:
            gate.wait(10)
            order.append(name)
            return Reply(200, b"", "text/plain")
        return run

    rids = []
    for i in range(5):
        futures.admit("bob")
        rids.append(futures.new("bob"))
        futures.run(rids[-1], "bob", job(f"b{i}"))
    with pytest.raises(ApiError) as err:  # b0 may have started; at most one more fits
        for _ in range(2):
            futures.admit("bob")
    assert err.value.status == 429 and "tinker_max_queued_per_key" in err.value.message
    futures.admit("alice")
    rids.append(futures.new("alice"))
    futures.run(rids[-1], "alice", job("a0"))
    gate.set()
    _wait(futures, rids)
    assert order.index("a0") <= 2  # behind the running job and at most one more of bob's, not all five
    assert [n for n in order if n.startswith("b")] == [f"b{i}" for i in range(5)]  # each owner's jobs in order
    futures.close()


def test_a_seq_id_refused_before_it_was_queued_does_not_hold_up_the_next() -> None:
    futures = Futures(workers=1)
    seq = Sequencer(futures, "alice", gap_timeout_s=30)
    order: list[int] = []
    rid = seq.submit(2, _recorder(order, 2))
    seq.skip(1)
    _wait(futures, [rid])
    assert order == [2]
    seq.skip(10**9)  # far ahead: not recorded (the set stays bounded)
    assert seq.skipped == set()
    futures.close()


def test_the_bodies_of_queued_requests_are_bounded_per_owner() -> None:
    futures = Futures(workers=1, max_queued_bytes_per_owner=100)
    seq = Sequencer(futures, "alice", gap_timeout_s=30)
    order: list[int] = []
    seq.submit(5, _recorder(order, 5), size=80)  # waits for seq 1..4, holding its body
    with pytest.raises(ApiError) as err:
        seq.submit(6, _recorder(order, 6), size=30)
    assert err.value.status == 429 and "tinker_max_queued_mb_per_key" in err.value.message
    seq.submit(6, _recorder(order, 6), size=20)
    other = Sequencer(futures, "bob", gap_timeout_s=30)
    other.submit(5, _recorder(order, 50), size=1000)  # another owner; and a first request always fits
    seq.close()
    other.close()
    assert futures.queued("alice") == futures.queued("bob") == 0 and order == []
    futures.close()


def test_a_gapped_seq_id_counts_as_queued_work_and_closing_releases_it() -> None:
    futures = Futures(workers=1, max_queued_per_owner=3)
    seq = Sequencer(futures, "alice", gap_timeout_s=30)
    order: list[int] = []
    rids = [seq.submit(s, _recorder(order, s)) for s in (5, 6, 7)]
    with pytest.raises(ApiError) as err:
        seq.submit(8, _recorder(order, 8))
    assert err.value.status == 429
    assert seq.submit(5, _recorder(order, 5)) == rids[0]  # a retry is not new work
    seq.close()
    assert futures.queued("alice") == 0 and order == []
    assert all(b"closed" in futures._entries[r].reply.body for r in rids)  # type: ignore[union-attr]
    futures.close()


def test_a_gap_that_never_fills_is_skipped_after_the_timeout() -> None:
    futures = Futures(workers=2)
    seq = Sequencer(futures, "alice", gap_timeout_s=0.3)
    order: list[int] = []
    rid = seq.submit(2, _recorder(order, 2))
    _wait(futures, [rid])
    assert order == [2]
    late = seq.submit(1, _recorder(order, 1))  # the skipped one still runs when it comes
    _wait(futures, [late])
    assert order == [2, 1]
    futures.close()


def test_retrieve_waits_for_the_reply_without_a_thread() -> None:
    import asyncio

    futures = Futures(workers=1)
    rid = futures.new("alice")
    threading.Timer(0.2, lambda: futures.complete(rid, Reply(200, b"done", "text/plain"))).start()

    async def main() -> tuple[Reply | None, Reply | None]:
        early = await futures.wait(rid, 0.01)
        return early, await futures.wait(rid, 5)

    early, reply = asyncio.run(main())
    assert early is None and reply is not None and reply.body == b"done"
    futures.close()


# -- losses: gspo, finite config numbers, the inputs a loss takes, losses floe does not serve ----


def _tinker_gspo(lp, q, adv, mask, low: float, high: float):
    """Tinker's gspo for one datum, as its loss docs implement it (tinker-docs losses/gspo)."""
    import torch

    in_ratio = mask != 0
    log_ratio = (lp.detach() - q)[in_ratio].mean()
    ratio = torch.exp(log_ratio + lp - lp.detach())
    clipped = torch.clamp(ratio, low, high)
    return -torch.min(ratio * adv, clipped * adv).sum()


def test_tinker_gspo_equals_the_documented_implementation() -> None:
    """Datums -> floe's gspo (weights = the ratio's tokens, ratio_gradient token, thresholds as
    epsilons, sum) gives Tinker's loss and gradient: with an explicit sequence_ratio_mask and with
    none (the tokens with a nonzero advantage), per-token advantages, both clip branches taken."""
    import torch

    from floe.compute.losses import TokenInputs, compute_loss, resolve_loss

    g = torch.Generator().manual_seed(3)
    d1 = {"target_tokens": [2, 3, 4, 5, 6, 7], "logprobs": [0.0, 0.0, -1.0, -2.0, -0.5, -1.5],
          "advantages": [0.0, 0.0, 1.0, -0.5, 2.0, 0.7], "sequence_ratio_mask": [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]}
    d2 = {"target_tokens": [9, 10, 11, 12], "logprobs": [0.0, -0.7, -1.2, 0.0], "advantages": [0.0, -1.0, -0.3, 0.0]}
    low, high = 0.95, 1.05
    call = convert.forward_request_to_floe(_request("gspo", [([1, 2, 3, 4, 5, 6], d1), ([8, 9, 10, 11], d2)],
                                                    {"clip_low_threshold": low, "clip_high_threshold": high}))
    assert call.loss == "gspo" and call.loss_config["ratio_gradient"] == "token"
    samples = [grp.samples[0] for grp in call.batch.groups]
    assert samples[0].weights == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0] and samples[1].weights == [0.0, 1.0, 1.0, 0.0]
    for shift in (0.0, 0.3):  # ratios within the clip range, then s ~ e^0.3, outside it
        q = [torch.tensor(d["logprobs"]) for d in (d1, d2)]
        lp = [(qi + shift + 0.05 * torch.randn(qi.shape, generator=g)).requires_grad_(True) for qi in q]
        want = sum(_tinker_gspo(lp[i], q[i], torch.tensor(d["advantages"]),
                                torch.tensor(d.get("sequence_ratio_mask", [float(a != 0) for a in d["advantages"]])),
                                low, high) for i, d in enumerate((d1, d2)))
        want.backward()
        want_grads = [x.grad.clone() for x in lp]
        flat = torch.cat([x.detach() for x in lp]).requires_grad_(True)
        inputs = TokenInputs(
            logp=flat, weights=torch.tensor([w for s in samples for w in s.weights]), scale=torch.ones(10),
            sample_index=torch.tensor([0] * 6 + [1] * 4), num_samples=2,
            old_logp=torch.tensor([x for s in samples for x in s.logprobs]),
            advantages=torch.tensor([x for s in samples for x in s.advantage]),
        )
        got, metrics = compute_loss(resolve_loss(call.loss, call.loss_config), inputs)
        got.backward()
        assert got.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
        assert flat.grad.tolist() == pytest.approx(torch.cat(want_grads).tolist(), rel=1e-5, abs=1e-7)
        assert (metrics["clipped_tokens"] > 0) == (shift > 0.1)


def test_gspo_refuses_an_advantage_outside_the_sequence_ratio() -> None:
    d = {"target_tokens": [2, 3, 4], "logprobs": [0.0, -1.0, -1.0], "advantages": [0.5, 1.0, 1.0],
         "sequence_ratio_mask": [0.0, 1.0, 1.0]}
    with pytest.raises(InvalidInput, match="position 0 has a nonzero advantage outside") as err:
        convert.forward_request_to_floe(_request("gspo", [([1, 2, 3], d)]))
    assert err.value.field == "data[0].loss_fn_inputs.advantages"


def _raw_config_request(loss: str, v2: dict | None = None, legacy: dict | None = None):
    rl = {"target_tokens": [2, 3], "logprobs": [-1.0, -1.0], "advantages": [1.0, 1.0]}
    msg = _request(loss, [([1, 2], rl)])
    for key, value in (v2 or {}).items():
        if isinstance(value, str):
            msg.loss_fn_config_v2[key].text = value
        else:
            msg.loss_fn_config_v2[key].number = value
    for key, value in (legacy or {}).items():
        msg.loss_fn_config[key] = value
    return msg


@pytest.mark.parametrize(
    ("loss", "v2", "legacy", "field"),
    [
        ("ppo", {"clip_low_threshold": float("nan")}, None, "loss_fn_config.clip_low_threshold"),
        ("ppo", {"clip_high_threshold": float("inf")}, None, "loss_fn_config.clip_high_threshold"),
        ("gspo", {"clip_high_threshold": "1.2"}, None, "loss_fn_config.clip_high_threshold"),
        ("cispo", None, {"clip_low_threshold": float("-inf")}, "loss_fn_config.clip_low_threshold"),
        ("dro", {"beta": float("nan")}, None, "loss_fn_config.beta"),
        ("dro", None, {"beta": float("inf")}, "loss_fn_config.beta"),
        ("dro", {"beta": -0.1}, None, "loss_fn_config.beta"),
        ("gspo", {"clip_low_threshold": 1.5}, None, "loss_fn_config.clip_low_threshold"),
    ],
)
def test_loss_fn_config_numbers_must_be_finite_and_in_range(loss, v2, legacy, field) -> None:
    with pytest.raises(InvalidInput) as err:
        convert.forward_request_to_floe(_raw_config_request(loss, v2, legacy))
    assert err.value.field == field


def test_v2_config_is_preferred_and_a_finite_legacy_map_still_works() -> None:
    call = convert.forward_request_to_floe(_raw_config_request("dro", {"beta": 0.25}, {"beta": float("nan")}))
    assert call.loss_config["beta"] == 0.25  # the SDK mirrors floats into the legacy map; v2 supersedes it
    assert convert.forward_request_to_floe(_raw_config_request("dro", None, {"beta": 0.5})).loss_config["beta"] == 0.5


# What stock tinker-cookbook 0.6.1 recipes send (rl/train.py strips `mask`; rl_loop.py adds the
# gspo mask; supervised and DPO send target_tokens + weights, the SDK's custom loss the same).
COOKBOOK_INPUTS = [
    ("importance_sampling", ("target_tokens", "logprobs", "advantages")),
    ("ppo", ("target_tokens", "logprobs", "advantages")),
    ("cispo", ("target_tokens", "logprobs", "advantages")),
    ("gspo", ("target_tokens", "logprobs", "advantages")),
    ("gspo", ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask")),
    ("cross_entropy", ("target_tokens", "weights")),
    ("cross_entropy", ("target_tokens",)),
]


@pytest.mark.parametrize(("loss", "keys"), COOKBOOK_INPUTS)
def test_the_inputs_stock_cookbook_recipes_send_are_accepted(loss, keys) -> None:
    values = {"target_tokens": [2, 3, 4], "logprobs": [0.0, -1.0, -2.0], "advantages": [0.0, 1.0, 1.0],
              "sequence_ratio_mask": [0.0, 1.0, 1.0], "weights": [0.0, 1.0, 1.0]}
    config = {"beta": 0.1} if loss == "dro" else None
    call = convert.forward_request_to_floe(_request(loss, [([1, 2, 3], {k: values[k] for k in keys})], config))
    assert call.batch.groups[0].samples[0].tokens == [2, 3, 4]


@pytest.mark.parametrize(
    ("loss", "extra", "match"),
    [
        ("importance_sampling", "mask", "drops its 'mask'"),
        ("cross_entropy", "logprobs", "not an input of cross_entropy"),
        ("ppo", "weights", "not an input of ppo"),
        ("ppo", "clip_low_threshold", "per-token clip thresholds"),
        ("importance_sampling", "sequence_ratio_mask", "not an input of importance_sampling"),
    ],
)
def test_inputs_a_loss_does_not_take_are_refused_naming_the_key(loss, extra, match) -> None:
    inputs = {"target_tokens": [2, 3], extra: [1.0, 1.0]}
    if loss != "cross_entropy":
        inputs.update(logprobs=[-1.0, -1.0], advantages=[1.0, 1.0])
    with pytest.raises(InvalidInput, match=match) as err:
        convert.forward_request_to_floe(_request(loss, [([1, 2], inputs)]))
    assert err.value.field == f"data[0].loss_fn_inputs.{extra}"


def test_losses_floe_does_not_serve_say_why_and_what_to_use() -> None:
    with pytest.raises(InvalidInput, match="custom_loss_server_side") as err:
        convert.forward_request_to_floe(_request("custom", [([1, 2], {"target_tokens": [2, 3]})]))
    assert err.value.field == "loss_fn"


def test_input_tensors_are_checked_for_dtype_shape_and_finite_values() -> None:
    nan = convert.forward_request_to_floe
    bad = _request("importance_sampling", [([1, 2, 3], {"target_tokens": [2, 3, 4], "logprobs": [-1.0] * 3,
                                                         "advantages": [1.0, float("nan"), 0.0]})])
    with pytest.raises(InvalidInput) as err:
        nan(bad)
    assert err.value.field == "data[0].loss_fn_inputs.advantages[1]"
    floats = _request("cross_entropy", [([1, 2], {"target_tokens": [2, 3]})])
    t = floats.data[0].loss_fn_inputs["target_tokens"]
    t.dtype, t.dense = schema.DTYPE_FLOAT32, np.asarray([2, 3], dtype=np.float32).tobytes()
    with pytest.raises(InvalidInput, match="int64") as err:
        nan(floats)
    assert err.value.field == "data[0].loss_fn_inputs.target_tokens"
    two_d = _request("cross_entropy", [([1, 2], {"target_tokens": [2, 3, 5, 6]})])
    del two_d.data[0].loss_fn_inputs["target_tokens"].shape[:]
    two_d.data[0].loss_fn_inputs["target_tokens"].shape.extend([2, 2])
    with pytest.raises(InvalidInput, match="2-D") as err:
        nan(two_d)
    assert err.value.field == "data[0].loss_fn_inputs.target_tokens"


# -- optim_step: AdamParams -----------------------------------------------------------------


def test_adam_params_accept_a_zero_learning_rate_and_refuse_absurd_ones() -> None:
    import json

    from floe.backend.runs import MAX_LEARNING_RATE, AdamStep

    full = {"learning_rate": 0.0, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}
    step = AdamStep.from_json(full)
    assert step.learning_rate == 0.0 and step.to_config().lr == 0.0
    assert AdamStep.from_json({"learning_rate": MAX_LEARNING_RATE}).learning_rate == MAX_LEARNING_RATE
    for text in ("Infinity", "-Infinity", "NaN", "1e308", "-1e-5", "null", '"1e-4"', "true", "1.5", "1e400"):
        raw = json.loads(f'{{"learning_rate": {text}}}')  # what the JSON body parses to
        with pytest.raises(InvalidInput) as err:
            AdamStep.from_json(raw)
        assert err.value.field == "adam_params.learning_rate", text


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"beta1": float("nan")}, "adam_params.beta1"),
        ({"beta1": 1.0}, "adam_params.beta1"),
        ({"beta2": -0.1}, "adam_params.beta2"),
        ({"eps": 0.0}, "adam_params.eps"),
        ({"eps": float("inf")}, "adam_params.eps"),
        ({"weight_decay": float("inf")}, "adam_params.weight_decay"),
        ({"weight_decay": -0.01}, "adam_params.weight_decay"),
        ({"learning_rate": 0.5, "weight_decay": 3.0}, "adam_params.weight_decay"),
        ({"grad_clip_norm": float("nan")}, "adam_params.grad_clip_norm"),
        ({"grad_clip_norm": -1.0}, "adam_params.grad_clip_norm"),
        ({"momentum": 0.9}, "adam_params.momentum"),
        ([0.1], "adam_params"),
    ],
)
def test_every_adam_field_is_finite_and_in_range(raw, field) -> None:
    from floe.backend.runs import AdamStep

    with pytest.raises(InvalidInput) as err:
        AdamStep.from_json(raw)
    assert err.value.field == field


# -- create_model: lora_config --------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"rank": 8, "train_attn": "no"}, "lora_config.train_attn"),
        ({"rank": 8, "train_mlp": 0}, "lora_config.train_mlp"),
        ({"rank": 8, "train_unembed": None}, "lora_config.train_unembed"),
        ({"rank": "8"}, "lora_config.rank"),
        ({"rank": True}, "lora_config.rank"),
        ({"rank": 8.0}, "lora_config.rank"),
        ({"rank": 8, "seed": "7"}, "lora_config.seed"),
        ({"rank": 8, "seed": 2**70}, "lora_config.seed"),
        ({"rank": 8, "alpha": 16}, "lora_config.alpha"),
        ("rank=8", "lora_config"),
    ],
)
def test_lora_config_needs_real_booleans_and_integers(raw, field) -> None:
    with pytest.raises(InvalidInput) as err:
        convert.lora_spec(raw)
    assert err.value.field == field


def test_lora_config_defaults_and_false_switches() -> None:
    spec = convert.lora_spec({"rank": 4, "seed": 3, "train_attn": False})
    assert (spec.rank, spec.seed, spec.train_attn, spec.train_mlp, spec.train_unembed) == (4, 3, False, True, True)
    assert convert.lora_spec(None).rank == 32


# -- asample: every field the SDK sends -------------------------------------------------------

VOCAB, CONTEXT = 100, 64


def _body(**fields):
    body = {"sampling_session_id": "s:sample:0", "seq_id": 0, "num_samples": 1, "type": "sample",
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7, 8, 9]}]},
            "sampling_params": {"max_tokens": 4, "temperature": 1.0, "top_k": -1, "top_p": 1.0},
            "prompt_logprobs": False, "topk_prompt_logprobs": 0, "topk_sample_logprobs": 0, "prompt_alt_tokens_k": 0,
            "record_stability_info": False}
    for key, value in fields.items():
        if key.startswith("sp_"):
            body["sampling_params"][key[3:]] = value
        else:
            body[key] = value
    return body


def _call(**fields) -> convert.SampleCall:
    return convert.sample_request(_body(**fields), 1, VOCAB, CONTEXT)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": -1}, "prompt_logprobs_last_n"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 0}, "prompt_logprobs_last_n"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 2.5}, "prompt_logprobs_last_n"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": True}, "prompt_logprobs_last_n"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 5}, "prompt_logprobs_last_n"),  # > len(prompt) - 1
        ({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n"),  # without prompt_logprobs
        ({"prompt_logprobs": "yes"}, "prompt_logprobs"),
        ({"topk_prompt_logprobs": 21}, "topk_prompt_logprobs"),
        ({"topk_prompt_logprobs": -1}, "topk_prompt_logprobs"),
        ({"topk_sample_logprobs": "5"}, "topk_sample_logprobs"),
        ({"topk_sample_logprobs": 21}, "topk_sample_logprobs"),
        ({"prompt_alt_tokens_k": 21}, "prompt_alt_tokens_k"),
        ({"prompt_alt_tokens_k": 1.0}, "prompt_alt_tokens_k"),
        ({"record_stability_info": 1}, "record_stability_info"),
        ({"sp_max_tokens": 0}, "sampling_params.max_tokens"),
        ({"sp_max_tokens": "8"}, "sampling_params.max_tokens"),
        ({"sp_max_tokens": True}, "sampling_params.max_tokens"),
        ({"sp_max_tokens": 60}, "sampling_params.max_tokens"),  # 5 + 60 > the context of 64
        ({"sp_temperature": float("nan")}, "sampling_params.temperature"),
        ({"sp_temperature": "hot"}, "sampling_params.temperature"),
        ({"sp_temperature": -0.5}, "sampling_params.temperature"),
        ({"sp_top_p": 0.0}, "sampling_params.top_p"),
        ({"sp_top_k": -2}, "sampling_params.top_k"),
        ({"sp_seed": -1}, "sampling_params.seed"),
        ({"sp_seed": 2**63}, "sampling_params.seed"),
        ({"sp_stop": [1, "x"]}, "sampling_params.stop"),
        ({"sp_stop": [""]}, "sampling_params.stop"),
        ({"sp_stop": ["ab"] * 33}, "sampling_params.stop"),
        ({"sp_stop": "x" * 257}, "sampling_params.stop"),
        ({"sp_stop": [3] * 257}, "sampling_params.stop"),
        ({"some_future_field": 3}, "some_future_field"),
    ],
)
def test_sampling_fields_are_type_checked_and_bounded(fields, field) -> None:
    with pytest.raises(InvalidInput) as err:
        _call(**fields)
    assert err.value.field == field


@pytest.mark.parametrize("value", [0, 1.5, "2", True, None, 1025])
def test_num_samples_is_an_integer_in_range(value) -> None:
    with pytest.raises(InvalidInput) as err:
        convert.num_samples(value)
    assert err.value.field == "num_samples"
    assert convert.num_samples(1024) == 1024


def test_a_valid_request_is_served_as_asked() -> None:
    call = _call(prompt_logprobs=True, prompt_logprobs_last_n=2, topk_prompt_logprobs=20, topk_sample_logprobs=3,
                 prompt_alt_tokens_k=4, sp_seed=7, sp_top_k=-1, some_future_flag=False)
    assert (call.prompt, call.last_n, call.topk_prompt, call.topk_sample, call.alt_k) == ([5, 6, 7, 8, 9], 2, 20, 3, 4)
    assert call.params.seed == 7 and call.params.top_k == 0 and call.params.max_tokens == 4
    assert call.scores_prompt_distribution and not call.record_stability
    assert _call(record_stability_info=True).record_stability
    assert convert.prompt_logprobs_row([-1.0, -2.0, -3.0, -4.0], 2)[3:] == [-3.0, -4.0]
    assert all(math.isnan(v) for v in convert.prompt_logprobs_row([-1.0, -2.0, -3.0, -4.0], 2)[:3])


def _targets(ids, sparse: bool = False):
    arr = np.asarray(ids, dtype=np.int64)
    if not sparse:
        return {"data": arr.reshape(-1).tolist(), "dtype": "int64", "shape": list(arr.shape)}
    crow, col, data = [0], [], []
    for row in arr:
        for j, v in enumerate(row):
            if v != -1:
                col.append(j)
                data.append(int(v))
        crow.append(len(data))
    return {"data": data, "dtype": "int64", "shape": list(arr.shape), "sparse_crow_indices": crow,
            "sparse_col_indices": col}


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (dict(_targets([[1]] * 4), dtype="float32"), "int64"),
        ({"data": [1, 2, 3, 4], "dtype": "int64", "shape": [4]}, "2-D"),
        (_targets([[1]] * 3), "4 rows"),
        (_targets([[-1]] * 4), "names no token id"),
        (_targets([[1], [2], [VOCAB], [3]]), "outside the vocabulary"),
        (_targets([[r * 6 + j for j in range(6)] for r in range(4)]), "24 distinct"),
        (_targets([[i for i in range(21)]] * 4), "K = 21 columns; at most 20"),
        ({"data": [1], "dtype": "int64", "shape": [4, 10**13], "sparse_crow_indices": [0, 1, 1, 1, 1],
          "sparse_col_indices": [0]}, "K = 10000000000000 columns"),
        (dict(_targets([[1, -1]] * 4, sparse=True), sparse_col_indices=[5, 5, 5, 5]), "sparse CSR"),
    ],
)
def test_target_prompt_logprobs_is_checked_as_the_sdk_documents_it(raw, match) -> None:
    with pytest.raises(InvalidInput, match=match):
        _call(target_prompt_logprobs=raw)


def test_sample_output_fills_every_field_the_sdk_decodes() -> None:
    """A response with everything asked for decodes through the schema as the SDK reads it:
    sentinel rows (id 0, -99999) where nothing was scored, the request's target layout kept."""
    from floe.backend.runs import PromptScores
    from floe.types import SampledGroup, SampledSequence

    ids = [[10, -1], [-1, -1], [11, 12], [-1, 13]]
    for sparse in (False, True):
        call = _call(prompt_logprobs=True, prompt_logprobs_last_n=3, topk_prompt_logprobs=2, topk_sample_logprobs=2,
                     prompt_alt_tokens_k=3, target_prompt_logprobs=_targets(ids, sparse))
        scores = PromptScores(
            topk_ids=np.arange(8).reshape(4, 2), topk_logprobs=-np.arange(8, dtype=np.float32).reshape(4, 2),
            target_logprobs=np.full((4, 2), -2.5, dtype=np.float32), alt_tokens=np.ones((4, 3), dtype=np.int64),
            alt_logprobs=np.full((4, 3), -0.25, dtype=np.float32),
        )
        group = SampledGroup([5, 6, 7, 8, 9], [SampledSequence(tokens=[3, 4], logprobs=[-0.5, -0.25], stop_reason="stop_token", weights_version=1,
                                              top_logprobs=[[(3, -0.5)], [(4, -0.25), (9, -3.0)]])])
        prompt_lp = convert.prompt_logprobs_row([-1.0, -2.0, -3.0, -4.0], call.last_n)
        out = schema.SampleResponse()
        out.ParseFromString(convert.sample_output(group, call, prompt_lp, scores))
        seq = out.sequences[0]
        topk_s = np.frombuffer(seq.topk_sampled_logprobs.logprobs, dtype=np.float32).reshape(2, 2)
        assert topk_s[0].tolist() == [-0.5, convert.TOPK_MASK_LOGPROB]  # an empty slot is the SDK's sentinel
        lp = np.frombuffer(out.prompt_logprobs, dtype=np.float32)
        assert np.isnan(lp[:2]).all() and lp[2:].tolist() == [-2.0, -3.0, -4.0]
        tp = out.topk_prompt_logprobs
        assert (tp.length, tp.k) == (5, 2)
        tp_ids = np.frombuffer(tp.token_ids, dtype=np.int32).reshape(5, 2)
        tp_lps = np.frombuffer(tp.logprobs, dtype=np.float32).reshape(5, 2)
        assert (tp_ids[:2] == 0).all() and (tp_lps[:2] == convert.TOPK_MASK_LOGPROB).all()  # position 0, before last_n
        assert tp_ids[2:].tolist() == [[2, 3], [4, 5], [6, 7]] and tp_lps[4].tolist() == [-6.0, -7.0]
        target = out.target_prompt_logprobs
        assert list(target.shape) == [4, 2] and target.dtype == schema.DTYPE_FLOAT32
        if sparse:
            assert target.HasField("sparse_csr")
            assert np.frombuffer(target.sparse_csr.values, dtype=np.float32).tolist() == [-2.5] * 4
            assert np.frombuffer(target.sparse_csr.crow_indices, dtype=np.int64).tolist() == [0, 1, 1, 3, 4]
        else:
            dense = np.frombuffer(target.dense, dtype=np.float32).reshape(4, 2)
            assert dense.tolist() == [[-2.5, 0.0], [0.0, 0.0], [-2.5, -2.5], [0.0, -2.5]]  # 0.0 where -1 was asked
        alt = out.prompt_alt_tokens
        assert list(alt.tokens.shape) == [4, 3] and alt.tokens.dtype == schema.DTYPE_INT64
        assert np.frombuffer(alt.logprobs.dense, dtype=np.float32).tolist() == [-0.25] * 12
