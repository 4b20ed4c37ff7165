"""The Backend: owns the policy, sampler and reference zones and routes every operation.

It validates each request completely before any zone runs (so a rejected request changes
nothing), serialises operations per zone (sampling may overlap training, which is what
asynchronous RL needs; a sync or a state load holds both zones), and keeps the weight versions: the policy's step counts optimizer steps, the sampler's version
counts syncs, and every sample carries the sampler version that produced it.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from pathlib import Path
from typing import Any

import torch

from floe.backend.policy import PolicyZone
from floe.backend.reference import ReferenceZone
from floe.backend.sampler import SamplerZone
from floe.backend.state import atomic_directory, check_state_name, read_state, recover_all, save_state
from floe.backend.validation import validate_batch, validate_prompts
from floe.backend.weights import copy_weights
from floe.compute.losses import resolve_loss
from floe.config import BackendConfig
from floe.errors import InvalidInput, StateError
from floe.models import load_model, load_tokenizer
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


def _check_temperature(temperature: Any) -> float:
    if type(temperature) not in (int, float) or not 0 < temperature < float("inf"):
        raise InvalidInput("temperature", f"must be a finite number > 0, got {temperature!r}")
    return float(temperature)


class Backend:
    def __init__(self, config: BackendConfig):
        self.config = config
        if config.num_threads is not None:
            # Small models on few cores run faster single-threaded than with oversubscribed
            # OpenMP pools (measured in docs/benchmarks.md).
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model, config.trust_remote_code)
        policy_model = load_model(config.model, config.dtype, config.device, config.trust_remote_code)
        sampler_model = copy.deepcopy(policy_model)
        sampler_model.eval()
        ref_model = None
        if config.reference.enabled:
            if config.reference.checkpoint:
                ref_model = load_model(config.reference.checkpoint, config.dtype, config.device, config.trust_remote_code)
            else:
                ref_model = copy.deepcopy(policy_model)
        self.policy = PolicyZone(policy_model, config.optimizer, config.compute)
        self.sampler = SamplerZone(sampler_model, self.tokenizer, config.sampler.max_batch_sequences, config.seed)
        self.reference = (
            ReferenceZone(ref_model, config.compute, config.reference.checkpoint or config.model)
            if ref_model is not None
            else None
        )
        self.vocab_size = int(policy_model.config.vocab_size)
        self.max_context = int(getattr(policy_model.config, "max_position_embeddings", 2**31))
        self.state_dir = Path(config.state_dir)
        self._policy_lock = threading.RLock()
        self._sampler_lock = threading.RLock()
        self._reference_lock = threading.RLock()

    @contextlib.contextmanager
    def _holding(self, *zones: str):
        """Hold the named zones' locks, always acquired in the order policy, sampler, reference."""
        locks = {"policy": self._policy_lock, "sampler": self._sampler_lock, "reference": self._reference_lock}
        with contextlib.ExitStack() as stack:
            for name in ("policy", "sampler", "reference"):
                if name in zones:
                    stack.enter_context(locks[name])
            yield

    # -- operations -----------------------------------------------------------------------

    def sample(self, prompts: list[list[int]], n: int = 1, params: SamplingParams | None = None) -> SampleResult:
        params = params if params is not None else SamplingParams()
        with self._holding("sampler"):
            validate_prompts(prompts, n, params, self.vocab_size, self.max_context)
            if n > self.sampler.max_batch_sequences:
                raise InvalidInput(
                    "n", f"{n} samples per prompt exceed sampler.max_batch_sequences ({self.sampler.max_batch_sequences})"
                )
            return self.sampler.sample(prompts, n, params)

    def forward(
        self, batch: Batch, zone: str = "policy", temperature: float = 1.0, with_entropy: bool = False
    ) -> ForwardResult:
        batch = as_batch(batch)
        with self._holding("reference" if zone == "reference" else "policy"):
            temperature = _check_temperature(temperature)
            validate_batch(batch, self.vocab_size, self.max_context)
            if type(with_entropy) is not bool:
                raise InvalidInput("with_entropy", f"must be true or false, got {with_entropy!r}")
            if zone == "policy":
                return self.policy.forward(batch, temperature, with_entropy)
            if zone == "reference":
                if self.reference is None:
                    raise InvalidInput("zone", "the reference zone is disabled (reference.enabled = false)")
                return self.reference.forward(batch, temperature, with_entropy)
            raise InvalidInput("zone", f"must be 'policy' or 'reference', got {zone!r}")

    def forward_backward(
        self,
        batch: Batch,
        loss: str = "cross_entropy",
        loss_config: dict[str, Any] | None = None,
        temperature: float = 1.0,
    ) -> ForwardBackwardResult:
        batch = as_batch(batch)
        with self._holding("policy"):
            temperature = _check_temperature(temperature)
            spec = resolve_loss(loss, loss_config)
            validate_batch(batch, self.vocab_size, self.max_context, spec)
            return self.policy.forward_backward(batch, spec, temperature)

    def optim_step(self) -> OptimStepResult:
        with self._holding("policy"):
            return self.policy.optim_step()

    def sync_weights(self) -> SyncResult:
        with self._holding("policy", "sampler"):
            report = copy_weights(self.policy.model, self.sampler.model)
            self.sampler.version += 1
            return SyncResult(self.sampler.version, report.bytes, report.seconds, verified=True)

    def save_state(self, name: str) -> StateResult:
        with self._holding("policy", "sampler"):
            name = check_state_name(name)
            if self.policy.pending_calls:
                raise StateError(
                    "save_state: gradients from forward_backward are waiting for optim_step and would be lost; "
                    "call optim_step first"
                )
            path = self.state_dir / name
            save_state(
                path, self.policy.model, self.policy.optimizer, self.policy.step,
                self.sampler.version, self.sampler.generator.get_state(), self.config.model,
            )
            return StateResult(name, str(path), self.policy.step, self.sampler.version)

    def load_state(self, name: str) -> StateResult:
        """Restore a saved state. The sampler gets the restored policy weights and the saved
        version; gradients not yet applied are discarded."""
        with self._holding("policy", "sampler"):
            name = check_state_name(name)
            path = self.state_dir / name
            loaded = read_state(path, self.policy.model, self.policy.optimizer)
            with torch.no_grad():
                self.policy.model.load_state_dict(loaded.weights, strict=True)
            self.policy.optimizer.load_state_dict(loaded.optimizer_state)
            self.policy.optimizer.zero_grad(set_to_none=True)
            self.policy.pending_calls = 0
            self.policy.step = loaded.step
            copy_weights(self.policy.model, self.sampler.model)
            self.sampler.version = loaded.sampler_version
            self.sampler.generator.set_state(loaded.sampler_rng)
            torch.set_rng_state(loaded.torch_rng)
            return StateResult(name, str(path), loaded.step, loaded.sampler_version)

    def list_states(self) -> list[str]:
        if not self.state_dir.is_dir():
            return []
        recover_all(self.state_dir)
        return sorted(p.name for p in self.state_dir.iterdir() if (p / "state.json").is_file() and not p.name.startswith("."))

    def export_hf(self, path: str) -> str:
        """Write the policy as an ordinary HF model directory (weights + config + tokenizer).

        The target must be new, empty, or an earlier floe export (it carries EXPORT_MARKER):
        an export never replaces a directory floe did not write."""
        with self._holding("policy"):
            if not isinstance(path, str) or not path:
                raise InvalidInput("path", "must be a non-empty directory path")
            target = Path(path)
            if target.exists() and not (
                target.is_dir() and (not any(target.iterdir()) or (target / EXPORT_MARKER).is_file())
            ):
                raise InvalidInput("path", f"{path} exists and is not an earlier floe export; choose a new or empty directory")
            with atomic_directory(target) as tmp:
                self.policy.model.save_pretrained(tmp, safe_serialization=True)
                self.tokenizer.save_pretrained(tmp)
                (tmp / EXPORT_MARKER).write_text(f'{{"step": {self.policy.step}, "model": "{self.config.model}"}}\n')
            return str(target)

    def info(self) -> Info:
        with self._holding("policy", "sampler"):
            p = next(self.policy.model.parameters())
            return Info(
                model=self.config.model,
                zones=["policy", "sampler"] + (["reference"] if self.reference else []),
                step=self.policy.step,
                policy_version=self.policy.step,
                sampler_version=self.sampler.version,
                vocab_size=self.vocab_size,
                max_context=self.max_context,
                dtype=str(p.dtype).removeprefix("torch."),
                device=str(p.device),
                capabilities={
                    "losses": ["cross_entropy", "importance_sampling", "ppo", "cispo", "gspo"],
                    "aggregations": ["sum", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"],
                    "sampler_engine": self.config.sampler.engine,
                    "pending_forward_backward_calls": self.policy.pending_calls,
                },
            )
