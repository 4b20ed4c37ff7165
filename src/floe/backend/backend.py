"""The Backend: validates every request, then coordinates the policy, sampler and reference zones.

Each operation first checks its whole request (no lock taken, nothing changed by a rejected
request), then takes the locks of the zones it needs, always in the order policy, sampler,
reference, and asks the zones (`zones.py`) to do the work. Sampling holds the sampler
*shared*: several `sample` calls run together, and sampling overlaps training, which is what
asynchronous RL needs. A weight sync and a state load hold the sampler *exclusively*: they
wait for running samples, and samples that arrive meanwhile wait for them.

Versions: the policy's step counts optimizer steps; the sampler's version counts verified
syncs (`sync/`); every sample carries the sampler version that produced it.

Where the zones run is the placement's business (`floe.placement.build_zones`): this module
sees the zone protocols only. When the placement colocates policy and sampler on the same
devices, every operation validates its request, then holds its mode ("train", "sync" or
"sample") in a `locks.ModeLock`, before any zone lock, and the placement sleeps/wakes the zones
on a switch: a rejected request never moves memory.

A worker failure (WorkerFailed: a distributed placement's worker died or hung) fails the
backend: the surviving workers are released (`Zones.close`, once no operation is running), and
every later operation raises WorkerFailed at once, naming the original failure.
"""

from __future__ import annotations

import errno
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from floe.atomic import atomic_directory
from floe.backend.locks import ModeLock, SharedLock
from floe.backend.state import (
    delete_state_dir,
    list_states,
    read_meta,
    read_state,
    state_path,
    write_state,
)
from floe.backend.sync import WeightSync, verify
from floe.backend.validation import (
    VERSION_LIMIT,
    check_step_lr,
    check_temperature,
    resolve_temperature,
    validate_batch,
    validate_prompts,
)
from floe.compute.flops import TransformerShape, peak_flops, throughput_metrics
from floe.compute.losses import loss_capabilities, resolve_loss
from floe.config import BackendConfig
from floe.devices import check_device
from floe.errors import FloeError, InvalidInput, StateError, WorkerFailed
from floe.models import load_tokenizer
from floe.models.loading import check_model_source
from floe.placement import build_zones
from floe.sampler.engine import OnStep
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

EXPORT_MARKER = "floe_export.json"


def as_batch(batch: Any) -> Batch:
    """Accept a Batch or a plain list of Groups (DESIGN: a batch is a list of groups)."""
    if isinstance(batch, list) and all(isinstance(g, Group) for g in batch):
        return Batch(groups=batch)
    return batch


def _check_version_type(version: Any) -> None:
    if version is not None and type(version) is not int:
        raise InvalidInput("version", f"must be an int (a weights version tag) or None, got {version!r}")
    if version is not None and version > VERSION_LIMIT:
        raise InvalidInput("version", f"must be at most 2**63 - 1 (versions travel as signed 64-bit integers), got {version}")


# OSError numbers that mean "this path cannot hold an export" (answered as InvalidInput("path")).
_BAD_PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG,
                    errno.EROFS, errno.ENOENT, errno.ELOOP, errno.EINVAL}

class Backend:
    """All zones of one model, wherever the placement put them, behind the operations of the client API."""

    def __init__(self, config: BackendConfig):
        """Load the model into every zone. Before anything loads (or torch's threads and seed
        change), InvalidInput("device") for a device this torch cannot use and InvalidInput
        ("model" / "reference.checkpoint") for a model source that is not there."""
        check_device(config.device)
        check_model_source(config.model)
        if config.reference.enabled and config.reference.checkpoint:
            check_model_source(config.reference.checkpoint, "reference.checkpoint")
        self.config = config
        if config.num_threads is not None:
            # Small models on few cores run faster single-threaded than with oversubscribed
            # OpenMP pools (measured in docs/benchmarks.md).
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model, config.trust_remote_code)
        self.zones = build_zones(config, self.tokenizer)
        self.vocab_size = self.zones.vocab_size
        self.max_context = self.zones.max_context
        self.policy = self.zones.policy
        self.sampler = self.zones.sampler
        self.reference = self.zones.reference
        self.weight_sync: WeightSync = self.zones.weight_sync
        self._mode = ModeLock(self.zones.switch_mode) if self.zones.colocated else None
        self.state_dir = Path(config.state_dir)
        self._policy_lock = threading.RLock()
        self._sampler_lock = SharedLock()
        self._reference_lock = threading.RLock()
        self._failed: WorkerFailed | None = None
        self._running = 0
        self._health = threading.Lock()
        self._init_throughput()

    def _init_throughput(self) -> None:
        """What the throughput metrics need (floe.compute.flops): the model's shape (None for
        an architecture the formula does not cover), the policy's device name, the peak FLOP/s
        of one of its devices (None: unknown) and their number."""
        self._shape = TransformerShape.from_config(
            AutoConfig.from_pretrained(self.config.model, trust_remote_code=self.config.trust_remote_code))
        weights = self.policy.describe()
        self._device_name = weights.get("device_name", "unknown")
        self._peak_flops = peak_flops(self._device_name, weights["dtype"], self.config.compute.peak_tflops)
        self._peak_source = None if self._peak_flops is None else (
            "compute.peak_tflops" if self.config.compute.peak_tflops is not None else "datasheet")
        self._policy_devices = self.zones.policy_devices

    def _measured(self, batch: Batch, seconds: float, backward: bool) -> dict[str, float]:
        seqlens = [len(g.prompt) + len(s.tokens) for g in batch.groups for s in g.samples]
        return throughput_metrics(self._shape, seqlens, seconds, self._peak_flops, self._policy_devices, backward)

    @contextmanager
    def _op(self, mode: str | None = None) -> Iterator[None]:
        """Run an operation (its request already validated): refused at once when the backend
        failed; holding `mode` of the ModeLock (colocated zones; None: no mode). A WorkerFailed
        it raises fails the backend (module docstring)."""
        with self._health:
            if self._failed is not None:
                raise self._failed_again()
            self._running += 1
        try:
            if self._mode is None or mode is None:
                yield
            else:
                with self._mode.hold(mode):
                    yield
        except WorkerFailed as e:
            with self._health:
                if self._failed is None:
                    self._failed = e
            raise
        finally:
            with self._health:
                self._running -= 1
                release = self._failed is not None and self._running == 0
            if release:
                self.zones.close()  # the survivors' devices go back; idempotent

    def _failed_again(self) -> WorkerFailed:
        first = self._failed
        assert first is not None
        return WorkerFailed(first.zone, first.rank, f"this backend failed earlier ({first.message.split('; close')[0]}); "
                            "close it and start a fresh one from the last saved state")

    # -- operations -----------------------------------------------------------------------
    # Each operation validates its request first (nothing locked, no mode taken, no zone
    # called), then runs inside `_op(mode)`.

    def sample(self, prompts: list[list[int]], n: int = 1, params: SamplingParams | None = None) -> SampleResult:
        """n samples per prompt from the sampler (default SamplingParams()); runs alongside other
        sample calls and training. InvalidInput names a bad field."""
        params = params if params is not None else SamplingParams()
        validate_prompts(prompts, n, params, self.vocab_size, self.max_context)
        with self._op():
            self.sampler.validate(prompts, n, params)  # the engine's own limits (asks a worker: no mode needed)
        with self._op("sample"), self._sampler_lock.shared():
            return self.sampler.sample(prompts, n, params)

    def sample_streaming(self, prompts: list[list[int]], n: int, params: SamplingParams | None,
                         on_step: OnStep) -> SampleResult:
        """`sample`, with `on_step` called once per decode step with that step's tokens
        (`floe.sampler.engine.StepToken`: row = gi * n + k, token id, log-prob), in the thread
        that generates: live when `streams_tokens`, else replayed from the finished samples.
        Raising `floe.sampler.engine.StopGeneration` (or anything) in `on_step` stops the
        generation and propagates. The returned result equals `sample`'s; InvalidInput as
        `sample` (raised before any step)."""
        params = params if params is not None else SamplingParams()
        validate_prompts(prompts, n, params, self.vocab_size, self.max_context)
        with self._op():
            self.sampler.validate(prompts, n, params)
        with self._op("sample"), self._sampler_lock.shared():
            return self.sampler.sample(prompts, n, params, on_step)

    @property
    def streams_tokens(self) -> bool:
        """Whether `sample_streaming` reports tokens while they are generated (the torch and
        vLLM engines in this process) or replays them after the call (a Ray placement)."""
        return self.sampler.streams_tokens

    def forward(
        self, batch: Batch, zone: str = "policy", temperature: float | None = None, with_entropy: bool = False
    ) -> ForwardResult:
        """Per-token log-probs [group][sample][token] (and entropies) from the policy or the
        reference zone at `temperature` (None: the samples'; validation.resolve_temperature),
        without gradients."""
        batch = as_batch(batch)
        temperature = check_temperature(temperature)
        validate_batch(batch, self.vocab_size, self.max_context)
        temperature = resolve_temperature(batch, temperature)
        if type(with_entropy) is not bool:
            raise InvalidInput("with_entropy", f"must be true or false, got {with_entropy!r}")
        if zone not in ("policy", "reference"):
            raise InvalidInput("zone", f"must be 'policy' or 'reference', got {zone!r}")
        if zone == "reference" and self.reference is None:
            raise InvalidInput("zone", "the reference zone is disabled (reference.enabled = false)")
        with self._op("train"):
            if zone == "policy":
                with self._policy_lock:
                    start = time.perf_counter()
                    result = self.policy.forward(batch, temperature, with_entropy)
            else:
                assert self.reference is not None
                with self._reference_lock:
                    start = time.perf_counter()
                    result = self.reference.forward(batch, temperature, with_entropy)
            seconds = time.perf_counter() - start
        result.metrics.update(self._measured(batch, seconds, backward=False))
        return result

    def forward_backward(
        self,
        batch: Batch,
        loss: str = "cross_entropy",
        loss_config: dict[str, Any] | None = None,
        temperature: float | None = None,
    ) -> ForwardBackwardResult:
        """Loss `loss` (config `loss_config`, defaults resolved) and its gradients, added to
        those of earlier calls until optim_step; scored at `temperature` (None: the samples')."""
        batch = as_batch(batch)
        temperature = check_temperature(temperature)
        spec = resolve_loss(loss, loss_config)
        validate_batch(batch, self.vocab_size, self.max_context, spec)
        temperature = resolve_temperature(batch, temperature)
        with self._op("train"), self._policy_lock:
            start = time.perf_counter()
            result = self.policy.forward_backward(batch, spec, temperature)
            seconds = time.perf_counter() - start
        result.metrics.update(self._measured(batch, seconds, backward=True))
        return result

    def optim_step(self, lr: float | None = None) -> OptimStepResult:
        """Apply the accumulated gradients at `lr` (None: the configured schedule's rate);
        InvalidInput("lr") for a rate outside [0, 1], StateError when no gradients are pending
        or they are not finite. Nothing changes on either error."""
        lr = check_step_lr(lr)
        with self._op("train"), self._policy_lock:
            return self.policy.optim_step(lr)

    def sync_weights(self, version: int | None = None) -> SyncResult:
        """Policy weights → sampler, verified by fingerprints; the sampler's version becomes
        `version` (a caller's tag, > the current version) or, when None, the current one + 1.
        Waits for running samples. StateError (nothing changed) for non-finite weights;
        InvalidInput("version") (nothing changed) for a tag that is not a larger int. Any other
        failure raises StateError with the version unchanged, and a sampler that had already
        taken weights refuses to sample until a sync succeeds (`backend.sampler`). A sampler
        engine of another dtype than the policy gets the weights cast to its dtypes, verified
        as cast (`sync.cast_for`)."""
        _check_version_type(version)
        self._check_version_tag(version)  # before the mode switch; again under the lock
        with self._op("sync"), self._policy_lock, self._sampler_lock.exclusive():
            start = time.perf_counter()
            current = self.sampler.version
            self._check_version_tag(version)
            sent = self._push_policy_weights()
            self.sampler.set_version(current + 1 if version is None else version)
            return SyncResult(self.sampler.version, sent, time.perf_counter() - start)

    def _check_version_tag(self, version: int | None) -> None:
        current = self.sampler.version
        if version is not None and version <= current:
            raise InvalidInput("version", f"must be greater than the sampler's current version {current}, got {version}")
        if version is None and current >= VERSION_LIMIT:
            raise InvalidInput("version", f"the sampler's version {current} is the largest a version can be (2**63 - 1); "
                               "no later sync can be numbered (start from a state with a smaller version)")

    def _push_policy_weights(self) -> int:
        """weight_sync.sync → verify; returns the bytes of one copy of the weights. Hold both locks."""
        report = self.weight_sync.sync(self.policy, self.sampler)
        verify(report.published, report.received)
        return report.bytes

    def save_state(self, name: str) -> StateResult:
        """Save every zone's state as `<state_dir>/<name>` (replacing a state of that name).
        StateError while gradients wait for optim_step, and when the save fails (a directory
        that cannot be written, a file the policy cannot store): an error of that save, which
        writes nothing and leaves an earlier state of that name as it was."""
        path = state_path(self.state_dir, name)
        name = path.name
        with self._op("train"), self._policy_lock, self._sampler_lock.shared():
            try:
                # The policy writes its own files (a sharded policy: its ranks' shards) into the temp directory.
                write_state(path, [self.sampler.save_state()], self.config.model, save_policy=self.policy.save_state)
            except FloeError:
                raise
            except Exception as e:  # noqa: BLE001 - OSError, safetensors' errors: this save failed, nothing else
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise StateError(f"save_state: saving {name!r} to {path} failed ({type(e).__name__}: {first[:300]}); "
                                 "nothing was written and an earlier state of that name is unchanged") from None
            return StateResult(name, str(path), self.policy.step, self.sampler.version)

    def load_state(self, name: str) -> StateResult:
        """Restore a saved state. The sampler gets the restored policy weights and the saved
        version; gradients not yet applied are discarded. A state that does not fit changes nothing."""
        path = state_path(self.state_dir, name)
        read_state(path, files=())  # a missing or unreadable state: StateError before the mode switch
        with self._op("sync"), self._policy_lock, self._sampler_lock.exclusive():
            state = read_state(path, files=("rng.safetensors",))  # the policy reads its own files
            self.policy.check_state(path, state.meta)
            self.sampler.check_state(state)
            self.policy.load_state(path, state.meta)
            self._push_policy_weights()
            self.sampler.load_state(state)
            return StateResult(name, str(path), self.policy.step, self.sampler.version)

    def delete_state(self, name: str) -> StateResult:
        """Remove a saved state; returns what it held. StateError when there is none of that name."""
        path = state_path(self.state_dir, name)
        with self._policy_lock:  # save_state and load_state hold it too
            try:
                meta = read_meta(path)
            except StateError:  # a damaged state.json: the state goes all the same
                meta = {}
            if meta is None:
                raise StateError(f"delete_state: no saved state named {name!r} in {self.state_dir}")
            delete_state_dir(path)
            step, version = meta.get("step"), meta.get("sampler_version")
            return StateResult(name, str(path), step if type(step) is int else -1,
                               version if type(version) is int else -1)

    def list_states(self) -> list[str]:
        """Names of the saved states, sorted (`state.list_states`: interrupted swaps finished first)."""
        return list_states(self.state_dir)

    def export_hf(self, path: str) -> str:
        """Write the policy as an ordinary HF model directory (weights + config + tokenizer).

        The target must be new, empty, or an earlier floe export (it carries EXPORT_MARKER):
        an export never replaces a directory floe did not write."""
        if not isinstance(path, str) or not path or "\x00" in path or len(path) > 4096:
            raise InvalidInput("path", "must be a non-empty directory path (no NUL, at most 4096 characters)")
        target = Path(path)
        try:
            if target.exists() and not (
                target.is_dir() and (not any(target.iterdir()) or (target / EXPORT_MARKER).is_file())
            ):
                raise InvalidInput("path", f"{path} exists and is not an earlier floe export; choose a new or empty directory")
            with self._op("train"), self._policy_lock, atomic_directory(target, replace=True) as tmp:
                self.policy.export_hf(tmp)
                self.tokenizer.save_pretrained(tmp)
                (tmp / EXPORT_MARKER).write_text(json.dumps({"step": self.policy.step, "model": self.config.model}) + "\n")
        except OSError as exc:
            if exc.errno in _BAD_PATH_ERRNOS:  # the path's fault, not the server's
                raise InvalidInput("path", f"cannot write an export at {path}: {exc.strerror}") from None
            raise
        return str(target)

    def info(self) -> Info:
        """Model, zones, step and versions, dtype/device and capabilities."""
        with self._op(), self._policy_lock, self._sampler_lock.shared():
            weights = self.policy.describe()
            return Info(
                model=self.config.model,
                zones=["policy", "sampler"] + (["reference"] if self.reference else []),
                step=self.policy.step,
                policy_version=self.policy.step,
                sampler_version=self.sampler.version,
                vocab_size=self.vocab_size,
                max_context=self.max_context,
                dtype=weights["dtype"],
                device=weights["device"],
                capabilities={
                    **loss_capabilities(),
                    "sampler_engine": self.sampler.engine_name,
                    "sampler_streams_tokens": self.sampler.streams_tokens,
                    "sampler_engine_start_seconds": self.zones.engine_start_seconds(),
                    "pending_forward_backward_calls": self.policy.pending_calls,
                    "placement": self.zones.describe(),
                    "device_name": weights.get("device_name", "unknown"),
                    "policy_devices": self._policy_devices,
                    "peak_flops": self._peak_flops,
                    "peak_flops_source": self._peak_source,
                    "model_flops": self._shape is not None,
                    "zones_memory": self.zones.memory(),
                    "optimizer": {"name": "adamw", **self.config.optimizer.model_dump(mode="json")},
                    "lora": None if self.config.lora is None else self.config.lora.model_dump(mode="json"),
                },
            )

    def close(self) -> None:
        """Release the zones' resources (engines; workers of a distributed placement). Idempotent."""
        self.zones.close()
