"""The wire format round-trips every request and result exactly, is plain safetensors, and
rejects malformed messages with a WireError naming the field (never another exception)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import safetensors.numpy

from floe import Batch, Group, InvalidInput, Sample, SamplingParams
from floe.protocol import wire
from floe.types import (
    ForwardBackwardResult,
    ForwardResult,
    Info,
    OptimStepResult,
    SampledGroup,
    SampledSequence,
    SampleResult,
    StateResult,
    SyncResult,
)


def mixed_batch() -> Batch:
    return Batch([
        Group([1, 2, 3], [
            Sample([4, 5], logprobs=[-0.5, -1.25], advantage=0.1, weights=[1.0, 0.0], ref_logprobs=[-0.4, -1.0], temperature=0.7),
            Sample([6], logprobs=[np.float32(-0.3).item()], advantage=[2.0], temperature=1),
            Sample([7, 8, 9]),
        ]),
        Group([10], [Sample([11, 2**40], advantage=-1)]),  # an id beyond int32 travels as int64
        Group([12, 13], []),
    ])


def test_batch_round_trip_is_exact_and_keeps_structure() -> None:
    batch = mixed_batch()
    body = wire.encode_request("forward_backward", {"batch": batch, "loss": "ppo", "loss_config": {"clip_low": 0.1}, "temperature": 0.7})
    args = wire.decode_request("forward_backward", body)
    assert args["batch"] == batch  # dataclass equality: every list, None and scalar-vs-list kept
    assert (args["loss"], args["loss_config"], args["temperature"]) == ("ppo", {"clip_low": 0.1}, 0.7)
    assert type(args["batch"].groups[0].samples[0].advantage) is float
    assert isinstance(args["batch"].groups[0].samples[1].advantage, list)


def test_temperatures_round_trip_exactly_and_only_where_stated() -> None:
    """Sample.temperature and SampledSequence.temperature cross the wire unchanged (None stays
    None, 0.7 stays the float 0.7), as a length-1 optional field per sample."""
    batch = mixed_batch()
    _, tensors = wire.unpack(wire.encode_request("forward", {"batch": batch}))
    assert tensors["temperature.present"].tolist() == [1, 1, 0, 0]
    assert tensors["temperature"].dtype == np.float64  # 0.7 is not exact in f32
    decoded = wire.decode_request("forward", wire.encode_request("forward", {"batch": batch}))["batch"]
    temps = [s.temperature for g in decoded.groups for s in g.samples]
    assert temps == [0.7, 1.0, None, None] and type(temps[0]) is float
    seq = SampledSequence([3], [-0.5], "length", 1, 0.7)
    result = wire.decode_result("sample", wire.encode_result("sample", SampleResult([SampledGroup([1], [seq])], 1, 1, 0.1)))
    assert result.groups[0].samples[0].temperature == 0.7 and result.temperature == 0.7
    with pytest.raises(InvalidInput) as e:
        wire.encode_request("forward", {"batch": Batch([Group([1], [Sample([2]), Sample([3], temperature="hot")])])})  # type: ignore[arg-type]
    assert e.value.field == "batch.groups[0].samples[1].temperature"
    _, tensors = wire.unpack(wire.encode_request("forward", {"batch": batch}))
    broken = dict(tensors, **{"temperature.lengths": np.array([2, 0], np.int64), "temperature": np.zeros(2)})
    with pytest.raises(wire.WireError) as e:
        wire.decode_request("forward", wire.pack({"v": 1, "op": "forward", "args": {}}, broken))
    assert e.value.field == "body.temperature"  # a temperature is one value per sample


def test_prompts_travel_once_per_group_and_floats_pick_exact_dtype() -> None:
    prompt = list(range(100))
    batch = Batch([Group(prompt, [Sample([1, 2], logprobs=[-0.5, -0.25]) for _ in range(8)])])
    _, tensors = wire.unpack(wire.encode_request("forward", {"batch": batch}))
    assert tensors["prompt"].size == 100 and tensors["prompt"].dtype == np.int32  # once, not 8 times
    assert tensors["logprobs"].dtype == np.float32  # exact in f32
    inexact = Batch([Group([1], [Sample([2], logprobs=[0.1])])])
    _, tensors = wire.unpack(wire.encode_request("forward", {"batch": inexact}))
    assert tensors["logprobs"].dtype == np.float64  # 0.1 is not a float32: sent as f64, unchanged


def test_body_is_standard_safetensors() -> None:
    body = wire.encode_request("forward", {"batch": mixed_batch()})
    loaded = safetensors.numpy.load(body)
    _, ours = wire.unpack(body)
    assert loaded.keys() == ours.keys()
    for k in loaded:
        np.testing.assert_array_equal(loaded[k], ours[k])
    # and a blob written by safetensors itself decodes
    blob = safetensors.numpy.save({"x": np.arange(3, dtype=np.int64)}, metadata={"floe": json.dumps({"v": 1})})
    control, tensors = wire.unpack(blob)
    assert control == {"v": 1} and tensors["x"].tolist() == [0, 1, 2]


def test_sample_request_and_json_ops_round_trip() -> None:
    params = SamplingParams(max_tokens=5, temperature=0.5, stop=["x"], seed=3)
    args = wire.decode_request("sample", wire.encode_request("sample", {"prompts": [[1, 2], [3]], "n": 4, "params": params}))
    assert args == {"prompts": [[1, 2], [3]], "n": 4, "params": params}
    for op, kwargs in [("optim_step", {}), ("save_state", {"name": "a"}), ("delete_state", {"name": "a"}), ("export_hf", {"path": "/x"}), ("info", {})]:
        assert wire.decode_request(op, wire.encode_request(op, kwargs)) == kwargs


@pytest.mark.parametrize("op, result", [
    ("sample", SampleResult([
        SampledGroup([1, 2], [SampledSequence([3, 4], [-0.5, -0.75], "stop_token", 2, 0.7), SampledSequence([5], [-1.0], "length", 2, 0.7)]),
        SampledGroup([6], [SampledSequence([7], [-2.0], "stop_string", 2, 0.7)]),
    ], weights_version=2, num_tokens=4, seconds=0.25)),
    ("sample", SampleResult([SampledGroup([1], [SampledSequence([3], [-0.5], "length", 0)])], 0, 1, 0.1)),  # unstated
    ("forward", ForwardResult([[[-0.5, -0.25], [-1.0]], [[-3.0]]], [[[1.0, 2.0], [0.5]], [[0.25]]])),
    ("forward", ForwardResult([[[-0.5]]])),
    ("forward", ForwardResult([[[-0.5]]], None, {"seconds": 0.25, "sequence_tokens": 3.0, "tokens_per_second": 12.0})),
    ("forward_backward", ForwardBackwardResult({"loss": 0.1, "tokens": 3.0}, [[[-0.5, -0.1]]], "ppo", {"clip_low": 0.2, "kl": {"coef": 0.0}})),
    ("optim_step", OptimStepResult(3, 1e-5, 0.5, 2)),
    ("sync_weights", SyncResult(4, 1024, 0.01)),
    ("load_state", StateResult("a", "/s/a", 3, 4)),
    ("delete_state", StateResult("a", "/s/a", 3, 4)),
    ("list_states", ["a", "b"]),
    ("export_hf", "/tmp/x"),
    ("info", Info("m", ["policy"], 1, 1, 1, 100, 1024, "float32", "cpu", {"losses": ["ppo"]})),
])
def test_results_round_trip(op: str, result: object) -> None:
    assert wire.decode_result(op, wire.encode_result(op, result)) == result


@pytest.mark.parametrize("kwargs, field", [
    ({"prompts": "abc"}, "prompts"),
    ({"prompts": [[1, 2], 3]}, "prompts[1]"),
    ({"prompts": [[1, 2.5]]}, "prompts[0]"),
    ({"prompts": [[1]], "params": {"max_tokens": 3}}, "params"),
])
def test_client_side_type_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidInput) as e:
        wire.encode_request("sample", kwargs)
    assert e.value.field == field


def test_batch_type_errors_name_the_sample() -> None:
    batch = Batch([Group([1], [Sample([1]), Sample([2], logprobs=[None])])])  # type: ignore[list-item]
    with pytest.raises(InvalidInput) as e:
        wire.encode_request("forward", {"batch": batch})
    assert e.value.field == "batch.groups[0].samples[1].logprobs"
    with pytest.raises(InvalidInput) as e:
        wire.encode_request("forward", {"batch": [1, 2]})
    assert e.value.field == "batch"


def _frame(header: dict, data: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


GOOD_META = {"__metadata__": {"floe": json.dumps({"v": 1, "op": "forward", "args": {}})}}


@pytest.mark.parametrize("body", [
    b"",
    b"\x01\x02",
    struct.pack("<Q", 2**63) + b"{}",
    struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc",
    _frame([1, 2]),  # type: ignore[arg-type]
    _frame({}),
    _frame({"__metadata__": {"floe": "{not json"}}),
    _frame({"__metadata__": {"floe": json.dumps({"v": 99})}}),
    _frame({**GOOD_META, "x": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]}}, b"\0\0"),
    _frame({**GOOD_META, "x": {"dtype": "I32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
    _frame({**GOOD_META, "x": {"dtype": "I32", "shape": [2**40, 2**40], "data_offsets": [0, 4]}}, b"\0" * 4),
    _frame({**GOOD_META, "x": {"dtype": "I32", "shape": [1], "data_offsets": [0, 400]}}, b"\0" * 4),
    _frame({**GOOD_META, "x": "nope"}),
    _frame({**GOOD_META, "group_sizes": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}, struct.pack("<q", 2**40)),
    _frame({**GOOD_META, "group_sizes": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
])
def test_malformed_messages_raise_wire_errors(body: bytes) -> None:
    with pytest.raises(InvalidInput):  # WireError is an InvalidInput; nothing else escapes
        wire.decode_request("forward", body)


def test_inconsistent_lengths_are_rejected() -> None:
    body = wire.encode_request("forward", {"batch": mixed_batch()})
    control, tensors = wire.unpack(body)
    for name, bad in [("tokens.lengths", np.array([1, 1, 1, 1], np.int64)), ("group_sizes", np.array([5, 0, 0], np.int64)),
                      ("prompt", np.zeros(2, np.float32)), ("logprobs.present", np.array([2, 0, 0, 0], np.uint8))]:
        broken = dict(tensors, **{name: bad})
        with pytest.raises(wire.WireError):
            wire.decode_request("forward", wire.pack(control, broken))
    for i in (1, 9, len(body) // 2, len(body) - 1):
        with pytest.raises(wire.WireError):
            wire.decode_request("forward", body[:i])


def test_json_results_must_have_their_type() -> None:
    for op, payload in [("list_states", {"a": 1}), ("export_hf", [1]), ("info", {"model": "m"}), ("optim_step", [1, 2])]:
        with pytest.raises(wire.WireError) as e:
            wire.decode_result(op, wire.pack({"v": 1, "op": op, "result": payload}, {}))
        assert e.value.field == "body.result"


def test_dataclass_arguments_are_checked_on_arrival() -> None:
    body = wire.pack({"v": 1, "op": "sample", "args": {"n": 1, "params": {"max_tokens": 3, "top_q": 1}}},
                     wire.unpack(wire.encode_request("sample", {"prompts": [[1]]}))[1])
    with pytest.raises(InvalidInput) as e:
        wire.decode_request("sample", body)
    assert e.value.field == "params" and "top_q" in e.value.message
    with pytest.raises(InvalidInput) as e:
        wire.decode_request("info", wire.pack({"v": 1, "op": "info", "args": {"verbose": True}}, {}))
    assert e.value.field == "body.args" and "verbose" in e.value.message
