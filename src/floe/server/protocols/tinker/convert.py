"""Tinker wire data <-> floe types: datums to a `floe.Batch` with a floe loss, request JSON to
checked floe arguments, samples and results to the protobuf messages the SDK decodes. Pure
conversion and checking, no model.

Loss mapping (Tinker semantics on floe's losses, `aggregation = "sum"`; docs/losses.md):
* `cross_entropy`: floe `cross_entropy` with the datum's `weights` as per-token weights; when a
  weight is negative (the SDK's custom-loss surrogate sends signed weights), floe `dro` with
  beta 0, advantages = weights and old log-probs 0, which is the same −w·logp.
* `importance_sampling`: floe `importance_sampling` (old log-probs = `logprobs`).
* `ppo`, `cispo`, `gspo`: `clip_low_threshold` / `clip_high_threshold` are bounds on the ratio
  (default 0.8 / 1.2); floe's keys are epsilons: clip_low = 1 − low, clip_high = high − 1.
* `gspo`: floe `gspo` with `ratio_gradient = "token"` (GSPO-token, as Tinker defines it). The
  tokens of the sequence ratio (`sequence_ratio_mask` ≠ 0; absent: the tokens with a nonzero
  advantage) become the sample's 0/1 weights; a nonzero advantage outside them is refused (its
  loss would need the ratio of tokens floe does not train).
* `dro`: floe `dro` with `beta`.
* `stable_reinforce` (floe's definition; Tinker publishes none): truncated-importance-sampling
  REINFORCE, ℓ_t = −sg(min(exp(logp_t − q_t), C))·A_t·logp_t, which is floe `cispo` with the
  ratio clipped to [0, C] (clip_low 1, clip_high C − 1; C = `loss_fn_config.ratio_cap`,
  default 2). q_t is the log-prob the server's sampler recorded for the sampled token the
  datum's `loss_fn_input_spans` name at position t (`stability.StabilityRecords`), never the
  client's copy; positions without sampled provenance must have advantage 0. `kl_coeff` (which
  the SDK's docs name) is refused unless 0: Tinker does not say what it penalises.
* `custom` is refused (NOT_SERVED_LOSSES says why).

`loss_fn_inputs`: a loss takes exactly its inputs (REQUIRED_INPUTS, OPTIONAL_INPUTS); any other
key is refused naming it, as Tinker's service takes only the inputs a loss reads (the cookbook
drops its `mask` before every forward_backward, rl/train.py `_remove_mask`; the SDK sends only
`target_tokens` and `weights` for custom losses). Every number (inputs, `loss_fn_config`) must
be finite. A datum becomes a group whose prompt is its first input token and whose one sample
is the input shifted by one plus the last target: the next-token targets. A position whose
target is not the next input token (rl_loop.py sends 0 on prompt positions) is scored exactly
by a second, gradient-free pass (`FloeCall.retarget`; the service patches the log-probs), and
in forward_backward it may carry no loss (weight, advantage, ratio mask, dro's penalty): floe's
scoring back-propagates through next-token targets only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import numpy as np

from floe.backend.validation import MAX_TOP_LOGPROBS, SEED_LIMIT, check_stops
from floe.errors import InvalidInput
from floe.models.lora import LoraSpec
from floe.server.protocols.tinker import schema
from floe.server.protocols.tinker.stability import SequenceRecord, missing_record_message
from floe.types import Batch, Group, Sample, SampledGroup, SamplingParams

if TYPE_CHECKING:
    from floe.backend.runs import PromptScores

RL_LOSSES = ("importance_sampling", "ppo", "cispo", "gspo", "dro", "stable_reinforce")
SUPPORTED_LOSSES = ("cross_entropy", *RL_LOSSES)
_RL_INPUTS = frozenset({"target_tokens", "logprobs", "advantages"})
REQUIRED_INPUTS: dict[str, frozenset[str]] = {"cross_entropy": frozenset({"target_tokens"}),
                                              **{k: _RL_INPUTS for k in RL_LOSSES},
                                              # behaviour log-probs come from the server's record
                                              "stable_reinforce": frozenset({"target_tokens", "advantages"})}
OPTIONAL_INPUTS: dict[str, frozenset[str]] = {"cross_entropy": frozenset({"weights"}),
                                              "gspo": frozenset({"sequence_ratio_mask"}),
                                              "stable_reinforce": frozenset({"logprobs"})}
_INT_INPUTS = frozenset({"target_tokens"})
_CLIP_KEYS = frozenset({"clip_low_threshold", "clip_high_threshold"})
CONFIG_KEYS: dict[str, frozenset[str]] = {"cross_entropy": frozenset(), "importance_sampling": frozenset(),
                                          "ppo": _CLIP_KEYS, "cispo": _CLIP_KEYS, "gspo": _CLIP_KEYS,
                                          "dro": frozenset({"beta"}),
                                          "stable_reinforce": frozenset({"ratio_cap", "kl_coeff"})}
DEFAULT_CLIP = (0.8, 1.2)
DEFAULT_RATIO_CAP = 2.0  # stable_reinforce's C: the importance weight is min(r, C)
MAX_SEQUENCE_ID = 256  # characters of a provenance span's sequence_id

NOT_SERVED_LOSSES = {
    "custom": (
        "server-side custom losses (ServiceClient.create_custom_loss) are not served (this server's client config "
        "says custom_loss_server_side: false); forward_backward_custom with a callable or a client-side LossHandle "
        "works"
    ),
}
KL_COEFF_REFUSED = (
    "floe's stable_reinforce has no KL term and cannot honour a nonzero kl_coeff: Tinker does not publish what it "
    "penalises (which divergence, against which model, with which estimator). Leave it out or 0; for a KL to a "
    "reference model use tinker-cookbook's kl_penalty_coef (folded into the advantages)"
)
_PER_TOKEN_CLIP = ("per-token clip thresholds are not supported by floe; give one bound for the whole call as "
                   "loss_fn_config.{key}")


@dataclass
class FloeCall:
    """One forward/forward_backward chunk as floe sees it. `retarget[i]`: datum i's positions
    whose target is not the next input token, and those targets (their log-probs come from a
    second pass, `RunManager.target_logprobs`; the batch scores the next input token there)."""

    batch: Batch
    loss: str
    loss_config: dict[str, Any]
    lengths: list[int]
    retarget: list[tuple[list[int], list[int]]] = dataclass_field(default_factory=list)

    def target_queries(self) -> list[tuple[list[int], list[int], list[int]]]:
        """(model input, positions, targets) of each datum with retargeted positions."""
        out = []
        for g, (positions, targets) in zip(self.batch.groups, self.retarget):
            if positions:
                out.append((g.prompt + g.samples[0].tokens[:-1], positions, targets))
        return out

    def patched(self, logprobs: list[list[float]], exact: list[list[float]]) -> list[list[float]]:
        """`logprobs` (one list per datum, from the batch) with the retargeted positions' values
        replaced by `exact` (the answers to `target_queries`, in order)."""
        answers = iter(exact)
        out = []
        for values, (positions, _) in zip(logprobs, self.retarget):
            if positions:
                values = list(values)
                for p, v in zip(positions, next(answers)):
                    values[p] = v
            out.append(values)
        return out


def finite_number(field: str, value: Any) -> float:
    """`value` as a float when it is an int or float (not a bool) and finite; InvalidInput
    naming `field` otherwise (NaN, ±Infinity, strings, null, huge ints)."""
    if type(value) not in (int, float):
        raise InvalidInput(field, f"must be a finite number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        raise InvalidInput(field, f"must be a finite number, got {value!r}") from None
    if not math.isfinite(number):
        raise InvalidInput(field, f"must be a finite number, got {value!r}")
    return number


def _int_in(field: str, value: Any, lo: int, hi: int, what: str = "") -> int:
    """An int (not a bool) in [lo, hi]; InvalidInput naming `field` otherwise."""
    if type(value) is not int or not lo <= value <= hi:
        raise InvalidInput(field, f"must be an integer in [{lo}, {hi}]{what}, got {value!r}")
    return value


# -- forward / forward_backward -------------------------------------------------------------


def _from_bytes(field: str, raw: bytes, dtype: Any, what: str) -> np.ndarray:
    """`raw` as a flat array of `dtype`; InvalidInput naming `field` when its length is not a
    whole number of values (np.frombuffer's ValueError would be a 500)."""
    size = np.dtype(dtype).itemsize
    if len(raw) % size:
        raise InvalidInput(field, f"has {len(raw)} bytes, not a multiple of {size}: {what} are packed "
                                  f"little-endian {np.dtype(dtype).name}, {size} bytes each")
    return np.frombuffer(raw, dtype=dtype)


def _tensor(field: str, msg: Any, key: str, n: int) -> np.ndarray:
    """A proto `Tensor` (dense or sparse CSR) holding one value per input token, as a flat array:
    int64 for target_tokens, float32 (finite) for everything else."""
    want = schema.DTYPE_INT64 if key in _INT_INPUTS else schema.DTYPE_FLOAT32
    if msg.dtype != want:
        raise InvalidInput(field, f"must be {'int64' if key in _INT_INPUTS else 'float32'}, got dtype {msg.dtype}")
    dtype = np.int64 if key in _INT_INPUTS else np.float32
    shape = [int(s) for s in msg.shape]
    if len(shape) > 1:
        raise InvalidInput(field, f"has shape {shape}: floe takes one value per input token, shape ({n},); 2-D "
                                  "(N, K) inputs (several targets per position, as top-k distillation sends) are "
                                  "not supported")
    if msg.HasField("sparse_csr"):
        raise InvalidInput(field, "a sparse tensor must be 2-D, which floe does not support; send it dense")
    values = _from_bytes(field, msg.dense, dtype, "dense values")
    if values.size != n:
        raise InvalidInput(field, f"has {values.size} values for {n} input tokens")
    if dtype is np.float32 and not np.isfinite(values).all():
        bad = int(np.flatnonzero(~np.isfinite(values))[0])
        raise InvalidInput(f"{field}[{bad}]", f"must be a finite number, got {values[bad]}")
    return values


def _tokens(field: str, chunks: Any) -> list[int]:
    out: list[int] = []
    for k, chunk in enumerate(chunks):
        kind = chunk.WhichOneof("chunk") if hasattr(chunk, "WhichOneof") else None
        if kind != "encoded_text":
            raise InvalidInput(f"{field}[{k}]", f"only text chunks are supported by floe, got {kind!r}")
        out.extend(_from_bytes(f"{field}[{k}].tokens", chunk.encoded_text.tokens, np.int32, "token ids").tolist())
    return out


def check_forward_tokens(request: Any, vocab_size: int) -> None:
    """The token ids of a decoded `ForwardBackwardRequest` (each datum's model_input chunks and
    target_tokens) in [0, vocab_size), and every dense input a whole number of values, checked
    from the request before it is queued; InvalidInput naming the request's field, e.g.
    `data[0].model_input.chunks[1].tokens[3]`.
    (The rest is checked when the request's turn comes: stable_reinforce consumes the stability
    records it reads, so converting twice would not do.)"""
    for i, datum in enumerate(request.data):
        where = f"data[{i}]"
        n = 0
        for k, chunk in enumerate(datum.model_input):
            kind = chunk.WhichOneof("chunk") if hasattr(chunk, "WhichOneof") else None
            if kind != "encoded_text":
                raise InvalidInput(f"{where}.model_input[{k}]", f"only text chunks are supported by floe, got {kind!r}")
            tokens_field = f"{where}.model_input.chunks[{k}].tokens"
            ids = _from_bytes(tokens_field, chunk.encoded_text.tokens, np.int32, "token ids")
            n += ids.size
            _check_ids(tokens_field, ids, vocab_size)
        if "target_tokens" in datum.loss_fn_inputs and n:
            field = f"{where}.loss_fn_inputs.target_tokens"
            target = _tensor(field, datum.loss_fn_inputs["target_tokens"], "target_tokens", n)
            _check_ids(field, target, vocab_size)
        for key, tensor in datum.loss_fn_inputs.items():  # whole values only, so the seq is refused now
            size = _DTYPE_BYTES.get(tensor.dtype)
            if size is not None and not tensor.HasField("sparse_csr"):
                _from_bytes(f"{where}.loss_fn_inputs.{key}", tensor.dense, f"<{'i' if size == 8 else 'f'}{size}",
                            "dense values")


_DTYPE_BYTES = {schema.DTYPE_INT64: 8, schema.DTYPE_FLOAT32: 4}


def _check_ids(field: str, ids: np.ndarray, vocab_size: int) -> None:
    """`check_vocab` for an array of ids (no Python loop over them)."""
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise InvalidInput(f"{field}[{i}]", f"token id {int(ids[i])} is outside the base model's vocabulary "
                           f"[0, {vocab_size})")


def loss_config_of(request: Any) -> dict[str, Any]:
    """loss_fn_config_v2 (preferred when set, as the SDK says) or the legacy numeric map, raw:
    numbers, strings, or None for a v2 value that carries neither (checked by `floe_loss`)."""
    if request.loss_fn_config_v2:
        out: dict[str, Any] = {}
        for key, value in request.loss_fn_config_v2.items():
            kind = value.WhichOneof("value")
            out[key] = value.number if kind == "number" else value.text if kind == "text" else None
        return out
    return dict(request.loss_fn_config)


def floe_loss(loss_fn: str, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """floe loss name and config for a Tinker loss_fn and loss_fn_config (InvalidInput on a loss
    floe does not serve, an unknown key, or a value that is not a finite number in range)."""
    if loss_fn in NOT_SERVED_LOSSES:
        raise InvalidInput("loss_fn", NOT_SERVED_LOSSES[loss_fn])
    if loss_fn not in SUPPORTED_LOSSES:
        raise InvalidInput("loss_fn", f"floe serves {', '.join(SUPPORTED_LOSSES)}; got {loss_fn!r}")
    unknown = sorted(set(config) - CONFIG_KEYS[loss_fn])
    if unknown:
        allowed = sorted(CONFIG_KEYS[loss_fn]) or "none"
        raise InvalidInput(f"loss_fn_config.{unknown[0]}", f"unknown key for {loss_fn}; allowed keys: {allowed}")
    values = {key: finite_number(f"loss_fn_config.{key}", value) for key, value in config.items()}
    out: dict[str, Any] = {"aggregation": "sum"}
    if loss_fn in ("ppo", "cispo", "gspo"):
        low = values.get("clip_low_threshold", DEFAULT_CLIP[0])
        high = values.get("clip_high_threshold", DEFAULT_CLIP[1])
        if not 0 <= low <= 1:
            raise InvalidInput("loss_fn_config.clip_low_threshold", f"a lower bound on the ratio in [0, 1], got {low}")
        if high < 1:
            raise InvalidInput("loss_fn_config.clip_high_threshold", f"an upper bound on the ratio >= 1, got {high}")
        out.update(clip_low=1.0 - low, clip_high=high - 1.0)
    if loss_fn == "gspo":
        out["ratio_gradient"] = "token"
    if loss_fn == "dro":
        if "beta" not in values:
            raise InvalidInput("loss_fn_config.beta", "dro needs beta (the weight of the squared log-ratio penalty)")
        if values["beta"] < 0:
            raise InvalidInput("loss_fn_config.beta", f"must be >= 0, got {values['beta']}")
        out["beta"] = values["beta"]
    if loss_fn == "stable_reinforce":  # floe's definition: cispo with the ratio clipped to [0, C]
        if values.get("kl_coeff", 0.0) != 0:
            raise InvalidInput("loss_fn_config.kl_coeff", KL_COEFF_REFUSED)
        cap = values.get("ratio_cap", DEFAULT_RATIO_CAP)
        if cap < 1:
            raise InvalidInput("loss_fn_config.ratio_cap", f"the cap C on the importance weight min(r, C) must be "
                                                           f">= 1, got {cap}")
        out.update(clip_low=1.0, clip_high=cap - 1.0)
        return "cispo", out
    return loss_fn, out


def _check_input_keys(where: str, loss: str, keys: set[str]) -> None:
    takes = REQUIRED_INPUTS[loss] | OPTIONAL_INPUTS.get(loss, frozenset())
    extra = sorted(keys - takes)
    if extra and extra[0] in _CLIP_KEYS and loss in ("ppo", "cispo", "gspo"):
        raise InvalidInput(f"{where}.loss_fn_inputs.{extra[0]}", _PER_TOKEN_CLIP.format(key=extra[0]))
    if extra:
        raise InvalidInput(
            f"{where}.loss_fn_inputs.{extra[0]}",
            f"not an input of {loss}, which takes {sorted(takes)}; like Tinker's service, floe takes only the inputs "
            "a loss reads (the cookbook drops its 'mask' before sending): remove it",
        )
    missing = sorted(REQUIRED_INPUTS[loss] - keys)
    if missing:
        raise InvalidInput(f"{where}.loss_fn_inputs.{missing[0]}", f"{loss} needs {missing[0]}")


def _gspo_weights(where: str, inputs: dict[str, np.ndarray]) -> list[float]:
    """0/1 weights marking the tokens of a gspo datum's sequence ratio (see the module docstring)."""
    adv = inputs["advantages"]
    mask = inputs["sequence_ratio_mask"] != 0 if "sequence_ratio_mask" in inputs else adv != 0
    outside = np.flatnonzero((adv != 0) & ~mask)
    if outside.size:
        raise InvalidInput(
            f"{where}.loss_fn_inputs.advantages",
            f"position {int(outside[0])} has a nonzero advantage outside sequence_ratio_mask; floe's gspo trains the "
            "tokens of the sequence ratio only: include that position in the mask or zero its advantage",
        )
    return mask.astype(np.float64).tolist()


Lookup = Callable[[str], SequenceRecord | None]


def _spans(where: str, datum: Any, n: int) -> list[tuple[str, str, int, int]]:
    """The datum's `loss_fn_input_spans` as (kind, sequence_id, offset, length), kind
    "prompt_tokens" or "sampled_tokens", checked to tile its n target positions."""
    out: list[tuple[str, str, int, int]] = []
    if len(datum.loss_fn_input_spans) > 2 * n + 2:
        raise InvalidInput(f"{where}.loss_fn_input_spans", f"has {len(datum.loss_fn_input_spans)} spans for {n} "
                                                           "positions")
    for j, span in enumerate(datum.loss_fn_input_spans):
        at = f"{where}.loss_fn_input_spans[{j}]"
        kind = span.WhichOneof("span")
        if kind is None:
            raise InvalidInput(at, "is neither a PromptProvenanceSpan nor a SampledProvenanceSpan")
        part = getattr(span, kind)
        if not part.sequence_id or len(part.sequence_id) > MAX_SEQUENCE_ID:
            raise InvalidInput(f"{at}.sequence_id", f"must be a sequence id of 1 to {MAX_SEQUENCE_ID} characters")
        if part.offset < 0 or part.length < 0:
            raise InvalidInput(at, f"offset and length must be >= 0, got {part.offset} and {part.length}")
        out.append((kind, part.sequence_id, int(part.offset), int(part.length)))
    covered = sum(length for *_, length in out)
    if out and covered != n:
        raise InvalidInput(f"{where}.loss_fn_input_spans", f"cover {covered} positions; they must tile the datum's "
                                                           f"{n} target positions exactly")
    return out


def _behaviour_logprobs(where: str, datum: Any, target: np.ndarray, inputs: dict[str, np.ndarray],
                        lookup: Lookup, bound: int) -> tuple[list[float], list[float]]:
    """stable_reinforce: (q, sampled) of one datum: q_t = the recorded sampler log-prob of the
    sampled token its spans name at t (elsewhere the client's `logprobs`, or 0; unused there),
    sampled_t = 1 where position t has sampled provenance, else 0 (its advantage must be 0)."""
    n = target.size
    q = inputs["logprobs"].astype(np.float64) if "logprobs" in inputs else np.zeros(n)
    sampled = np.zeros(n, dtype=bool)
    pos = 0
    for j, (kind, sequence_id, offset, length) in enumerate(_spans(where, datum, n)):
        if kind == "sampled_tokens" and length:
            record = lookup(sequence_id)
            if record is None:
                raise InvalidInput(f"{where}.loss_fn_input_spans[{j}].sequence_id",
                                   missing_record_message(sequence_id, bound))
            if offset + length > record.size:
                raise InvalidInput(f"{where}.loss_fn_input_spans[{j}]",
                                   f"covers sampled tokens {offset}..{offset + length - 1} of sequence "
                                   f"{sequence_id!r}, which has {record.size}")
            want, got = record.tokens[offset:offset + length], target[pos:pos + length]
            bad = np.flatnonzero(want != got)
            if bad.size:
                k = int(bad[0])
                raise InvalidInput(f"{where}.loss_fn_inputs.target_tokens",
                                   f"position {pos + k} is token {int(got[k])}, but loss_fn_input_spans[{j}] says it "
                                   f"is sampled token {offset + k} of sequence {sequence_id!r}, which is "
                                   f"{int(want[k])}: the spans do not describe this datum")
            q[pos:pos + length] = record.logprobs[offset:offset + length]
            sampled[pos:pos + length] = True
        pos += length
    loose = np.flatnonzero((inputs["advantages"] != 0) & ~sampled)
    if loose.size:
        p = int(loose[0])
        how = ("this datum has no loss_fn_input_spans" if not datum.loss_fn_input_spans
               else "its loss_fn_input_spans give it no sampled provenance")
        raise InvalidInput(f"{where}.loss_fn_inputs.advantages",
                           f"position {p} has advantage {float(inputs['advantages'][p])} but {how}; stable_reinforce "
                           "trains sampled tokens only, with the behaviour log-probs the server recorded for them: "
                           "name the sampled sequence in a SampledProvenanceSpan (Datum.with_provenance) or give the "
                           "position advantage 0")
    return q.tolist(), sampled.astype(np.float64).tolist()


def _check_unshifted(where: str, loss_fn: str, inputs: dict[str, np.ndarray], off: np.ndarray,
                     config: dict[str, Any], tokens: list[int], target: np.ndarray) -> None:
    """In forward_backward, positions `off` (whose target is not the next input token) may carry
    no loss: InvalidInput naming the datum field that gives them some."""
    if loss_fn == "dro" and config.get("beta", 0.0) > 0:
        carriers = [("target_tokens", np.ones(off.size, dtype=bool),
                     "loss (dro's penalty ½·beta·(logp − logprobs)² applies at every position)")]
    elif loss_fn == "cross_entropy":
        weights = inputs.get("weights")
        carriers = [("weights" if weights is not None else "target_tokens",
                     weights[off] != 0 if weights is not None else np.ones(off.size, dtype=bool),
                     "loss weight (absent weights are 1)" if weights is None else "loss weight")]
    else:
        carriers = [("advantages", inputs["advantages"][off] != 0, "advantage")]
        if loss_fn == "gspo" and "sequence_ratio_mask" in inputs:
            carriers.append(("sequence_ratio_mask", inputs["sequence_ratio_mask"][off] != 0,
                             "place in the sequence ratio"))
    for key, carries, what in carriers:
        hit = np.flatnonzero(carries)
        if hit.size:
            p = int(off[hit[0]])
            raise InvalidInput(
                f"{where}.loss_fn_inputs.{key}",
                f"position {p} carries {what}, but its target {int(target[p])} is not the next input token "
                f"({tokens[p + 1]}): floe computes such a position's log-prob exactly (loss_fn_outputs) but "
                "back-propagates only through next-token targets (target_tokens = model_input shifted by one); "
                "give it no loss there",
            )


def forward_request_to_floe(request: Any, lookup: Lookup | None = None, stability_bound: int = 0,
                            vocab_size: int | None = None) -> FloeCall:
    """A decoded `ForwardBackwardRequest` chunk as one floe call (InvalidInput naming the
    datum field that does not fit). `lookup(sequence_id)` finds the caller's stability records
    (stable_reinforce; `stability_bound` is the server's per-key bound, for messages);
    `vocab_size`: targets scored off the batch (not the next input token) must be below it."""
    if not request.data:
        raise InvalidInput("data", "no datums")
    loss_fn = request.loss_fn
    loss, config = floe_loss(loss_fn, loss_config_of(request))
    forward_only = bool(request.forward_only)
    groups: list[Group] = []
    retarget: list[tuple[list[int], list[int]]] = []
    signed = False
    for i, datum in enumerate(request.data):
        where = f"data[{i}]"
        tokens = _tokens(f"{where}.model_input", datum.model_input)
        n = len(tokens)
        if n == 0:
            raise InvalidInput(f"{where}.model_input", "is empty")
        keys = set(datum.loss_fn_inputs.keys())
        _check_input_keys(where, loss_fn, keys)
        inputs = {key: _tensor(f"{where}.loss_fn_inputs.{key}", datum.loss_fn_inputs[key], key, n) for key in keys}
        target = inputs["target_tokens"]
        off = np.flatnonzero(np.asarray(tokens[1:], dtype=np.int64) != target[:-1])
        if vocab_size is not None and off.size:
            bad = off[(target[off] < 0) | (target[off] >= vocab_size)]
            if bad.size:
                raise InvalidInput(f"{where}.loss_fn_inputs.target_tokens", f"position {int(bad[0])}: token id "
                                   f"{int(target[bad[0]])} is outside the vocabulary [0, {vocab_size})")
        # The batch scores the next input token everywhere (the last position: the last target).
        natural = [*tokens[1:], int(target[-1])]
        retarget.append((off.tolist(), target[off].tolist()))
        if loss_fn == "cross_entropy":
            weights = [float(w) for w in inputs["weights"]] if "weights" in inputs else [1.0] * n
            signed = signed or any(w < 0 for w in weights)
            sample = Sample(tokens=natural, weights=weights)
        elif loss_fn == "stable_reinforce":
            if lookup is None:
                raise InvalidInput("loss_fn", "stable_reinforce needs the server's stability records")
            q, sampled = _behaviour_logprobs(where, datum, target, inputs, lookup, stability_bound)
            sample = Sample(tokens=natural, logprobs=q, advantage=[float(x) for x in inputs["advantages"]],
                            weights=sampled)
        else:
            sample = Sample(tokens=natural, logprobs=[float(x) for x in inputs["logprobs"]],
                            advantage=[float(x) for x in inputs["advantages"]],
                            weights=_gspo_weights(where, inputs) if loss_fn == "gspo" else None)
        if off.size and not forward_only:
            _check_unshifted(where, loss_fn, inputs, off, config, tokens, target)
        groups.append(Group(prompt=tokens[:1], samples=[sample]))
    if signed:  # −w·logp with signed w: dro at beta 0 (see the module docstring)
        for g in groups:
            s = g.samples[0]
            g.samples[0] = Sample(tokens=s.tokens, logprobs=[0.0] * len(s.tokens), advantage=s.weights)
        loss, config = "dro", {"aggregation": "sum", "beta": 0.0}
    return FloeCall(Batch(groups), loss, config, [len(g.samples[0].tokens) for g in groups], retarget)


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


# -- create_model ---------------------------------------------------------------------------

LORA_KEYS = ("rank", "seed", "train_unembed", "train_mlp", "train_attn")


def lora_spec(raw: Any) -> LoraSpec:
    """A checked LoraSpec from the request's `lora_config` (absent: rank 32, every module family):
    rank and seed integers, the train_* switches real booleans (the string "no" is not false),
    unknown keys refused; InvalidInput naming the `lora_config` field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InvalidInput("lora_config", f"must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(LORA_KEYS))
    if unknown:
        raise InvalidInput(f"lora_config.{unknown[0]}", f"unknown key; allowed: {list(LORA_KEYS)}")
    spec = LoraSpec(rank=raw.get("rank", 32), seed=raw.get("seed"), train_attn=raw.get("train_attn", True),
                    train_mlp=raw.get("train_mlp", True), train_unembed=raw.get("train_unembed", True))
    spec.check()
    return spec


# -- sampling -------------------------------------------------------------------------------

MAX_NUM_SAMPLES = 1024  # samples per asample request
MAX_TOPK = MAX_TOP_LOGPROBS  # top-k widths (prompt and sample), alternative draws, distinct target ids
TOPK_MASK_LOGPROB = -99999.0  # the SDK's sentinel for an empty top-k slot (token id 0), tinker.types.topk_logprobs
SAMPLE_KEYS = frozenset({
    "sampling_session_id", "seq_id", "num_samples", "prompt", "sampling_params", "base_model", "model_path",
    "prompt_logprobs", "topk_prompt_logprobs", "topk_sample_logprobs", "target_prompt_logprobs",
    "prompt_alt_tokens_k", "prompt_logprobs_last_n", "record_stability_info", "type",
})


def num_samples(value: Any) -> int:
    """`num_samples` of an asample request: an integer in [1, MAX_NUM_SAMPLES]."""
    return _int_in("num_samples", value, 1, MAX_NUM_SAMPLES)


def check_vocab(field: str, tokens: Any, vocab_size: int | None) -> None:
    """Every id of `tokens` in [0, vocab_size) (no check when it is None); InvalidInput naming
    `field[i]`, the first id outside it. Checked from the request, before any work is queued
    (the vocabulary is the base model's config, known without loading weights)."""
    if vocab_size is None:
        return
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab_size:
            shown = str(int(t)) if abs(t) < 10**30 else f"{str(int(t))[:12]}... ({len(str(int(t)))} digits)"
            raise InvalidInput(f"{field}[{i}]", f"token id {shown} is outside the base model's vocabulary "
                               f"[0, {vocab_size})")


def _chunk_tokens(k: int, chunk: Any, vocab_size: int | None = None) -> list[int]:
    if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
        raise InvalidInput(f"prompt.chunks[{k}]", "only encoded_text chunks are supported by floe")
    tokens = chunk.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise InvalidInput(f"prompt.chunks[{k}].tokens", "must be a list of token ids")
    check_vocab(f"prompt.chunks[{k}].tokens", tokens, vocab_size)
    return tokens


def prompt_tokens(raw: Any, vocab_size: int | None = None) -> list[int]:
    """The request's `prompt` (a ModelInput: text chunks) as one list of token ids (each below
    `vocab_size` when given)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("chunks"), list):
        raise InvalidInput("prompt", "must be a ModelInput object with a list of chunks")
    tokens = [t for k, chunk in enumerate(raw["chunks"]) for t in _chunk_tokens(k, chunk, vocab_size)]
    if not tokens:
        raise InvalidInput("prompt", "is empty")
    return tokens


def sampling_params(raw: Any, prompt_len: int, max_context: int, vocab_size: int | None = None) -> SamplingParams:
    """floe SamplingParams from the request's `sampling_params` JSON (stop absent = at EOS;
    [] = never; strings = stop strings; ints = stop token ids, below `vocab_size` when given;
    top_k -1 = off), every field type-checked and bounded; InvalidInput naming
    `sampling_params.<field>`."""
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
            check_vocab("sampling_params.stop", stop_ids, vocab_size)
        else:
            raise InvalidInput("sampling_params.stop", "a string, a list of strings or a list of token ids")
    elif stop is not None:
        raise InvalidInput("sampling_params.stop", "a string, a list of strings or a list of token ids")
    room = max_context - prompt_len
    if room < 1:
        raise InvalidInput("prompt", f"has {prompt_len} tokens; the model's context is {max_context}, which leaves no "
                                     "room to generate: shorten the prompt")
    max_tokens = raw.get("max_tokens")
    if max_tokens is None:
        max_tokens = room
    _int_in("sampling_params.max_tokens", max_tokens, 1, room,
            f" (the prompt's {prompt_len} tokens leave {room} of the model's context of {max_context})")
    temperature = finite_number("sampling_params.temperature", raw.get("temperature", 1.0))
    if temperature < 0:
        raise InvalidInput("sampling_params.temperature", f"must be >= 0 (0 = greedy), got {temperature}")
    top_p = finite_number("sampling_params.top_p", raw.get("top_p", 1.0))
    if not 0 < top_p <= 1:
        raise InvalidInput("sampling_params.top_p", f"must be in (0, 1], got {top_p}")
    top_k = raw.get("top_k", -1)
    _int_in("sampling_params.top_k", top_k, -1, 2**31 - 1, " (-1 = no limit)")
    seed = raw.get("seed")
    if seed is not None:
        _int_in("sampling_params.seed", seed, 0, SEED_LIMIT - 1)
    try:  # floe's bounds on stop conditions (validation.check_stops), refused before the request is queued
        check_stops(stop_strings, stop_ids, vocab_size if vocab_size is not None else SEED_LIMIT)
    except InvalidInput as exc:
        raise InvalidInput("sampling_params.stop", exc.message) from None
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=0 if top_k == -1 else top_k,
        stop_token_ids=stop_ids, stop=stop_strings, seed=seed, stop_at_eos=at_eos,
    )


@dataclass(frozen=True)
class TargetIds:
    """`target_prompt_logprobs` of a request: `ids` [len(prompt) - 1, K] int64 (-1 = no cell),
    and, when it came sparse, its CSR layout (the response uses the same)."""

    ids: np.ndarray
    crow: np.ndarray | None = None
    col: np.ndarray | None = None


@dataclass(frozen=True)
class SampleCall:
    """A checked asample request."""

    prompt: list[int]
    num_samples: int
    params: SamplingParams
    prompt_logprobs: bool = False
    last_n: int | None = None  # prompt_logprobs_last_n
    topk_prompt: int = 0
    topk_sample: int = 0
    targets: TargetIds | None = None
    alt_k: int = 0  # prompt_alt_tokens_k
    record_stability: bool = False  # record_stability_info

    @property
    def scores_prompt_distribution(self) -> bool:
        """Whether the request needs the next-token distributions along the prompt."""
        return bool(self.topk_prompt or self.targets is not None or self.alt_k)


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if type(value) is not bool:
        raise InvalidInput(key, f"must be true or false, got {value!r}")
    return value


def _target_ids(raw: Any, rows: int, vocab_size: int) -> TargetIds:
    """The `target_prompt_logprobs` TensorData JSON (dense or sparse CSR) checked as the SDK
    documents it: int64, 2-D, exactly len(prompt) - 1 rows and at most MAX_TOPK columns (checked
    before the [rows, K] ids are allocated), at least one id, ids in [0, vocab) or -1, at most
    MAX_TOPK distinct ids (the cost len(prompt) * distinct ids bounded like a
    top-k width)."""
    field = "target_prompt_logprobs"
    if not isinstance(raw, dict):
        raise InvalidInput(field, "must be a TensorData object (data, dtype, shape)")
    if raw.get("dtype") != "int64":
        raise InvalidInput(f"{field}.dtype", f"must be int64 (token ids), got {raw.get('dtype')!r}")
    shape = raw.get("shape")
    if not isinstance(shape, list) or len(shape) != 2 or not all(type(s) is int and s >= 0 for s in shape):
        raise InvalidInput(f"{field}.shape", f"must be 2-D, [len(prompt) - 1, K], got {shape!r}")
    if shape[0] != rows:
        raise InvalidInput(f"{field}.shape", f"must have len(prompt) - 1 = {rows} rows, got {shape[0]}")
    if shape[1] > MAX_TOPK:  # before anything is allocated: [rows, K] int64 ids, then K float32 answers per row
        raise InvalidInput(f"{field}.shape", f"has K = {shape[1]} columns; at most {MAX_TOPK} (K is the ids scored "
                                             f"per position, bounded like a top-k width, and a request names at most "
                                             f"{MAX_TOPK} distinct ids): put each row's ids in its first columns")
    data = raw.get("data")
    if not isinstance(data, list) or not all(type(v) is int for v in data):
        raise InvalidInput(f"{field}.data", "must be a list of integer token ids")
    crow_raw, col_raw = raw.get("sparse_crow_indices"), raw.get("sparse_col_indices")
    if (crow_raw is None) != (col_raw is None):
        raise InvalidInput(field, "sparse_crow_indices and sparse_col_indices come together")
    ids = np.full(shape, -1, dtype=np.int64)
    crow = col = None
    if crow_raw is None:
        if len(data) != shape[0] * shape[1]:
            raise InvalidInput(f"{field}.data", f"has {len(data)} values for shape {shape}")
        ids[...] = np.asarray(data, dtype=np.int64).reshape(shape)
    else:
        ok = (isinstance(crow_raw, list) and isinstance(col_raw, list) and len(crow_raw) == rows + 1
              and all(type(v) is int for v in crow_raw + col_raw) and crow_raw[0] == 0
              and all(a <= b for a, b in pairwise(crow_raw)) and crow_raw[-1] == len(data) == len(col_raw)
              and all(0 <= c < shape[1] for c in col_raw))
        if not ok:
            raise InvalidInput(field, "sparse CSR layout does not fit its shape and data (crow: rows + 1 pointers "
                                      "from 0 to len(data); col: one column in [0, K) per value)")
        crow, col = np.asarray(crow_raw, dtype=np.int64), np.asarray(col_raw, dtype=np.int64)
        for r in range(rows):
            ids[r, col[crow[r]:crow[r + 1]]] = data[crow[r]:crow[r + 1]]
    named = ids[ids != -1]
    if named.size == 0:
        raise InvalidInput(field, "names no token id (every cell is -1)")
    if named.min() < 0 or named.max() >= vocab_size:
        bad = int(named.min() if named.min() < 0 else named.max())
        raise InvalidInput(f"{field}.data", f"token id {bad} is outside the vocabulary [0, {vocab_size}) (-1 = no cell)")
    distinct = np.unique(named).size
    if distinct > MAX_TOPK:
        raise InvalidInput(field, f"names {distinct} distinct token ids; at most {MAX_TOPK} (the cost, len(prompt) * "
                                  "distinct ids, is bounded like a top-k width): split the request")
    return TargetIds(ids, crow, col)


def sample_request(body: dict[str, Any], n: int, vocab_size: int, max_context: int) -> SampleCall:
    """A checked asample request body (n = its checked num_samples). Every field the SDK sends is
    served or refused naming it: unknown keys with a value set are refused.
    `record_stability_info = true` asks the service to record the samples (stability.py)."""
    for key in sorted(set(body) - SAMPLE_KEYS):
        if body[key] not in (None, False, 0, "", [], {}):
            raise InvalidInput(key, "unknown sampling field; floe serves " + ", ".join(sorted(SAMPLE_KEYS - {"type"})))
    record = _flag(body, "record_stability_info")
    prompt = prompt_tokens(body.get("prompt"), vocab_size)
    params = sampling_params(body.get("sampling_params") or {}, len(prompt), max_context, vocab_size)
    want_prompt = _flag(body, "prompt_logprobs")
    last_n = body.get("prompt_logprobs_last_n")
    if last_n is not None:
        if not want_prompt:
            raise InvalidInput("prompt_logprobs_last_n", "applies to prompt logprobs; set prompt_logprobs "
                                                         "(include_prompt_logprobs=True)")
        if len(prompt) < 2:
            raise InvalidInput("prompt_logprobs_last_n", "a 1-token prompt has no scored positions")
        _int_in("prompt_logprobs_last_n", last_n, 1, len(prompt) - 1, " (1 .. len(prompt) - 1)")
    topk_prompt, topk_sample, alt_k = (
        _int_in(key, 0 if body.get(key) is None else body[key], 0, MAX_TOPK, " (0 = none)")
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k")
    )
    raw_targets = body.get("target_prompt_logprobs")
    targets = None if raw_targets is None else _target_ids(raw_targets, len(prompt) - 1, vocab_size)
    return SampleCall(prompt, n, params, want_prompt, last_n, topk_prompt, topk_sample, targets, alt_k, record)


def prompt_logprobs_row(values: list[float], last_n: int | None) -> list[float]:
    """The response's prompt_logprobs (NaN at position 0) with NaN before the last `last_n`."""
    row = [float("nan")] + values
    if last_n is not None:
        row = [float("nan")] * (len(row) - last_n) + row[len(row) - last_n:]
    return row


def _topk(msg: Any, ids: np.ndarray, logprobs: np.ndarray) -> None:
    """Fill a `TopkLogprobs` from [length, k] ids and log-probs (sentinel slots: id 0,
    TOPK_MASK_LOGPROB)."""
    length, k = ids.shape
    msg.token_ids = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
    msg.logprobs = np.ascontiguousarray(logprobs, dtype=np.float32).tobytes()
    msg.k, msg.length = k, length


def _sampled_topk(rows: list[list[tuple[int, float]]], k: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.zeros((len(rows), k), dtype=np.int32)
    lps = np.full((len(rows), k), TOPK_MASK_LOGPROB, dtype=np.float32)
    for r, row in enumerate(rows):
        for j, (tok, lp) in enumerate(row[:k]):
            ids[r, j], lps[r, j] = tok, lp
    return ids, lps


def _dense(msg: Any, array: np.ndarray, dtype: int) -> None:
    msg.dtype = dtype
    msg.shape.extend(array.shape)
    msg.dense = np.ascontiguousarray(array).tobytes()


def sample_output(group: SampledGroup, call: SampleCall, prompt_logprobs: list[float] | None = None,
                  scores: PromptScores | None = None) -> bytes:
    """`SampleResponse` for one prompt's samples, with every field the SDK decodes that the
    request asked for: per sequence tokens, log-probs, stop reason, top-k; prompt_logprobs
    (NaN where not scored), topk_prompt_logprobs ([len(prompt), k]: row 0 and rows before
    the last `prompt_logprobs_last_n` are sentinel rows), target_prompt_logprobs (the request's
    shape and layout), prompt_alt_tokens, prompt_cache_hit_tokens (0: floe has no prefix cache)."""
    out = schema.SampleResponse()
    for s in group.samples:
        seq = out.sequences.add()
        seq.stop_reason = schema.STOP_REASON_LENGTH if s.stop_reason == "length" else schema.STOP_REASON_STOP
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
        if call.topk_sample and s.top_logprobs is not None:
            _topk(seq.topk_sampled_logprobs, *_sampled_topk(s.top_logprobs, call.topk_sample))
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if call.topk_prompt:
        assert scores is not None and scores.topk_ids is not None and scores.topk_logprobs is not None
        length, k = len(call.prompt), call.topk_prompt
        ids = np.zeros((length, k), dtype=np.int64)
        lps = np.full((length, k), TOPK_MASK_LOGPROB, dtype=np.float32)
        first = 1 if call.last_n is None else length - call.last_n
        ids[first:], lps[first:] = scores.topk_ids[first - 1:], scores.topk_logprobs[first - 1:]
        _topk(out.topk_prompt_logprobs, ids, lps)
    if call.targets is not None:
        assert scores is not None and scores.target_logprobs is not None
        values = np.where(call.targets.ids == -1, 0.0, scores.target_logprobs).astype(np.float32)
        msg = out.target_prompt_logprobs
        if call.targets.crow is None:
            _dense(msg, values, schema.DTYPE_FLOAT32)
        else:
            assert call.targets.col is not None
            msg.dtype = schema.DTYPE_FLOAT32
            msg.shape.extend(values.shape)
            rows = np.repeat(np.arange(values.shape[0]), np.diff(call.targets.crow))
            msg.sparse_csr.values = values[rows, call.targets.col].astype(np.float32).tobytes()
            msg.sparse_csr.crow_indices = call.targets.crow.tobytes()
            msg.sparse_csr.col_indices = call.targets.col.tobytes()
    if call.alt_k:
        assert scores is not None and scores.alt_tokens is not None and scores.alt_logprobs is not None
        _dense(out.prompt_alt_tokens.tokens, scores.alt_tokens.astype(np.int64), schema.DTYPE_INT64)
        _dense(out.prompt_alt_tokens.logprobs, scores.alt_logprobs.astype(np.float32), schema.DTYPE_FLOAT32)
    out.prompt_cache_hit_tokens = 0
    return out.SerializeToString()
