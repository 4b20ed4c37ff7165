"""The Tinker protocol's parts that need no SDK (core suite): wire conversion onto floe's losses
and the per-run ordering of requests by seq_id."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from floe.errors import InvalidInput, StateError
from floe.server.protocols.tinker import convert, schema
from floe.server.protocols.tinker.futures import Futures, Reply, Sequencer


def _request(loss: str, datums: list[tuple[list[int], dict[str, list[float]]]], config: dict | None = None):
    msg = schema.ForwardBackwardRequest()
    msg.model_id, msg.seq_id, msg.loss_fn = "m", 1, loss
    for key, value in (config or {}).items():
        msg.loss_fn_config_v2[key].number = value
    for tokens, inputs in datums:
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        for key, values in inputs.items():
            t = d.loss_fn_inputs[key]
            if key == "target_tokens":
                t.dtype, t.dense = schema.DTYPE_INT64, np.asarray(values, dtype=np.int64).tobytes()
            else:
                t.dtype, t.dense = schema.DTYPE_FLOAT32, np.asarray(values, dtype=np.float32).tobytes()
            t.shape.append(len(values))
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
        ("stable_reinforce", {"target_tokens": [2, 3]}, None, "loss_fn"),
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
    with pytest.raises(StateError, match="seq_id 1"):
        seq.submit(1, _recorder(order, 2), digest=b"b")
    _wait(futures, [first])
    assert order == [1]
    futures.close()


def test_a_future_is_known_only_to_its_owner() -> None:
    futures = Futures(workers=1, max_per_owner=3)
    mine = [futures.new("alice") for _ in range(5)]
    theirs = futures.new("mallory")
    assert futures.known(mine[-1], "alice") and not futures.known(mine[-1], "mallory")
    assert futures.known(theirs, "mallory") and not futures.known(theirs, "alice")
    assert [futures.known(r, "alice") for r in mine] == [False, False, True, True, True]  # each owner's bound
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
