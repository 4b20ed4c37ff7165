"""Tinker ForwardBackwardRequest protobufs built by hand, as the SDK encodes them: the one
builder the tests that talk to `convert` or to a server without the SDK share."""

from __future__ import annotations

import numpy as np

from floe.server.protocols.tinker import schema


def request(loss: str, config: dict[str, float] | None = None, forward_only: bool = False,
            model_id: str = "m", seq_id: int = 1) -> schema.ForwardBackwardRequest:
    """An empty request for `loss` with `config` as loss_fn_config_v2 numbers; add datums with add_datum."""
    msg = schema.ForwardBackwardRequest()
    msg.model_id, msg.seq_id, msg.loss_fn, msg.forward_only = model_id, seq_id, loss, forward_only
    for key, value in (config or {}).items():
        msg.loss_fn_config_v2[key].number = value
    return msg


def add_datum(msg: schema.ForwardBackwardRequest, tokens: list[int], inputs: dict[str, list[float]],
              spans: list[tuple[str, str, int, int]] | None = None) -> None:
    """One Datum on `msg`: model_input `tokens`, the given loss_fn_inputs (`target_tokens` int64,
    the rest float32, each shape (len,)), and `spans` (kind, sequence_id, offset, length) as
    loss_fn_input_spans (with model_input_spans, as the SDK sends)."""
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
    for key, values in inputs.items():
        t = d.loss_fn_inputs[key]
        if key == "target_tokens":
            t.dtype, t.dense = schema.DTYPE_INT64, np.asarray(values, dtype=np.int64).tobytes()
        else:
            t.dtype, t.dense = schema.DTYPE_FLOAT32, np.asarray(values, dtype=np.float32).tobytes()
        t.shape.append(len(values))
    for kind, sequence_id, offset, length in spans or []:
        part = getattr(d.loss_fn_input_spans.add(), kind)
        part.sequence_id, part.offset, part.length = sequence_id, offset, length
        whole = getattr(d.model_input_spans.add(), kind)
        whole.sequence_id, whole.offset, whole.length = sequence_id, offset, length
