"""Multi-tenant LoRA training runs on one shared base model (what the Tinker protocol serves).

`RunManager` owns one frozen copy of the served base model (`floe.models.lora.AdapterHost`,
loaded on first use) and any number of runs. A run is a LoRA adapter on that base plus its own
`PolicyZone` (AdamW state, step) over the adapter's parameters only, so training math is floe's:
`forward_backward` resolves the loss in `floe.compute.losses` and scores through
`floe.backend.scoring`; nothing is reimplemented here.

Why one peft model with several adapters (and not one PeftModel per run): peft injects its
LoRA layers into the base module in place, so two PeftModels cannot wrap the same base
module; named adapters on one PeftModel are exactly "one base, many adapters". The price is
that only one adapter is active at a time, so every model use (any run's training, any
sampling) holds `AdapterHost.lock` and activates its adapter first: runs interleave per call
and never see each other's weights.

Samplers are frozen weights: `snapshot(run)` copies the run's adapter at its current version
into a new adapter; `load_sampler(dir)` loads one saved by `save_sampler` or
`save_sampler_weights`; `base_sampler()` samples the base model with no adapter. Each lives
until `release_sampler` frees it: how long samplers stay in memory, and when one is written to
disk to come back later, is the caller's decision (the Tinker service's residency), not a cap
here. Sampling runs floe's torch engine (`floe.sampler.torch_engine.TorchEngine`) on the
adapted model, and `prompt_logprobs` runs floe's scoring on it.

Full fine-tune runs (`create_run(run_id, None)`, only when the manager was built with
`full_finetune=True`, the server's `[server] tinker_full_finetune`): the run owns a copy of the
base model, loaded from disk, and its `PolicyZone` trains every weight with its own AdamW state
(fp32 masters for a bf16 model, as the native policy). At most one exists at a time (a second
is a StateError naming the setting): a full run costs a whole model plus AdamW moments. Its
samplers are frozen copies of the whole model (`FrozenModel`, each with its own torch engine);
on disk they are an ordinary Hugging Face model directory (weights, config, tokenizer). A full
run uses its own lock, not the host's.

Versions: a run's version counts its optimizer steps (a loaded run continues its saved count);
every sample carries the version of the sampler's weights.
"""

from __future__ import annotations

import copy
import json
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from floe.atomic import atomic_directory, recover
from floe.backend.policy import PolicyZone
from floe.backend.sampler import prompt_seeds
from floe.backend.scoring import next_token_logits, score_batch
from floe.backend.state import ZoneState, read_state, write_state
from floe.backend.validation import MAX_LEARNING_RATE, validate_batch, validate_prompts
from floe.compute.losses import resolve_loss
from floe.config import BackendConfig, OptimizerConfig
from floe.errors import InvalidInput, StateError
from floe.models import load_model
from floe.models.loading import context_length
from floe.models.lora import AdapterHost, LoraSpec, load_tensors
from floe.sampler.engine import OnStep
from floe.sampler.noise import derive, derive_tensor, uniforms
from floe.sampler.torch_engine import TorchEngine
from floe.types import (
    Batch,
    ForwardBackwardResult,
    ForwardResult,
    Group,
    OptimStepResult,
    Sample,
    SampledGroup,
    SamplingParams,
)

BASE_SAMPLER = "base"
RUN_META = "run.json"
SAMPLER_META = "floe_lora.json"
FULL_FINETUNE_SETTING = "[server] tinker_full_finetune"


ADAM_FIELDS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


@dataclass(frozen=True)
class AdamStep:
    """One optimizer step's AdamW hyper-parameters (Tinker's AdamParams). grad_clip_norm 0 =
    no clipping; weight decay is decoupled (torch.optim.AdamW). learning_rate 0 is a valid step
    (warm-up schedules start there): the moments and the step count advance, the weights stay."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    @classmethod
    def from_json(cls, raw: Any) -> AdamStep:
        """An AdamStep from the request's `adam_params` object: known keys only (and "type"),
        every value a finite number (not a bool, string or null), each in range (`check`);
        InvalidInput naming `adam_params.<field>`."""
        if not isinstance(raw, dict):
            raise InvalidInput("adam_params", "floe trains with AdamW: send adam_params (AdamParams) as an object")
        unknown = sorted(set(raw) - set(ADAM_FIELDS) - {"type"})
        if unknown:
            raise InvalidInput(f"adam_params.{unknown[0]}", f"unknown key; AdamParams has {list(ADAM_FIELDS)}")
        values: dict[str, float] = {}
        for name in ADAM_FIELDS:
            if name in raw:
                value = raw[name]
                if type(value) not in (int, float) or not _finite(value):
                    raise InvalidInput(f"adam_params.{name}", f"must be a finite number, got {value!r}")
                values[name] = float(value)
        step = cls(**values)
        step.check()
        return step

    def check(self) -> None:
        """InvalidInput naming the `adam_params` field that is not finite or out of range:
        learning_rate in [0, MAX_LEARNING_RATE], beta1 and beta2 in [0, 1), eps > 0,
        weight_decay >= 0 with learning_rate * weight_decay <= 1 (the decoupled decay factor
        1 - lr * wd stays in [0, 1]), grad_clip_norm >= 0."""
        for name in ADAM_FIELDS:
            value = getattr(self, name)
            if type(value) not in (int, float) or not _finite(value):
                raise InvalidInput(f"adam_params.{name}", f"must be a finite number, got {value!r}")
        checks = (
            ("learning_rate", 0 <= self.learning_rate <= MAX_LEARNING_RATE, f"in [0, {MAX_LEARNING_RATE}]"),
            ("beta1", 0 <= self.beta1 < 1, "in [0, 1)"), ("beta2", 0 <= self.beta2 < 1, "in [0, 1)"),
            ("eps", self.eps > 0, "> 0"), ("weight_decay", self.weight_decay >= 0, ">= 0"),
            ("weight_decay", self.learning_rate * self.weight_decay <= 1,
             "<= 1 / learning_rate (the decoupled decay multiplies weights by 1 - learning_rate * weight_decay)"),
            ("grad_clip_norm", self.grad_clip_norm >= 0, ">= 0 (0 = no clipping)"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise InvalidInput(f"adam_params.{name}", f"must be {rule}, got {getattr(self, name)!r}")

    def to_config(self) -> OptimizerConfig:
        """As floe's optimizer config (a constant schedule at this step's rate), after `check`.
        Built without pydantic's validation, which refuses lr = 0 for floe's own recipes (there a
        zero rate is a mistake; here it is a warm-up step)."""
        self.check()
        return OptimizerConfig.model_construct(
            lr=self.learning_rate, betas=(self.beta1, self.beta2), eps=self.eps, weight_decay=self.weight_decay,
            grad_clip=self.grad_clip_norm if self.grad_clip_norm > 0 else None, schedule="constant",
        )


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float's range
        return False


@dataclass
class Run:
    """One training run: a LoRA run (its adapter, named `adapter` on the host, shaped by `spec`)
    or a full fine-tune run (`spec` and `adapter` None: `zone.model` is its own model copy),
    its zone and metadata."""

    run_id: str
    adapter: str | None
    spec: LoraSpec | None
    zone: PolicyZone
    user_metadata: dict[str, Any] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)  # a full run's (LoRA: the host's)

    @property
    def version(self) -> int:
        return self.zone.step

    @property
    def full(self) -> bool:
        return self.spec is None


@dataclass(frozen=True)
class SamplerInfo:
    """A sampler: the name of its frozen weights (None = the base model) and their version.
    `full` False: `weights` is an adapter on the host; True: a `FrozenModel` of the manager."""

    weights: str | None
    version: int
    run_id: str | None
    full: bool = False


@dataclass(frozen=True)
class FrozenModel:
    """A frozen whole model a full-run sampler uses, with the torch engine sampling it."""

    model: PreTrainedModel
    engine: TorchEngine


class RunManager:
    """Runs and samplers on one base model; thread-safe (see the module docstring)."""

    def __init__(self, config: BackendConfig, tokenizer: PreTrainedTokenizerBase, root: Path, full_finetune: bool = False):
        self.config = config
        self.full_finetune = full_finetune
        self.tokenizer = tokenizer
        self.root = root
        self.compute = config.compute.model_copy(update={"gradient_checkpointing": False})
        self.max_batch_sequences = getattr(config.sampler.engine, "max_batch_sequences", 256)
        self.runs: dict[str, Run] = {}
        self.samplers: dict[str, SamplerInfo] = {}
        self._host: AdapterHost | None = None
        self._engine: TorchEngine | None = None
        self._base_config: PretrainedConfig | None = None
        self.frozen: dict[str, FrozenModel] = {}  # full-run samplers' models by name
        self._full_owner: str | None = None  # the full run's id (or the one being created)
        self._load_lock = threading.Lock()
        self._names = 0
        self._seed_gen = torch.Generator().manual_seed(config.seed)

    # -- the shared base ----------------------------------------------------------------------

    @property
    def host(self) -> AdapterHost:
        with self._load_lock:
            if self._host is None:
                base = self._load_base()
                base.eval()
                self._host = AdapterHost(base, self.config.model)
            return self._host

    @property
    def base_config(self) -> PretrainedConfig:
        """The served model's config (read from its directory, without loading weights)."""
        if self._base_config is None:
            self._base_config = AutoConfig.from_pretrained(self.config.model, trust_remote_code=self.config.trust_remote_code)
        return self._base_config

    @property
    def vocab_size(self) -> int:
        return int(self.base_config.vocab_size)

    @property
    def max_context(self) -> int:
        return context_length(self.base_config)

    def _load_base(self) -> PreTrainedModel:
        cfg = self.config
        return load_model(cfg.model, cfg.dtype, cfg.device, cfg.trust_remote_code, cfg.attn_implementation)

    def _engine_for(self) -> TorchEngine:
        if self._engine is None:
            self._engine = TorchEngine(self.host.sampling_view(), self.tokenizer, self.max_batch_sequences)  # type: ignore[arg-type]
        return self._engine

    def _new_name(self, prefix: str) -> str:
        with self._load_lock:
            self._names += 1
            return f"{prefix}_{self._names}"

    def _run(self, run_id: str) -> Run:
        run = self.runs.get(run_id)
        if run is None:
            raise InvalidInput("model_id", f"no training run {run_id!r} on this server")
        return run

    # -- runs -----------------------------------------------------------------------------------

    def create_run(self, run_id: str, spec: LoraSpec | None, user_metadata: dict[str, Any] | None = None) -> Run:
        """A new run: with a LoraSpec, a fresh adapter (B = 0: it starts as the base model);
        with None, a full fine-tune run on its own copy of the base model (StateError naming
        FULL_FINETUNE_SETTING when it is off or another full run exists)."""
        if spec is None:
            return self._create_full_run(run_id, user_metadata)
        spec.check()
        if run_id in self.runs:
            raise InvalidInput("model_id", f"a run {run_id!r} exists already")
        host = self.host
        adapter = self._new_name("run")
        with host.lock:
            host.add(adapter, spec, trainable=True)
            host.activate(adapter)
            zone = PolicyZone(host.view(adapter), self.config.optimizer, self.compute)  # type: ignore[arg-type]
            run = Run(run_id, adapter, spec, zone, dict(user_metadata or {}))
            self.runs[run_id] = run
        return run

    def _create_full_run(self, run_id: str, user_metadata: dict[str, Any] | None) -> Run:
        if not self.full_finetune:
            raise StateError(f"{FULL_FINETUNE_SETTING} is off: this server trains LoRA runs only; set it true for a "
                             "full fine-tune run")
        with self._load_lock:
            if run_id in self.runs:
                raise InvalidInput("model_id", f"a run {run_id!r} exists already")
            if self._full_owner is not None:
                raise StateError(
                    f"{FULL_FINETUNE_SETTING}: this server trains one full fine-tune run at a time and run "
                    f"{self._full_owner!r} holds it; finish that run's session (or load its checkpoint into it) first"
                )
            self._full_owner = run_id
        try:
            zone = PolicyZone(self._load_base(), self.config.optimizer, self.config.compute)
        except BaseException:
            self._full_owner = None
            raise
        run = Run(run_id, None, None, zone, dict(user_metadata or {}))
        self.runs[run_id] = run
        return run

    @contextmanager
    def _training(self, run: Run) -> Iterator[None]:
        """The run's model ready for its zone: a full run's own lock, or the host's lock with
        the run's adapter active."""
        if run.full:
            with run.lock:
                yield
            return
        with self.host.lock:
            self.host.activate(run.adapter)  # type: ignore[arg-type]
            yield

    def forward(self, run_id: str, batch: Batch) -> ForwardResult:
        """Per-token log-probs of `batch` under the run's current weights (temperature 1)."""
        run = self._run(run_id)
        validate_batch(batch, self.vocab_size, self.max_context)
        with self._training(run):
            return run.zone.forward(batch, 1.0, False)

    def target_logprobs(self, run_id: str, queries: list[tuple[list[int], list[int], list[int]]]) -> list[list[float]]:
        """For each (tokens, positions, targets): log p(targets[k] | tokens[:positions[k] + 1])
        under the run's current weights (temperature 1), i.e. the log-prob of any target at a
        position, not only the next token (Tinker datums whose targets are not the input
        shifted by one). Exact: the logits at each position (`scoring.next_token_logits`, one
        gradient-free forward of the prefix up to the last position asked), log-softmax in fp32.
        Queries with the same prefix, positions and targets are computed once. Every id and
        position is checked (InvalidInput) before the model runs; nothing changes state."""
        run = self._run(run_id)
        vocab, context = self.vocab_size, self.max_context
        for q, (tokens, positions, targets) in enumerate(queries):
            if len(positions) != len(targets) or not positions:
                raise InvalidInput(f"queries[{q}]", "one target per position, at least one")
            if len(tokens) > context:
                raise InvalidInput(f"queries[{q}].tokens", f"has {len(tokens)} tokens; the model's context is {context}")
            if min(positions) < 0 or max(positions) >= len(tokens):
                raise InvalidInput(f"queries[{q}].positions", f"positions must be in [0, {len(tokens)})")
            for name, ids in (("tokens", tokens), ("targets", targets)):
                if min(ids) < 0 or max(ids) >= vocab:
                    bad = min(ids) if min(ids) < 0 else max(ids)
                    raise InvalidInput(f"queries[{q}].{name}", f"token id {bad} is outside the vocabulary [0, {vocab})")
        done: dict[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], list[float]] = {}
        out: list[list[float]] = []
        with self._training(run), torch.no_grad():
            for tokens, positions, targets in queries:
                last = max(positions)
                key = (tuple(tokens[: last + 1]), tuple(positions), tuple(targets))
                if key not in done:
                    wanted: dict[int, list[int]] = {}
                    for k, p in enumerate(positions):
                        wanted.setdefault(p, []).append(k)
                    values = [0.0] * len(positions)
                    # next_token_logits(model, t) forwards t[:-1]: rows 0 .. last are the
                    # distributions after tokens[:1] .. tokens[:last + 1].
                    prefix = [*tokens[: last + 1], 0]
                    for start, logits in next_token_logits(run.zone.model, prefix, self.compute.logprob_chunk_tokens):
                        rows = [p for p in range(start, start + logits.shape[0]) if p in wanted]
                        if not rows:
                            continue
                        logp = torch.log_softmax(logits[[p - start for p in rows]], dim=-1)
                        for r, p in enumerate(rows):
                            for k in wanted[p]:
                                values[k] = float(logp[r, targets[k]])
                    done[key] = values
                out.append(done[key])
        return out

    def forward_backward(
        self, run_id: str, batch: Batch, loss: str, loss_config: dict[str, Any] | None
    ) -> ForwardBackwardResult:
        """floe's forward_backward on the run's adapter; gradients add up until optim_step."""
        run = self._run(run_id)
        spec = resolve_loss(loss, loss_config)
        validate_batch(batch, self.vocab_size, self.max_context, spec)
        with self._training(run):
            return run.zone.forward_backward(batch, spec, 1.0)

    def optim_step(self, run_id: str, adam: AdamStep) -> OptimStepResult:
        """Apply the accumulated gradients with this call's AdamW hyper-parameters."""
        run = self._run(run_id)
        cfg = adam.to_config()
        with self._training(run):
            zone = run.zone
            zone.optimizer_config = cfg
            for group in zone.optimizer.param_groups:
                group["betas"], group["eps"], group["weight_decay"] = cfg.betas, cfg.eps, cfg.weight_decay
            return zone.optim_step()

    def close_run(self, run_id: str) -> None:
        """Forget a run and free its trained weights (its checkpoints stay on disk; samplers made
        from it stay until `release_sampler`)."""
        run = self.runs.pop(run_id, None)
        if run is None:
            return
        if run.full:
            with self._load_lock:
                if self._full_owner == run_id:
                    self._full_owner = None
            return
        with self.host.lock:
            self.host.remove(run.adapter)  # type: ignore[arg-type]

    def release_sampler(self, sampler: SamplerInfo) -> None:
        """Free a sampler's frozen weights (a snapshot, or weights loaded from disk); the base
        sampler has none. Idempotent."""
        if sampler.weights is None:
            return
        if sampler.full:
            self.frozen.pop(sampler.weights, None)
            return
        if self._host is not None:
            with self._host.lock:
                if sampler.weights in self._host.specs:
                    self._host.remove(sampler.weights)

    def pending_calls(self, run_id: str) -> int:
        """forward_backward calls of the run not yet applied by optim_step."""
        return self._run(run_id).zone.pending_calls

    def in_memory(self) -> dict[str, int]:
        """What this manager holds in memory now: its base model (0 or 1), LoRA adapters on it
        (runs' and samplers'), and whole models of full runs and their samplers. Read without
        locks (counts for metrics, never waiting for a model call)."""
        host = self._host
        full_runs = sum(run.full for run in list(self.runs.values()))
        return {"base_models": int(host is not None), "adapters": len(host.specs) if host is not None else 0,
                "full_models": len(self.frozen) + full_runs}

    def unload(self) -> None:
        """Drop the base model from memory (it loads again on next use). Only when no run and
        no sampler of this manager is in memory: StateError otherwise."""
        if self.runs or self.frozen or (self._host is not None and self._host.specs):
            raise StateError("unload: runs or samplers of this base model are still in memory")
        with self._load_lock:
            self._host = None
            self._engine = None

    # -- state on disk --------------------------------------------------------------------------

    def save_state(self, run_id: str, directory: Path) -> None:
        """Trained weights (the adapter, or every weight of a full run), AdamW state and step of
        the run (atomically; replaces `directory`)."""
        run = self._run(run_id)
        with self._training(run):
            part = run.zone.state_part()
        kind = {"full": True} if run.spec is None else {"lora": run.spec.to_json()}
        meta = ZoneState({}, {"run": {**kind, "user_metadata": run.user_metadata}})
        write_state(directory, [part, meta], self.config.model)

    @staticmethod
    def _read_run_state(directory: Path) -> tuple[ZoneState, LoraSpec | None, dict[str, Any]]:
        """A saved run state, its LoraSpec (None: a full run's) and its user metadata;
        StateError when `directory` holds no training-run state."""
        state = read_state(directory)
        saved = state.meta.get("run")
        if not isinstance(saved, dict) or not ("lora" in saved or saved.get("full") is True):
            raise StateError(f"load_weights: {directory.name} is not a training-run state")
        spec = None if saved.get("full") is True else LoraSpec.from_json(saved["lora"])
        return state, spec, dict(saved.get("user_metadata") or {})

    def load_state(self, run_id: str, directory: Path, with_optimizer: bool) -> Run:
        """A new run `run_id` from a saved state: its weights (adapter, or the full model), step
        and (when `with_optimizer`) AdamW moments. StateError when there is no such state or it
        does not fit the base (or it is a full run's and FULL_FINETUNE_SETTING is off)."""
        state, spec, user_metadata = self._read_run_state(directory)
        return self._new_run_from(run_id, state, spec, user_metadata, with_optimizer)

    def _new_run_from(
        self, run_id: str, state: ZoneState, spec: LoraSpec | None, user_metadata: dict[str, Any], with_optimizer: bool
    ) -> Run:
        run = self.create_run(run_id, spec, user_metadata)
        try:
            with self._training(run):
                self._apply_state(run, state, with_optimizer)
        except BaseException:
            self.close_run(run_id)
            raise
        return run

    @staticmethod
    def _apply_state(run: Run, state: ZoneState, with_optimizer: bool) -> None:
        """Load `state` into the run's zone (hold its lock); without `with_optimizer` the AdamW
        moments start fresh. Nothing changes when the state does not fit."""
        if not with_optimizer:  # a fresh AdamW: no moments, the zone's own hyper-parameters
            state.tensors["optimizer.safetensors"] = {}
            state.meta.update(optimizer_scalars={}, param_groups=run.zone.optimizer.state_dict()["param_groups"])
        run.zone.check_part(state)
        run.zone.load_part(state)

    def reload(self, run_id: str, directory: Path, with_optimizer: bool) -> Run:
        """Replace run `run_id` by a saved state of the same kind (its weights, step, and AdamW
        moments when `with_optimizer`); the run is unchanged when loading fails. A full run
        loads in place (there is room for one full model). Samplers made from the run stay."""
        run = self._run(run_id)
        state, spec, user_metadata = self._read_run_state(directory)
        if (spec is None) != run.full:
            saved_kind, this_kind = ("a full fine-tune", "a LoRA") if spec is None else ("a LoRA", "a full fine-tune")
            raise StateError(f"load_weights: {directory.name} is {saved_kind} run's state; this run is {this_kind} run")
        if run.full:
            with run.lock:
                self._apply_state(run, state, with_optimizer)
            return run
        staging = f"{run_id}#loading"
        loaded = self._new_run_from(staging, state, spec, user_metadata, with_optimizer)
        self.close_run(run_id)
        self.runs.pop(staging)
        loaded.run_id = run_id
        self.runs[run_id] = loaded
        return loaded

    def save_sampler_weights(self, run_id: str, directory: Path) -> int:
        """The run's weights for sampling; returns the version saved. A LoRA run's: a peft
        adapter directory (loads with PeftModel.from_pretrained on the base); a full run's: a
        Hugging Face model directory (weights, config, tokenizer)."""
        run = self._run(run_id)
        with atomic_directory(directory, replace=True) as tmp:
            with self._training(run):
                if run.spec is None:
                    run.zone.export_hf(tmp)
                    self.tokenizer.save_pretrained(tmp)
                else:
                    self.host.save_adapter(run.adapter, tmp)  # type: ignore[arg-type]
                version = run.version
            kind = {"full": True} if run.spec is None else {"lora": run.spec.to_json()}
            (tmp / SAMPLER_META).write_text(json.dumps({**kind, "version": version, "run_id": run_id}, indent=2))
        return version

    def export_hf(self, run_id: str, directory: Path) -> None:
        """Same files as `save_sampler_weights`: a peft adapter directory, or (full run) a
        Hugging Face model directory."""
        self.save_sampler_weights(run_id, directory)

    # -- samplers -----------------------------------------------------------------------------

    def _freeze(self, model: PreTrainedModel) -> str:
        """Register a frozen whole model (and its engine) under a new name."""
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        name = self._new_name("full")
        self.frozen[name] = FrozenModel(model, TorchEngine(model, self.tokenizer, self.max_batch_sequences))
        return name

    def snapshot(self, run_id: str) -> SamplerInfo:
        """A frozen copy of the run's weights at its current version, held until `release_sampler`."""
        run = self._run(run_id)
        if run.full:
            with run.lock:
                return SamplerInfo(self._freeze(copy.deepcopy(run.zone.model)), run.version, run_id, full=True)
        with self.host.lock:
            adapter = self._new_name("snap")
            self.host.copy(run.adapter, adapter)  # type: ignore[arg-type]
            return SamplerInfo(adapter, run.version, run_id)

    def save_sampler(self, sampler: SamplerInfo, directory: Path) -> None:
        """Write a sampler's frozen weights to `directory` (atomically), as `load_sampler` reads
        them: a peft adapter directory, or a full model's Hugging Face directory."""
        if sampler.weights is None:
            raise StateError("save_sampler: the base model's sampler has no weights of its own")
        with atomic_directory(directory, replace=True) as tmp:
            if sampler.full:
                self._frozen_model(sampler).model.save_pretrained(tmp)
                self.tokenizer.save_pretrained(tmp)
                kind: dict[str, Any] = {"full": True}
            else:
                with self.host.lock:
                    if sampler.weights not in self.host.specs:
                        raise StateError(_RELEASED)
                    self.host.save_adapter(sampler.weights, tmp)
                    kind = {"lora": self.host.specs[sampler.weights].to_json()}
            (tmp / SAMPLER_META).write_text(json.dumps({**kind, "version": sampler.version, "run_id": sampler.run_id}))

    def load_sampler(self, directory: Path) -> SamplerInfo:
        """Frozen weights from a directory written by `save_sampler_weights`."""
        recover(directory)
        meta_path = directory / SAMPLER_META
        if not meta_path.is_file():
            raise StateError(f"no sampler weights at {directory}")
        meta = json.loads(meta_path.read_text())
        if meta.get("full") is True:
            return SamplerInfo(self._load_full_sampler(directory), int(meta["version"]), meta.get("run_id"), full=True)
        tensors = load_file(str(directory / "adapter_model.safetensors"))
        adapter = self._new_name("saved")
        host = self.host
        with host.lock:
            host.add(adapter, LoraSpec.from_json(meta["lora"]), trainable=False)
            try:
                load_tensors(host.named_parameters(adapter), tensors)
            except BaseException:
                host.remove(adapter)
                raise
        return SamplerInfo(adapter, int(meta["version"]), meta.get("run_id"))

    def _load_full_sampler(self, directory: Path) -> str:
        """The frozen model of a full run's sampler directory (held until `release_sampler`)."""
        cfg = self.config
        model = load_model(str(directory), cfg.dtype, cfg.device, cfg.trust_remote_code, cfg.attn_implementation)
        base = self.base_config
        mismatch = [k for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")
                    if getattr(model.config, k, None) != getattr(base, k, None)]
        if mismatch:
            raise StateError(f"these sampler weights are not a fine-tune of this base model (config differs in {mismatch})")
        return self._freeze(model)

    def base_sampler(self) -> SamplerInfo:
        self.host  # noqa: B018 - loads the base model
        return SamplerInfo(None, 0, None)

    def _frozen_model(self, sampler: SamplerInfo) -> FrozenModel:
        frozen = self.frozen.get(sampler.weights)  # type: ignore[arg-type]
        if frozen is None:
            raise StateError(_RELEASED)
        return frozen

    @contextmanager
    def _on(self, sampler: SamplerInfo) -> Iterator[None]:
        """The sampler's adapter active (or none, for the base) under the host lock."""
        host = self.host
        with host.lock:
            if sampler.weights is None:
                with host.base():
                    yield
                return
            if sampler.weights not in host.specs:
                raise StateError(_RELEASED)
            host.activate(sampler.weights)
            yield

    def draw_seed(self) -> int:
        """A seed for a call that gave none (from the manager's generator, seeded by the config)."""
        with self._load_lock:
            return int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))

    def sample(self, sampler: SamplerInfo, prompt: list[int], n: int, params: SamplingParams,
               on_step: OnStep | None = None) -> SampledGroup:
        """n samples of `prompt` with the sampler's weights, stamped with its version; `on_step`:
        the engine's step callback (rows 0..n-1; what it raises stops the call and propagates)."""
        validate_prompts([prompt], n, params, self.vocab_size, self.max_context)
        frozen = self._frozen_model(sampler) if sampler.full else None
        engine = frozen.engine if frozen is not None else self._engine_for()
        engine.validate([prompt], n, params)
        seed = params.seed if params.seed is not None else self.draw_seed()
        if frozen is not None:  # a frozen whole model: nothing to switch, nothing to lock
            return engine.generate([prompt], n, params, prompt_seeds(seed, 1), sampler.version, on_step)[0]
        with self._on(sampler):
            return engine.generate([prompt], n, params, prompt_seeds(seed, 1), sampler.version, on_step)[0]

    def prompt_logprobs(self, sampler: SamplerInfo, prompt: list[int]) -> list[float]:
        """log p(prompt[i] | prompt[:i]) for i >= 1 (len(prompt) - 1 values), by floe's scoring."""
        if len(prompt) < 2:
            return []
        batch = Batch([Group(prompt[:1], [Sample(tokens=prompt[1:])])])
        validate_batch(batch, self.vocab_size, self.max_context)
        if sampler.full:
            model = self._frozen_model(sampler).model
            with torch.no_grad():
                return score_batch(model, batch, 1.0, False, self.compute).logprobs[0][0]
        with self._on(sampler), torch.no_grad():
            model = self.host.view(sampler.weights) if sampler.weights is not None else self.host.model
            return score_batch(model, batch, 1.0, False, self.compute).logprobs[0][0]  # type: ignore[arg-type]

    def prompt_scores(
        self, sampler: SamplerInfo, prompt: list[int], topk: int = 0, target_ids: np.ndarray | None = None,
        alt_k: int = 0, temperature: float = 1.0, seed: int | None = None,
    ) -> PromptScores:
        """What the next-token distributions along `prompt` say, under the sampler's weights, one
        row per prompt position i >= 1 (row i - 1, the distribution after prompt[:i]), by floe's
        scoring (`scoring.next_token_logits`, one forward):
        * `topk`: the `topk` most likely tokens and their log-probs (temperature 1, like
          `prompt_logprobs`), most likely first;
        * `target_ids` [len(prompt) - 1, K] int64: the log-prob of each named id at its row
          (temperature 1; 0.0 where the id is -1);
        * `alt_k`: `alt_k` independent draws per row, with replacement, from the distribution at
          `temperature` (no top-k / top-p), and their log-probs under that distribution; at
          temperature 0 the argmax, with its temperature-1 log-prob (the sampler's rule for
          greedy). Draws are a pure function of `seed` and the row (`floe.sampler.noise`); no
          seed: one drawn per call.
        Checks are the caller's (floe.server.protocols.tinker.convert.sample_request)."""
        validate_prompts([prompt], 1, SamplingParams(max_tokens=1), self.vocab_size, self.max_context)
        rows = len(prompt) - 1
        if alt_k and seed is None:
            seed = self.draw_seed()
        parts: dict[str, list[torch.Tensor]] = {"topk_ids": [], "topk_logprobs": [], "target_logprobs": [],
                                                "alt_tokens": [], "alt_logprobs": []}
        ids_t = torch.as_tensor(target_ids) if target_ids is not None else None

        def consume(model: Any) -> None:
            for start, logits in next_token_logits(model, prompt, self.compute.logprob_chunk_tokens):
                logp = torch.log_softmax(logits, dim=-1)
                if topk:
                    values, index = torch.topk(logp, min(topk, logp.shape[-1]), dim=-1)
                    parts["topk_ids"].append(index.cpu())
                    parts["topk_logprobs"].append(values.cpu())
                if ids_t is not None:
                    cells = ids_t[start : start + logits.shape[0]].to(logp.device)
                    got = logp.gather(-1, cells.clamp_min(0)).masked_fill(cells < 0, 0.0)
                    parts["target_logprobs"].append(got.cpu())
                if alt_k:
                    assert seed is not None
                    tokens, lps = _alt_draws(logits, logp, alt_k, temperature, seed, start)
                    parts["alt_tokens"].append(tokens.cpu())
                    parts["alt_logprobs"].append(lps.cpu())

        with torch.no_grad():
            if sampler.full:
                consume(self._frozen_model(sampler).model)
            else:
                with self._on(sampler):
                    consume(self.host.view(sampler.weights) if sampler.weights is not None else self.host.model)

        def joined(name: str, width: int, dtype: Any) -> np.ndarray:
            if not parts[name]:
                return np.zeros((rows, width), dtype=dtype)
            return torch.cat(parts[name]).numpy().astype(dtype)

        k_targets = target_ids.shape[1] if target_ids is not None else 0
        return PromptScores(
            topk_ids=joined("topk_ids", topk, np.int64) if topk else None,
            topk_logprobs=joined("topk_logprobs", topk, np.float32) if topk else None,
            target_logprobs=joined("target_logprobs", k_targets, np.float32) if target_ids is not None else None,
            alt_tokens=joined("alt_tokens", alt_k, np.int64) if alt_k else None,
            alt_logprobs=joined("alt_logprobs", alt_k, np.float32) if alt_k else None,
        )


ALT_STREAM = 0x616C74  # "alt": the counter that separates alternative-token draws from sampling's


def _alt_draws(
    logits: torch.Tensor, logp: torch.Tensor, k: int, temperature: float, seed: int, first_row: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """k draws per row of `logits` [C, V] (prompt rows first_row ..): inverse transform sampling
    with uniforms keyed by (seed, row), as `noise.sample_categorical` draws one; their log-probs
    under the distribution drawn from. Temperature 0: the argmax k times (`logp` is the
    temperature-1 log-softmax)."""
    if temperature == 0:
        chosen = logits.argmax(dim=-1, keepdim=True).expand(-1, k)
        return chosen, logp.gather(-1, chosen)
    scaled = torch.log_softmax(logits / temperature, dim=-1)
    rows = torch.arange(first_row, first_row + logits.shape[0], device=logits.device)
    keys = derive_tensor(torch.full_like(rows, derive(seed, ALT_STREAM)), rows)
    u = uniforms(keys, k)  # [C, k]
    cdf = torch.softmax(logits.double() / temperature, dim=-1).cumsum(dim=-1)
    chosen = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_max(logits.shape[-1] - 1)
    return chosen, scaled.gather(-1, chosen)


@dataclass(frozen=True)
class PromptScores:
    """`RunManager.prompt_scores`' results as numpy arrays, one row per prompt position after
    the first (row i = position i + 1); None where not asked."""

    topk_ids: np.ndarray | None = None  # [L - 1, k] int64, most likely first
    topk_logprobs: np.ndarray | None = None  # [L - 1, k] float32
    target_logprobs: np.ndarray | None = None  # [L - 1, K] float32, 0.0 at cells of -1
    alt_tokens: np.ndarray | None = None  # [L - 1, k] int64
    alt_logprobs: np.ndarray | None = None  # [L - 1, k] float32


_RELEASED = "this sampler's weights were released (its session finished); save weights for a sampler again"
