"""Tinker wire data <-> floe types: datums to a `floe.Batch` with a floe loss, samples and
results to the protobuf messages the SDK decodes. Pure conversion, no model.

Loss mapping (Tinker semantics on floe's losses, `aggregation = "sum"`):
* `cross_entropy`: floe `cross_entropy` with the datum's `weights` as per-token weights; when a
  weight is negative (the SDK's custom-loss surrogate sends signed weights), floe `dro` with
  beta 0, advantages = weights and old log-probs 0, which is the same −w·logp.
* `importance_sampling`: floe `importance_sampling` (old log-probs = `logprobs`).
* `ppo`, `cispo`: `clip_low_threshold` / `clip_high_threshold` are bounds on the ratio (default
  0.8 / 1.2); floe's keys are epsilons: clip_low = 1 − low, clip_high = high − 1.
* `dro`: floe `dro` with `beta`.
Datums must be next-token data (target_tokens = model_input shifted by one, as the SDK's
helpers and the cookbook build them); a datum becomes a group whose prompt is its first
input token and whose one sample is `target_tokens`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from floe.errors import InvalidInput
from floe.server.protocols.tinker import schema
from floe.types import Batch, Group, Sample, SampledGroup, SamplingParams

RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro")
SUPPORTED_LOSSES = ("cross_entropy", *RL_LOSSES)
_INPUT_KEYS = {"cross_entropy": {"target_tokens", "weights"}, **{k: {"target_tokens", "logprobs", "advantages"} for k in RL_LOSSES}}
_CONFIG_KEYS = {"cross_entropy": set(), "importance_sampling": set(), "ppo": {"clip_low_threshold", "clip_high_threshold"},
                "cispo": {"clip_low_threshold", "clip_high_threshold"}, "dro": {"beta"}}
DEFAULT_CLIP = (0.8, 1.2)


@dataclass
class FloeCall:
    """One forward/forward_backward chunk as floe sees it."""

    batch: Batch
    loss: str
    loss_config: dict[str, Any]
    lengths: list[int]


def _tensor(field: str, msg: Any) -> np.ndarray:
    """A proto `Tensor` (dense or sparse CSR) as a flat numpy array."""
    dtype = {schema.DTYPE_FLOAT32: np.float32, schema.DTYPE_INT64: np.int64}.get(msg.dtype)
    if dtype is None:
        raise InvalidInput(field, f"dtype {msg.dtype} is not float32 or int64")
    shape = [int(s) for s in msg.shape]
    if msg.HasField("sparse_csr"):
        values = np.frombuffer(msg.sparse_csr.values, dtype=dtype)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
        if len(shape) != 2:
            raise InvalidInput(field, "a sparse tensor must be 2-D")
        dense = np.zeros(shape, dtype=dtype)
        for row in range(shape[0]):
            dense[row, col[crow[row]:crow[row + 1]]] = values[crow[row]:crow[row + 1]]
        return dense.reshape(-1)
    return np.frombuffer(msg.dense, dtype=dtype)


def _tokens(field: str, chunks: Any) -> list[int]:
    out: list[int] = []
    for k, chunk in enumerate(chunks):
        kind = chunk.WhichOneof("chunk") if hasattr(chunk, "WhichOneof") else None
        if kind != "encoded_text":
            raise InvalidInput(f"{field}[{k}]", f"only text chunks are supported by floe, got {kind!r}")
        out.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    return out


def loss_config_of(request: Any) -> dict[str, float | str]:
    """loss_fn_config_v2 (preferred) or the legacy numeric map."""
    if request.loss_fn_config_v2:
        return {k: (v.number if v.WhichOneof("value") == "number" else v.text) for k, v in request.loss_fn_config_v2.items()}
    return dict(request.loss_fn_config)


def _floats(field: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidInput(field, f"must be a finite number, got {value!r}")
    return float(value)


def floe_loss(loss_fn: str, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """floe loss name and config for a Tinker loss_fn and loss_fn_config (InvalidInput on an
    unsupported loss or an unknown key)."""
    if loss_fn not in SUPPORTED_LOSSES:
        raise InvalidInput("loss_fn", f"floe supports {', '.join(SUPPORTED_LOSSES)}; got {loss_fn!r}")
    unknown = sorted(set(config) - _CONFIG_KEYS[loss_fn])
    if unknown:
        allowed = sorted(_CONFIG_KEYS[loss_fn]) or "none"
        raise InvalidInput(f"loss_fn_config.{unknown[0]}", f"unknown key for {loss_fn}; allowed keys: {allowed}")
    out: dict[str, Any] = {"aggregation": "sum"}
    if loss_fn in ("ppo", "cispo"):
        low = _floats("loss_fn_config.clip_low_threshold", config.get("clip_low_threshold", DEFAULT_CLIP[0]))
        high = _floats("loss_fn_config.clip_high_threshold", config.get("clip_high_threshold", DEFAULT_CLIP[1]))
        if not 0 <= low <= 1:
            raise InvalidInput("loss_fn_config.clip_low_threshold", f"a lower bound on the ratio in [0, 1], got {low}")
        if high < 1:
            raise InvalidInput("loss_fn_config.clip_high_threshold", f"an upper bound on the ratio >= 1, got {high}")
        out.update(clip_low=1.0 - low, clip_high=high - 1.0)
    if loss_fn == "dro":
        if "beta" not in config:
            raise InvalidInput("loss_fn_config.beta", "dro needs beta (the weight of the squared log-ratio penalty)")
        out["beta"] = _floats("loss_fn_config.beta", config["beta"])
    return loss_fn, out


def forward_request_to_floe(request: Any) -> FloeCall:
    """A decoded `ForwardBackwardRequest` chunk as one floe call (InvalidInput naming the
    datum field that does not fit)."""
    if not request.data:
        raise InvalidInput("data", "no datums")
    loss, config = floe_loss(request.loss_fn, loss_config_of(request))
    groups: list[Group] = []
    signed = False
    for i, datum in enumerate(request.data):
        where = f"data[{i}]"
        tokens = _tokens(f"{where}.model_input", datum.model_input)
        n = len(tokens)
        if n == 0:
            raise InvalidInput(f"{where}.model_input", "is empty")
        keys = set(datum.loss_fn_inputs.keys())
        extra = sorted(keys - _INPUT_KEYS[loss])
        if extra:
            raise InvalidInput(f"{where}.loss_fn_inputs.{extra[0]}",
                               f"not used by {loss}; floe accepts {sorted(_INPUT_KEYS[loss])}")
        inputs = {}
        for key in _INPUT_KEYS[loss]:
            if key == "weights" and key not in keys:
                inputs[key] = np.ones(n, dtype=np.float32)
                continue
            if key not in keys:
                raise InvalidInput(f"{where}.loss_fn_inputs.{key}", f"{loss} needs {key}")
            value = _tensor(f"{where}.loss_fn_inputs.{key}", datum.loss_fn_inputs[key])
            if value.size != n:
                raise InvalidInput(f"{where}.loss_fn_inputs.{key}", f"has {value.size} values for {n} input tokens")
            inputs[key] = value
        target = [int(t) for t in inputs["target_tokens"]]
        if tokens[1:] != target[:-1]:
            raise InvalidInput(
                f"{where}.loss_fn_inputs.target_tokens",
                "floe scores next-token targets: target_tokens must be model_input shifted by one "
                "(model_input = seq[:-1], target_tokens = seq[1:])",
            )
        if loss == "cross_entropy":
            weights = [float(w) for w in inputs["weights"]]
            signed = signed or any(w < 0 for w in weights)
            sample = Sample(tokens=target, weights=weights)
        else:
            sample = Sample(tokens=target, logprobs=[float(x) for x in inputs["logprobs"]],
                            advantage=[float(x) for x in inputs["advantages"]])
        groups.append(Group(prompt=tokens[:1], samples=[sample]))
    if signed:  # −w·logp with signed w: dro at beta 0 (see the module docstring)
        for g in groups:
            s = g.samples[0]
            g.samples[0] = Sample(tokens=s.tokens, logprobs=[0.0] * len(s.tokens), advantage=s.weights)
        loss, config = "dro", {"aggregation": "sum", "beta": 0.0}
    return FloeCall(Batch(groups), loss, config, [len(g.samples[0].tokens) for g in groups])


def forward_output(logprobs: list[list[float]], metrics: dict[str, float]) -> bytes:
    """`ForwardBackwardOutput`: one ArrayRecord with per-datum `logprobs`, and the metrics."""
    out = schema.ForwardBackwardOutput()
    out.loss_fn_output_type = "ArrayRecord"
    record = out.loss_fn_outputs.add()
    record.type_tag = "ArrayRecord"
    record.num_datums = len(logprobs)
    field = record.fields["logprobs"]
    field.dtype = schema.DTYPE_FLOAT32
    arrays = [np.asarray(lp, dtype=np.float32) for lp in logprobs]
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64).tobytes()
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    return out.SerializeToString()


def sampling_params(raw: Any, prompt_len: int, max_context: int) -> SamplingParams:
    """floe SamplingParams from the request's `sampling_params` JSON (stop absent = at EOS;
    [] = never; strings = stop strings; ints = stop token ids; top_k -1 = off)."""
    if not isinstance(raw, dict):
        raise InvalidInput("sampling_params", "must be an object")
    known = {"max_tokens", "seed", "stop", "temperature", "top_k", "top_p"}
    unknown = sorted(set(raw) - known - {"type"})
    if unknown:
        raise InvalidInput(f"sampling_params.{unknown[0]}", f"unknown key; allowed: {sorted(known)}")
    stop = raw.get("stop")
    stop_strings: list[str] = []
    stop_ids: list[int] = []
    at_eos = True
    if isinstance(stop, str):
        stop_strings = [stop]
    elif isinstance(stop, list):
        if not stop:
            at_eos = False
        elif all(isinstance(s, str) for s in stop):
            stop_strings = list(stop)
        elif all(type(s) is int for s in stop):
            stop_ids = list(stop)
        else:
            raise InvalidInput("sampling_params.stop", "a string, a list of strings or a list of token ids")
    elif stop is not None:
        raise InvalidInput("sampling_params.stop", "a string, a list of strings or a list of token ids")
    max_tokens = raw.get("max_tokens")
    if max_tokens is None:
        max_tokens = max(1, max_context - prompt_len)
    top_k = raw.get("top_k", -1)
    return SamplingParams(
        max_tokens=max_tokens, temperature=raw.get("temperature", 1.0), top_p=raw.get("top_p", 1.0),
        top_k=0 if top_k == -1 else top_k, stop_token_ids=stop_ids, stop=stop_strings, seed=raw.get("seed"),
        stop_at_eos=at_eos,
    )


def _topk(msg: Any, rows: list[list[tuple[int, float]]], k: int) -> None:
    ids = np.zeros((len(rows), k), dtype=np.int32)
    lps = np.full((len(rows), k), -np.inf, dtype=np.float32)
    for r, row in enumerate(rows):
        for j, (tok, lp) in enumerate(row[:k]):
            ids[r, j], lps[r, j] = tok, lp
    msg.token_ids, msg.logprobs, msg.k, msg.length = ids.tobytes(), lps.tobytes(), k, len(rows)


def sample_output(group: SampledGroup, prompt_logprobs: list[float] | None, topk_sample: int) -> bytes:
    """`SampleResponse` for one prompt's samples (`prompt_logprobs`: NaN where not scored)."""
    out = schema.SampleResponse()
    for s in group.samples:
        seq = out.sequences.add()
        seq.stop_reason = schema.STOP_REASON_LENGTH if s.stop_reason == "length" else schema.STOP_REASON_STOP
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
        if topk_sample and s.top_logprobs is not None:
            _topk(seq.topk_sampled_logprobs, s.top_logprobs, topk_sample)
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    out.prompt_cache_hit_tokens = 0
    return out.SerializeToString()
