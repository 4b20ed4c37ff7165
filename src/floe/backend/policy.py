"""The policy zone: the trainable model, its AdamW optimizer, LR schedule and step counter.

It implements `zones.PolicyWorker`: besides training it publishes its weights for a sync
(`publish`) and saves/loads its own state (weights, optimizer, step, torch RNG) into a state
directory (`save_state(dir)`, layout "full" of `state.py`; it also loads the "sharded" layout
of `policy_sharded`, so a resume works across placements). `state_part` / `check_part` /
`load_part` are the same state in memory as a `state.ZoneState` (the training runs of
`runs.py` keep theirs that way).

The micro-batch loop (`accumulate_microbatches`: score, loss, backward per micro-batch) is
shared with the data-parallel `policy_sharded.ShardedPolicyZone`; only how a micro-batch is
scored differs (here the model directly, there through FSDP).

`forward_backward` adds gradients (it never zeroes them); `optim_step` applies everything
accumulated since the last step, then zeroes. Each `forward_backward` call is aggregated on
its own: the loss's denominators (token count, sample count, norm length) are computed over
the whole call's batch before it is cut into micro-batches, so micro-batching never changes
the result.

Mixed precision (`MasterWeights`): a model loaded in bfloat16 computes forward and backward
in bf16, but AdamW owns fp32 master copies of the trainable parameters and their fp32 moments.
Each parameter's bf16 gradient is added into its master's fp32 gradient as soon as backward
produces it (so accumulation over micro-batches and calls is fp32), `optim_step` clips and
steps the masters, then rounds them back into the bf16 parameters. A bf16 model never steps
its bf16 weights directly: updates of about lr, far below bf16's spacing, still accumulate.
An fp32 model has no masters and runs exactly the plain path. Saved states carry the fp32
masters, so a bf16 resume is exact.

Resuming with a changed optimizer config: the configured hyper-parameters win. A loaded state
restores the AdamW moments, step counts and the policy's step; lr (through `lr_at` and the
restored step), betas, eps, weight_decay and every other AdamW param-group key come from this
zone's `OptimizerConfig`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from floe.backend import state_sharded
from floe.backend.data_parallel import batch_scales
from floe.backend.scoring import plan_batch, score_batch, score_microbatch, uses_prefix_dedup
from floe.backend.state import (
    TIED,
    ZoneState,
    policy_layout,
    read_policy_files,
    saved_shapes,
    tied_names,
    with_tied,
    write_policy_files,
)
from floe.backend.weights import WeightsSnapshot, fingerprints
from floe.compute.layout import MicroBatch
from floe.compute.losses import LossSpec, SampleScales, TokenInputs, batch_statistic, compute_loss, finalize_metrics
from floe.config import FLOAT16_REFUSED, ComputeConfig, OptimizerConfig
from floe.devices import device_name
from floe.errors import InvalidInput, StateError
from floe.types import Batch, ForwardBackwardResult, ForwardResult, OptimStepResult


def lr_at(step: int, cfg: OptimizerConfig) -> float:
    """The learning rate used by optimizer step number `step` (0-based)."""
    if cfg.schedule == "constant":
        return cfg.lr
    warm = cfg.warmup_steps
    if warm and step < warm:
        return cfg.lr * (step + 1) / warm
    if cfg.schedule == "linear_warmup":
        return cfg.lr
    assert cfg.total_steps is not None
    progress = min(1.0, (step - warm) / max(1, cfg.total_steps - warm))
    floor = cfg.min_lr_ratio
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def disable_dropout(model: torch.nn.Module) -> None:
    """RL log-probs must be deterministic functions of the weights: no dropout, ever.

    Besides nn.Dropout modules, attention modules keep their own float rate (copied from the
    config when built) and apply it whenever the model is in train mode, which gradient
    checkpointing requires; those attributes are zeroed too."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(getattr(model.config, key, None), float):
            setattr(model.config, key, 0.0)


def prepare_model(model: PreTrainedModel, compute: ComputeConfig) -> None:
    """What every policy does to its model first: dropout off, gradient checkpointing when configured."""
    disable_dropout(model)
    if compute.gradient_checkpointing:
        # transformers 5 renamed the method; older releases only have the first name.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # HF only checkpoints in train mode; dropout is already off


ScoreFn = Callable[[MicroBatch], tuple[torch.Tensor, torch.Tensor | None]]


def score_flat(
    model: PreTrainedModel, batch: Batch, mb: MicroBatch, temperature: float, with_entropy: bool, compute: ComputeConfig
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [T] (and entropies [T]) of the micro-batch's sample tokens, samples in part order."""
    scored = score_microbatch(model, batch, mb, temperature, with_entropy, compute)
    logp = torch.cat([lp for part in scored for lp in part.logprobs])
    entropy = torch.cat([e for part in scored for e in (part.entropy or [])]) if with_entropy else None
    return logp, entropy


def accumulate_microbatches(
    score: ScoreFn,
    batch: Batch,
    plan: list[MicroBatch],
    scales: SampleScales,
    spec: LossSpec,
    device: torch.device,
    stats: list[list[float]] | None = None,
) -> tuple[list[list[list[float]]], list[dict[str, float]]]:
    """Loss and backward per micro-batch of `plan`; the policy log-probs [group][sample][token]
    of `batch` and the micro-batches' metric sums (for `finalize_metrics`).

    `score(mb)` gives the micro-batch's log-probs and entropies with autograd (`score_flat`);
    `scales` holds the aggregation scales of each term for every sample of `batch`, in order
    (`batch_scales`, or the global scales a data-parallel share carries); `stats[k]` the loss's batch statistic for
    each token of that sample (`batch_token_stats` over the whole call; required exactly when
    the loss has one). Gradients add into the parameters' .grad."""
    if (stats is None) != (spec.definition.batch_statistic is None):
        raise ValueError(f"loss {spec.name!r}: batch statistics must be given exactly when the loss has one")
    first_of_group = [0]
    for g in batch.groups:
        first_of_group.append(first_of_group[-1] + len(g.samples))
    logprobs: list[list[list[float]]] = [[[] for _ in g.samples] for g in batch.groups]
    parts_metrics: list[dict[str, float]] = []
    for mb in plan:
        logp, entropy = score(mb)
        assert entropy is not None
        mb_samples = [(p.group, i) for p in mb.parts for i in p.samples]
        lens = [len(batch.groups[g].samples[i].tokens) for g, i in mb_samples]
        sample_logps = torch.split(logp, lens)
        mb_scales = scales.pick([first_of_group[g] + i for g, i in mb_samples])
        inputs = _token_inputs(batch, mb_samples, mb_scales, logp, entropy, spec, device)
        if stats is not None:
            inputs.batch_stat = torch.tensor([v for g, i in mb_samples for v in stats[first_of_group[g] + i]],
                                             dtype=logp.dtype, device=device)
        loss, sums = compute_loss(spec, inputs)
        loss.backward()
        parts_metrics.append(sums)
        for (gi, si), lp in zip(mb_samples, sample_logps):
            logprobs[gi][si] = lp.detach().tolist()
    return logprobs, parts_metrics


def batch_token_stats(
    batch: Batch, spec: LossSpec, logprobs: list[list[list[float]]], device: torch.device
) -> list[list[float]] | None:
    """The loss's batch statistic (`LossDef.batch_statistic`) for every token of `batch`, one
    list per sample in group, then sample order, from the policy log-probs `logprobs`
    [group][sample][token] of a no-grad pre-pass over the whole call; None when the loss has
    none. Computed once per forward_backward, so it is global over the call whatever the
    micro-batching (or data-parallel split) that follows."""
    if spec.definition.batch_statistic is None:
        return None
    samples = [(g, i) for g, group in enumerate(batch.groups) for i in range(len(group.samples))]
    lens = [len(batch.groups[g].samples[i].tokens) for g, i in samples]
    logp = torch.tensor([v for g, i in samples for v in logprobs[g][i]], dtype=torch.float32, device=device)
    ones = [1.0] * len(samples)
    inputs = _token_inputs(batch, samples, SampleScales(ones, ones, ones), logp, torch.zeros_like(logp), spec, device)
    stat = batch_statistic(spec, inputs)
    assert stat is not None
    return [part.tolist() for part in torch.split(stat, lens)]


NONFINITE_STEP = (
    "optim_step: the accumulated gradient norm is {}; the step was not applied and the "
    "accumulated gradients were discarded (weights, optimizer state and step are unchanged). "
    "Check the advantages and weights of the last forward_backward calls."
)
NO_PENDING = "optim_step: no forward_backward since the last step; nothing to apply"
PENDING_SAVE = (
    "save_state: gradients from forward_backward are waiting for optim_step and would be lost; call optim_step first"
)


def check_saved_policy(
    saved: dict[str, tuple[int, ...]], live: dict[str, tuple[int, ...]], meta: dict[str, Any], num_params: int, has_rng: bool
) -> None:
    """StateError unless saved weights (name -> shape) fit the live model's, the saved optimizer
    covers `num_params` parameters, and the state has a step and the policy's RNG."""
    if saved.keys() != live.keys():
        diff = sorted(set(saved) ^ set(live))[:5]
        raise StateError(f"load_state: saved weights do not match this model (e.g. {diff})")
    for k, shape in saved.items():
        if tuple(shape) != tuple(live[k]):
            raise StateError(f"load_state: {k} has shape {tuple(shape)}, the model {tuple(live[k])}")
    groups = meta.get("param_groups")
    if not isinstance(groups, list) or sum(len(g["params"]) for g in groups) != num_params:
        raise StateError("load_state: the saved optimizer covers a different set of parameters")
    if not has_rng or type(meta.get("step")) is not int:
        raise StateError("load_state: the state has no step or torch RNG; it is not a floe state")


class MasterWeights:
    """fp32 master copies of low-precision trainable parameters, which the optimizer steps.

    `params` are the model's parameters (compute dtype, e.g. bf16); `masters[i]` is the fp32
    copy of `params[i]`. A post-accumulate-grad hook moves every gradient backward produces
    into `masters[i].grad` (fp32 addition) and frees the bf16 one, so `params[i].grad` stays
    None. `copy_back` rounds the masters into the parameters (round to nearest even).
    """

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        with torch.no_grad():
            self.masters = [p.detach().to(torch.float32, copy=True).requires_grad_(True) for p in params]
        for param, master in zip(params, self.masters):
            param.register_post_accumulate_grad_hook(self._mover(master))

    @staticmethod
    def _mover(master: torch.Tensor) -> Any:
        def move(param: torch.Tensor) -> None:
            grad = param.grad
            assert grad is not None
            if master.grad is None:
                master.grad = grad.to(torch.float32, copy=True)
            else:
                master.grad.add_(grad)
            param.grad = None

        return move

    @torch.no_grad()
    def copy_back(self) -> None:
        """params ← masters, rounded to the parameters' dtype."""
        for param, master in zip(self.params, self.masters):
            param.copy_(master)

    @torch.no_grad()
    def load(self, values: list[torch.Tensor]) -> None:
        """masters ← `values` (any float dtype, one per parameter), then `copy_back`."""
        for master, value in zip(self.masters, values):
            master.copy_(value)
        self.copy_back()


def make_adamw(params: list[torch.Tensor], cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over `params` with the configured hyper-parameters (the lr of each step is set
    by `lr_at` before it is taken)."""
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def clip_and_step(
    optimizer: torch.optim.Optimizer, grads: list[torch.Tensor], grad_norm: float, cfg: OptimizerConfig, step: int,
    lr: float | None = None,
) -> float:
    """Scale `grads` to `cfg.grad_clip` when their (finite, global) norm `grad_norm` exceeds it,
    set the lr (`lr`, the caller's rate for this step, or when None that of optimizer step
    number `step` under `cfg`'s schedule, `lr_at`), step and zero the gradients; returns that
    lr. The clip factor is torch.nn.utils.clip_grad_norm_'s, max_norm / (norm + 1e-6), applied
    only once the norm is known finite."""
    max_norm = cfg.grad_clip
    if max_norm is not None and grad_norm > max_norm:
        scale = max_norm / (grad_norm + 1e-6)
        for g in grads:
            g.mul_(scale)
    lr = lr_at(step, cfg) if lr is None else lr
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return lr


def needs_masters(params: list[torch.nn.Parameter]) -> bool:
    """True when the trainable parameters are bfloat16 (they get fp32 `MasterWeights`);
    InvalidInput("dtype") for float16, which floe does not train (FLOAT16_REFUSED)."""
    dtypes = {p.dtype for p in params}
    if torch.float16 in dtypes:
        raise InvalidInput("dtype", FLOAT16_REFUSED)
    return torch.bfloat16 in dtypes


class PolicyZone:
    """Implements `zones.PolicyWorker` on a transformers model in this process.

    `params` are the model's trainable parameters; `trained` the tensors AdamW steps: the same
    list for an fp32 model, the fp32 masters (`masters.masters`) for a bf16 one."""

    def __init__(self, model: PreTrainedModel, optimizer: OptimizerConfig, compute: ComputeConfig):
        self.model = model
        self.compute = compute
        self.optimizer_config = optimizer
        prepare_model(model, compute)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = MasterWeights(self.params) if needs_masters(self.params) else None
        self.trained: list[torch.Tensor] = self.masters.masters if self.masters else list(self.params)
        self.optimizer = make_adamw(self.trained, optimizer)
        self.step = 0
        self.pending_calls = 0  # forward_backward calls since the last optim_step

    @torch.no_grad()
    def forward(self, batch: Batch, temperature: float, with_entropy: bool) -> ForwardResult:
        return score_batch(self.model, batch, temperature, with_entropy, self.compute)

    def forward_backward(self, batch: Batch, spec: LossSpec, temperature: float) -> ForwardBackwardResult:
        try:
            logprobs, parts_metrics = self._accumulate(batch, spec, temperature)
        except BaseException:
            # Some micro-batches may already have added gradients; a partial sum must never reach
            # a later optim_step, so everything accumulated since the last step is dropped.
            self.discard_gradients()
            raise
        self.pending_calls += 1
        metrics = finalize_metrics(parts_metrics)
        metrics["samples"] = float(batch.num_samples)
        return ForwardBackwardResult(metrics, logprobs, spec.name, spec.resolved())

    def _accumulate(
        self, batch: Batch, spec: LossSpec, temperature: float
    ) -> tuple[list[list[list[float]]], list[dict[str, float]]]:
        """Loss and backward per micro-batch; returns the policy log-probs and metric sums."""
        device = next(self.model.parameters()).device
        plan = plan_batch(batch, self.compute, uses_prefix_dedup(self.model, self.compute), self.model)

        def score(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
            return score_flat(self.model, batch, mb, temperature, True, self.compute)

        stats = None
        if spec.definition.batch_statistic is not None:  # a no-grad pre-pass over the whole call
            stats = batch_token_stats(batch, spec, self.forward(batch, temperature, False).logprobs, device)
        return accumulate_microbatches(score, batch, plan, batch_scales(batch, spec), spec, device, stats)

    def discard_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:  # with masters, a backward cut short may leave a bf16 gradient unmoved
            p.grad = None
        self.pending_calls = 0

    def optim_step(self, lr: float | None = None) -> OptimStepResult:
        if self.pending_calls == 0:
            raise StateError(NO_PENDING)
        grads = [p.grad for p in self.trained if p.grad is not None]
        grad_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
        if not math.isfinite(grad_norm):
            # Nothing can be applied from a non-finite sum; keeping it would block every later step.
            self.discard_gradients()
            raise StateError(NONFINITE_STEP.format(grad_norm))
        lr = clip_and_step(self.optimizer, grads, grad_norm, self.optimizer_config, self.step, lr)
        if self.masters is not None:
            self.masters.copy_back()
        applied, self.pending_calls = self.pending_calls, 0
        self.step += 1
        return OptimStepResult(step=self.step, lr=lr, grad_norm=grad_norm, accumulated_calls=applied)

    # -- weights out ------------------------------------------------------------------------

    def publish(self) -> WeightsSnapshot:
        """The live weights by state-dict name (not copied: valid until the next optim_step)."""
        tensors = {name: t.detach() for name, t in self.model.state_dict().items()}
        return WeightsSnapshot(tensors, fingerprints(tensors), self.step)

    def export_hf(self, directory: Path) -> None:
        self.model.save_pretrained(directory, safe_serialization=True)

    def describe(self) -> dict[str, str]:
        p = next(self.model.parameters())
        return {"dtype": str(p.dtype).removeprefix("torch."), "device": str(p.device), "device_name": device_name(p.device)}

    # -- own state --------------------------------------------------------------------------

    def _master_state(self) -> dict[str, torch.Tensor]:
        """The fp32 masters by every state-dict name of their parameters (tied ones under each).

        A state-dict entry is matched to its parameter by storage (state_dict holds views of
        the parameters), which works for any model object with `state_dict`, not only modules."""
        assert self.masters is not None
        by_storage = {(p.data_ptr(), p.shape): m for p, m in zip(self.params, self.masters.masters)}
        return {
            name: by_storage[(t.data_ptr(), t.shape)]
            for name, t in self.model.state_dict().items()
            if (t.data_ptr(), t.shape) in by_storage
        }

    # The state as a directory (the PolicyWorker protocol) ...

    def param_names(self) -> list[str]:
        """State-dict names of the trainable parameters, in optimizer index order."""
        by_id = {id(p): n for n, p in self.model.named_parameters()}
        return [by_id[id(p)] for p in self.params]

    def save_state(self, directory: Path) -> dict[str, Any]:
        """Write the "full" layout (`state.write_policy_files`) into `directory`; returns the
        state.json keys (step, param_groups, optimizer_scalars, policy_layout). StateError
        while gradients wait for optim_step."""
        part = self.state_part()
        write_policy_files(directory, part)
        return {**part.meta, "policy_layout": "full"}

    def _live_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.model.state_dict().items()}

    def check_state(self, directory: Path, meta: dict[str, Any]) -> None:
        """StateError when the saved policy (either layout) does not fit this model and
        optimizer; reads file headers only, changes nothing."""
        if policy_layout(meta) == "sharded":
            saved, has_rng = state_sharded.saved_weight_shapes(directory), state_sharded.has_rng(directory)
        else:
            saved = saved_shapes(directory, "policy.safetensors")
            has_rng = state_sharded.has_rng(directory)
        check_saved_policy(with_tied(saved, meta), self._live_shapes(), meta, len(self.params), has_rng)

    def load_state(self, directory: Path, meta: dict[str, Any]) -> None:
        """Apply a state `check_state` accepted (either layout; see `load_part`)."""
        if policy_layout(meta) == "sharded":
            part = state_sharded.read_as_full(directory, meta, self.param_names())
        else:
            part = read_policy_files(directory, meta)
        self.load_part(part)

    # ... and in memory.

    def state_part(self) -> ZoneState:
        """Weights, AdamW state (tensors by "<param index>.<key>", scalars in JSON), step, torch RNG.

        With fp32 masters (a bf16 model) the saved trainable weights are the fp32 masters, so
        a resume continues exactly; buffers keep the model's dtype. `param_groups` in the JSON
        record the hyper-parameters used so far; loading applies the loader's own config."""
        if self.pending_calls:
            raise StateError(PENDING_SAVE)
        opt = self.optimizer.state_dict()
        opt_tensors: dict[str, torch.Tensor] = {}
        scalars: dict[str, dict[str, float]] = {}
        for idx, param_state in opt["state"].items():
            for key, value in param_state.items():
                if isinstance(value, torch.Tensor):
                    opt_tensors[f"{idx}.{key}"] = value.detach().cpu().contiguous()
                else:
                    scalars.setdefault(str(idx), {})[key] = value
        # A tied tensor (embeddings = LM head) is saved once, under its first name (state.py).
        tied = tied_names(self.model)
        weights = {k: v.detach().cpu().clone().contiguous() for k, v in self.model.state_dict().items() if k not in tied}
        if self.masters is not None:
            weights.update({k: m.detach().cpu().clone().contiguous() for k, m in self._master_state().items()
                            if k not in tied})
        meta: dict[str, Any] = {"step": self.step, "param_groups": opt["param_groups"], "optimizer_scalars": scalars}
        if tied:
            meta[TIED] = tied
        return ZoneState(
            {
                "policy.safetensors": weights,
                "optimizer.safetensors": opt_tensors,
                "rng.safetensors": {"torch_cpu": torch.get_rng_state()},
            },
            meta,
        )

    def check_part(self, state: ZoneState) -> None:
        """StateError when the saved weights or optimizer do not fit this model; changes nothing."""
        weights = with_tied(state.tensors.get("policy.safetensors", {}), state.meta)
        saved = {k: tuple(v.shape) for k, v in weights.items()}
        has_rng = "torch_cpu" in state.tensors.get("rng.safetensors", {})
        check_saved_policy(saved, self._live_shapes(), state.meta, len(self.params), has_rng)

    def load_part(self, state: ZoneState) -> None:
        """Apply a state `check_part` accepted; gradients not yet applied are discarded.

        Restores weights (into the fp32 masters too, when there are masters; a state saved
        from an fp32 or a bf16 model loads into either), AdamW moments and step counts, the
        policy's step and the RNG. Hyper-parameters are not restored: every AdamW param-group
        key (lr, betas, eps, weight_decay, ...) keeps this zone's configured value, and the
        lr of the next step is `lr_at(step, config)` (the config is the source of truth)."""
        opt_state: dict[int, dict[str, Any]] = {}
        for key, value in state.tensors["optimizer.safetensors"].items():
            idx, name = key.split(".", 1)
            opt_state.setdefault(int(idx), {})[name] = value
        for idx, values in state.meta["optimizer_scalars"].items():
            opt_state.setdefault(int(idx), {}).update(values)
        weights = with_tied(state.tensors["policy.safetensors"], state.meta)  # idempotent: read_policy_files did it
        with torch.no_grad():
            self.model.load_state_dict(weights, strict=True)
        if self.masters is not None:
            by_master = {id(m): name for name, m in self._master_state().items()}
            self.masters.load([weights[by_master[id(m)]] for m in self.masters.masters])
        # The live groups carry the configured hyper-parameters; only the moments come from the state.
        configured = self.optimizer.state_dict()["param_groups"]
        self.optimizer.load_state_dict({"state": opt_state, "param_groups": configured})
        self.discard_gradients()
        self.step = int(state.meta["step"])
        torch.set_rng_state(state.tensors["rng.safetensors"]["torch_cpu"])


def _token_inputs(
    batch: Batch,
    mb_samples: list[tuple[int, int]],
    sample_scales: SampleScales,
    logp: torch.Tensor,
    entropy: torch.Tensor,
    spec: LossSpec,
    device: torch.device,
) -> TokenInputs:
    """Flatten one micro-batch's samples into the tensors `compute_loss` expects (`sample_scales`:
    one per sample of `mb_samples`, in order; the KL's and entropy's only where they differ from
    the policy term's)."""
    samples = [batch.groups[g].samples[i] for g, i in mb_samples]
    lens = [len(s.tokens) for s in samples]

    def flat(values: list[list[float]]) -> torch.Tensor:
        return torch.tensor([v for vs in values for v in vs], dtype=torch.float32, device=device)

    def per_token(value: float | list[float], n: int) -> list[float]:
        return value if isinstance(value, list) else [float(value)] * n

    weights = flat([s.weights if s.weights is not None else [1.0] * n for s, n in zip(samples, lens)])
    def per_sample(scales: list[float]) -> torch.Tensor:
        return flat([[sc] * n for sc, n in zip(scales, lens)])

    scale = per_sample(sample_scales.policy)
    kl_scale = None if sample_scales.kl == sample_scales.policy else per_sample(sample_scales.kl)
    entropy_scale = None if sample_scales.entropy == sample_scales.policy else per_sample(sample_scales.entropy)
    index = torch.repeat_interleave(torch.arange(len(samples), device=device), torch.tensor(lens, device=device))
    old = flat([s.logprobs for s in samples]) if all(s.logprobs is not None for s in samples) else None  # type: ignore[misc]
    ref = flat([s.ref_logprobs for s in samples]) if all(s.ref_logprobs is not None for s in samples) else None  # type: ignore[misc]
    adv = None
    if spec.needs_advantages:
        adv = flat([per_token(s.advantage, n) for s, n in zip(samples, lens)])  # type: ignore[arg-type]
    return TokenInputs(
        logp=logp,
        weights=weights,
        scale=scale,
        sample_index=index,
        num_samples=len(samples),
        old_logp=old,
        advantages=adv,
        ref_logp=ref,
        entropy=entropy if spec.needs_entropy_grad else entropy.detach(),
        kl_scale=kl_scale,
        entropy_scale=entropy_scale,
    )
