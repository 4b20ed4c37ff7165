"""The JSON requests of the Tinker protocol, as pydantic models of exactly the fields the tinker
0.38 SDK sends (its `tinker.types.*Request` classes): strict types (`"no"` is not a bool, `"5"`
is not an int, no NaN or infinity), bounded counts and sizes, and unknown fields refused.
`parse(model, body)` is the one entry: InvalidInput naming the field (`lora_config.rank`,
`sampling_params.max_tokens`) and what it must be.

Ids are strings checked by `floe.names.check_name` where they are used (they also become
paths); bounds on numbers that depend on the model (context length) are the service's.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from floe.backend.runs import AdamStep
from floe.errors import InvalidInput
from floe.server.bodies import parse_json_object

__all__ = [
    "MAX_METADATA_BYTES", "MAX_METADATA_ITEMS", "CreateModel", "CreateSamplingSession", "CreateSession", "FutureRetrieve", "GetInfo",
    "LoadWeights", "OptimStep", "SaveWeights", "SaveWeightsExternal", "SaveWeightsForSampler", "SessionHeartbeat",
    "SetTtl", "WeightsInfo", "parse",
]

MAX_METADATA_ITEMS = 64  # keys of a user_metadata map
MAX_TAGS = 64
MAX_TTL_S = 10 * 365 * 86400  # the SDK's documented range: 1 hour to 10 years; the lower
# bound is the server's ([server] tinker_min_ttl_s, TinkerService.check_ttl)
# Every client-chosen value the registry keeps is bounded, so that no key can grow the shared
# SQLite file without limit (the counts per key are store.Limits): a metadata map or tag list
# is at most MAX_METADATA_BYTES as JSON, each tag or key at most MAX_TAG_CHARS.
MAX_METADATA_BYTES = 16 * 1024
MAX_TAG_CHARS = 256
# Sequence numbers are in [0, 2**63 - 1): the registry stores a run's next expected one (seq + 1)
# as SQLite's signed 64-bit INTEGER, which 2**63 overflows (one tenant's request would then fail
# whichever request evicts that run, another tenant's included).
SEQ_LIMIT = 2**63 - 1


def _text() -> Any:
    return Field(max_length=1024)


def _maybe_text() -> Any:
    return Field(None, max_length=1024)


def _small_json(value: Any) -> Any:
    """`value` when its JSON is at most MAX_METADATA_BYTES (UTF-8); ValueError otherwise, which
    `validated` turns into InvalidInput naming the field."""
    size = len(json.dumps(value, ensure_ascii=False).encode())
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"is {size} bytes as JSON; at most {MAX_METADATA_BYTES} (16 KiB) are kept per record: "
                         "keep metadata to short labels, and large data in your own storage")
    return value


Key = Annotated[str, Field(max_length=MAX_TAG_CHARS)]
Metadata = Annotated[dict[Key, Any], AfterValidator(_small_json)]
StrMetadata = Annotated[dict[Key, str], AfterValidator(_small_json)]
Tags = Annotated[list[Annotated[str, Field(max_length=MAX_TAG_CHARS)]], AfterValidator(_small_json)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, protected_namespaces=())


class CreateSession(Strict):
    tags: Tags = Field(default_factory=list, max_length=MAX_TAGS)
    user_metadata: Metadata | None = Field(None, max_length=MAX_METADATA_ITEMS)
    sdk_version: str = Field("", max_length=64)
    project_id: str | None = Field(None, max_length=256)
    display_name: str | None = Field(None, max_length=256)
    type: Literal["create_session"] = "create_session"


class SessionHeartbeat(Strict):
    session_id: str = _text()
    type: Literal["session_heartbeat"] = "session_heartbeat"


class LoraConfig(Strict):
    rank: int = Field(ge=1, le=1024)
    seed: int | None = Field(None, ge=0, lt=2**63)
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(Strict):
    type: str = Field("adamw", max_length=64)


class CreateModel(Strict):
    session_id: str = _text()
    model_seq_id: int = Field(ge=0, lt=SEQ_LIMIT)
    base_model: str = _text()
    user_metadata: Metadata | None = Field(None, max_length=MAX_METADATA_ITEMS)
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = Field(default_factory=lambda: OptimizerConfig(type="adamw"))
    type: Literal["create_model"] = "create_model"


class GetInfo(Strict):
    model_id: str = _text()
    type: Literal["get_info"] = "get_info"


class OptimStep(Strict):
    """`adam_params` (or the SDK's aliases) is checked by `floe.backend.runs.AdamStep.from_json`:
    the one definition of Tinker's AdamParams in floe (fields, defaults, types, ranges)."""

    adam_params: dict[str, Any] | None = None
    optim_params: dict[str, Any] | None = None
    optimizer_params: dict[str, Any] | None = None
    model_id: str = _text()
    seq_id: int | None = Field(None, ge=0, lt=SEQ_LIMIT)
    type: Literal["optim_step"] = "optim_step"

    def adam(self) -> AdamStep:
        """The step's AdamW hyper-parameters; InvalidInput naming `adam_params.<field>`."""
        if self.optimizer_params is not None:
            raise InvalidInput("optimizer_params", "floe trains with AdamW: send adam_params (types.AdamParams)")
        params = self.adam_params if self.adam_params is not None else self.optim_params
        if params is None:
            raise InvalidInput("adam_params", "floe trains with AdamW: send adam_params (types.AdamParams)")
        return AdamStep.from_json(params)


class SaveWeights(Strict):
    model_id: str = _text()
    path: str | None = _maybe_text()
    seq_id: int | None = Field(None, ge=0, lt=SEQ_LIMIT)
    ttl_seconds: int | None = Field(None, ge=1, le=MAX_TTL_S)
    overwrite: bool = False
    user_metadata: StrMetadata | None = Field(None, max_length=MAX_METADATA_ITEMS)
    type: Literal["save_weights"] = "save_weights"


class SaveWeightsForSampler(Strict):
    model_id: str = _text()
    path: str | None = _maybe_text()
    sampling_session_seq_id: int | None = Field(None, ge=0, lt=SEQ_LIMIT)
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: int | None = Field(None, ge=0, lt=SEQ_LIMIT)
    ttl_seconds: int | None = Field(None, ge=1, le=MAX_TTL_S)
    user_metadata: StrMetadata | None = Field(None, max_length=MAX_METADATA_ITEMS)
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"


class SaveWeightsExternal(Strict):
    model_id: str = _text()
    path: str = _text()
    seq_id: int | None = Field(None, ge=0, lt=SEQ_LIMIT)
    ttl_seconds: int | None = Field(None, ge=1, le=MAX_TTL_S)
    age_encryption_recipients: list[Annotated[str, Field(max_length=MAX_TAG_CHARS)]] | None = Field(None, max_length=16)
    type: Literal["save_weights_external"] = "save_weights_external"


class LoadWeights(Strict):
    model_id: str | None = _maybe_text()
    seq_id: int | None = Field(None, ge=0, lt=SEQ_LIMIT)
    session_id: str | None = _maybe_text()
    model_seq_id: int | None = Field(None, ge=0, lt=SEQ_LIMIT)
    base_model: str | None = _maybe_text()
    user_metadata: Metadata | None = Field(None, max_length=MAX_METADATA_ITEMS)
    path: str = _text()
    optimizer: bool
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: str | None = Field(None, max_length=4096)
    type: Literal["load_weights"] = "load_weights"


class CreateSamplingSession(Strict):
    session_id: str = _text()
    sampling_session_seq_id: int = Field(ge=0, lt=SEQ_LIMIT)
    base_model: str | None = _maybe_text()
    model_path: str | None = _maybe_text()
    type: Literal["create_sampling_session"] = "create_sampling_session"


class FutureRetrieve(Strict):
    request_id: str = Field(max_length=256)
    allow_metadata_only: bool = False


class SetTtl(Strict):
    ttl_seconds: int | None = Field(None, ge=1, le=MAX_TTL_S)


class WeightsInfo(Strict):
    tinker_path: str = _text()


M = TypeVar("M", bound=BaseModel)


def _field(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, str) and len(part) > 40:  # a client's dict key: never echoed whole
            part = part[:40] + "..."
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def validated(model: type[M], data: dict[str, Any]) -> M:
    """`model` from decoded JSON; InvalidInput naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = _field(tuple(first.get("loc", ())))
        if first.get("type") == "extra_forbidden":
            raise InvalidInput(field, f"is not a field of this request (the tinker 0.38 SDK's {model.__name__})") from None
        raise InvalidInput(field, str(first.get("msg", "invalid value")).removeprefix("Value error, ")) from None


def parse(model: type[M], body: bytes) -> M:
    """`model` from a JSON request body (bodies.parse_json_object: bounded depth, finite numbers)."""
    return validated(model, parse_json_object(body))
