"""The operations of the client API: one `Op` record per operation, in `OPS`.

An operation's record says everything the layers around it need: its name, its Python
signature (parameters with defaults, and the result type), the zones it touches, whether it
changes state, which argument and result travel as tensors (and with which codec), and what a
server counts when it succeeds. From `OPS`:

  - `Client` has one explicit, documented method per operation with exactly this signature
    (tests/protocol checks it); `AsyncClient`'s coroutines are generated from `OPS`;
  - the wire format (protocol/wire.py) encodes requests and results and checks a request's
    arguments against the signature;
  - the server answers `POST /api/<name>` for every name here and nothing else, runs
    `Backend.<name>(**arguments)` and counts the result through the record's `observe` hook.

Adding an operation is a record here plus its `Backend` method (and a `Client` method).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from floe.errors import InvalidInput
from floe.protocol.codecs import (
    BATCH,
    FORWARD_BACKWARD_RESULT,
    FORWARD_RESULT,
    PROMPTS,
    SAMPLE_RESULT,
    ArgCodec,
    ResultCodec,
)
from floe.types import (
    Batch,
    ForwardBackwardResult,
    ForwardResult,
    Group,
    Info,
    OptimStepResult,
    SampleResult,
    SamplingParams,
    StateResult,
    SyncResult,
)

ZONES = frozenset({"policy", "sampler", "reference"})


class ResultObserver(Protocol):
    """What an operation's `observe` hook may report (the server's metrics implement it)."""

    def add_sampled_tokens(self, count: int) -> None: ...
    def add_trained_tokens(self, count: int) -> None: ...
    def set_policy_step(self, step: int) -> None: ...
    def set_weights_version(self, version: int) -> None: ...
    def observe_sync_seconds(self, seconds: float) -> None: ...


Observe = Callable[[ResultObserver, Mapping[str, Any], Any], None]
"""observe(observer, arguments, result): report what a successful call did."""


@dataclass(frozen=True, eq=False)
class Op:
    """One operation of the client API.

    name:          the method name on Client/AsyncClient/Backend and the route /api/<name>
    signature:     the call's parameters (keyword-callable, with defaults) and result annotation,
                   without `self`
    hints:         the parameters' and the result's resolved types (typing.get_type_hints)
    result:        the runtime class of the result: a floe.types dataclass, list or str
    zones:         the backend zones it touches ("policy", "sampler", "reference"); empty when
                   it touches none (e.g. only the state directory)
    mutates:       whether it changes backend state or files (weights, gradients, versions, RNG,
                   saved states, exports), so running it twice differs from running it once
    tensor_arg:    the argument that travels as tensors, or None; `arg_codec` encodes it
    result_codec:  how the result travels as tensors, or None for a JSON result
    dataclass_args: arguments whose value is a dataclass (e.g. SamplingParams), sent as JSON
                   objects and rebuilt on arrival
    observe:       the metrics hook run on the server after a successful call, or None
    """

    name: str
    signature: inspect.Signature
    hints: Mapping[str, Any]
    result: type
    zones: frozenset[str]
    mutates: bool
    tensor_arg: str | None = None
    arg_codec: ArgCodec | None = None
    result_codec: ResultCodec | None = None
    dataclass_args: tuple[tuple[str, type], ...] = ()
    observe: Observe | None = None

    @property
    def parameters(self) -> tuple[str, ...]:
        """The parameter names, in order."""
        return tuple(self.signature.parameters)


def define(
    fn: Callable[..., Any],
    *,
    zones: frozenset[str] | set[str],
    mutates: bool,
    tensor_arg: tuple[str, ArgCodec] | None = None,
    result_codec: ResultCodec | None = None,
    observe: Observe | None = None,
) -> Op:
    """An `Op` named and typed after `fn`, a stub whose signature is the operation's.

    `fn`'s parameters must all be annotated and keyword-callable, and its return annotated;
    `tensor_arg` is (parameter name, codec). Raises ValueError naming what is wrong
    (TypeError when the result annotation is not a class).
    """
    name = fn.__name__
    signature = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except NameError as e:
        raise ValueError(f"operation {name!r}: an annotation does not resolve: {e}") from None
    for param in signature.parameters.values():
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise ValueError(f"operation {name!r}: parameter {param.name!r} must be callable by keyword")
        if param.name not in hints:
            raise ValueError(f"operation {name!r}: parameter {param.name!r} needs a type annotation")
    if "return" not in hints:
        raise ValueError(f"operation {name!r}: the result type needs an annotation")
    if not zones <= ZONES:
        raise ValueError(f"operation {name!r}: zones {sorted(zones - ZONES)} are not among {sorted(ZONES)}")
    if tensor_arg is not None and tensor_arg[0] not in signature.parameters:
        raise ValueError(f"operation {name!r}: tensor argument {tensor_arg[0]!r} is not a parameter")
    result = typing.get_origin(hints["return"]) or hints["return"]
    if not isinstance(result, type):
        raise TypeError(f"operation {name!r}: the result must be a class, got {hints['return']!r}")
    tensor_name = tensor_arg[0] if tensor_arg else None
    dataclass_args = tuple(
        (p, cls) for p in signature.parameters if p != tensor_name and (cls := _dataclass_of(hints[p])) is not None
    )
    return Op(
        name=name, signature=signature, hints=hints, result=result, zones=frozenset(zones), mutates=mutates,
        tensor_arg=tensor_name, arg_codec=tensor_arg[1] if tensor_arg else None, result_codec=result_codec,
        dataclass_args=dataclass_args, observe=observe,
    )


def _dataclass_of(hint: Any) -> type | None:
    """The dataclass in `hint` (`X` or `X | None`), else None."""
    candidates = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else (hint,)
    found = [c for c in candidates if isinstance(c, type) and dataclasses.is_dataclass(c)]
    return found[0] if len(found) == 1 else None


# -- metrics hooks -------------------------------------------------------------------------------


def _observe_sample(m: ResultObserver, args: Mapping[str, Any], result: SampleResult) -> None:
    m.add_sampled_tokens(result.num_tokens)


def _observe_forward_backward(m: ResultObserver, args: Mapping[str, Any], result: ForwardBackwardResult) -> None:
    batch = args.get("batch")
    if isinstance(batch, Batch):
        m.add_trained_tokens(batch.num_sample_tokens)


def _observe_optim_step(m: ResultObserver, args: Mapping[str, Any], result: OptimStepResult) -> None:
    m.set_policy_step(result.step)


def _observe_sync(m: ResultObserver, args: Mapping[str, Any], result: SyncResult) -> None:
    m.set_weights_version(result.version)
    m.observe_sync_seconds(result.seconds)


def _observe_load_state(m: ResultObserver, args: Mapping[str, Any], result: StateResult) -> None:
    m.set_policy_step(result.step)
    m.set_weights_version(result.version)


# -- the operations (stubs carry the signatures; Client's methods document them) ----------------


def sample(prompts: list[list[int]], n: int = 1, params: SamplingParams | None = None) -> SampleResult: ...
def forward(
    batch: Batch | list[Group], zone: str = "policy", temperature: float | None = None, with_entropy: bool = False
) -> ForwardResult: ...
def forward_backward(
    batch: Batch | list[Group], loss: str = "cross_entropy", loss_config: dict[str, Any] | None = None,
    temperature: float | None = None,
) -> ForwardBackwardResult: ...
def optim_step(lr: float | None = None) -> OptimStepResult: ...
def sync_weights(version: int | None = None) -> SyncResult: ...
def save_state(name: str) -> StateResult: ...
def load_state(name: str) -> StateResult: ...
def delete_state(name: str) -> StateResult: ...
def list_states() -> list[str]: ...
def export_hf(path: str) -> str: ...
def info() -> Info: ...


OPS: dict[str, Op] = {
    op.name: op
    for op in (
        define(sample, zones={"sampler"}, mutates=True, tensor_arg=("prompts", PROMPTS), result_codec=SAMPLE_RESULT,
               observe=_observe_sample),
        define(forward, zones={"policy", "reference"}, mutates=False, tensor_arg=("batch", BATCH),
               result_codec=FORWARD_RESULT),
        define(forward_backward, zones={"policy"}, mutates=True, tensor_arg=("batch", BATCH),
               result_codec=FORWARD_BACKWARD_RESULT, observe=_observe_forward_backward),
        define(optim_step, zones={"policy"}, mutates=True, observe=_observe_optim_step),
        define(sync_weights, zones={"policy", "sampler"}, mutates=True, observe=_observe_sync),
        define(save_state, zones={"policy", "sampler"}, mutates=True),
        define(load_state, zones={"policy", "sampler"}, mutates=True, observe=_observe_load_state),
        define(delete_state, zones=set(), mutates=True),
        define(list_states, zones=set(), mutates=False),
        define(export_hf, zones={"policy"}, mutates=True),
        define(info, zones={"policy", "sampler"}, mutates=False),
    )
}
"""Every operation by name. Tests may add a record temporarily; nothing else writes here."""


def get_op(name: str) -> Op:
    """The record of operation `name`; InvalidInput("op", ...) listing the known ones otherwise."""
    op = OPS.get(name) if isinstance(name, str) else None
    if op is None:
        raise InvalidInput("op", f"unknown operation {name!r}; one of {list(OPS)}")
    return op
