"""The policy on one rank of a data-parallel group: the model sharded with FSDP2 (`fully_shard`).

A placement (Ray: `floe.placement.ray`) builds one `ShardedPolicyZone` per torch.distributed
rank of a policy group (gloo on CPU, NCCL on GPU), splits each batch with
`data_parallel.split_batch` and merges the ranks' answers (`merge_forward`,
`merge_forward_backward`). Methods marked *collective* must be called on every rank of the
group at the same time, in the same order; a rank that raised leaves the others waiting in a
collective, so every input check happens on the driver before the call.

Sharding: each decoder layer is one FSDP unit, and the root unit is a small `_Scorer` module
around the model holding the rest (embeddings, final norm, LM head — tied or not). Scoring
runs through `_Scorer.forward`, so the root's all-gather and reduce-scatter hooks fire even
though floe's scoring calls the decoder and the LM head weight directly
(`backend.scoring`: the head runs on scored positions only).

Equal results to one process (fp32, within float rounding):
* the loss of each rank's micro-batches uses the GLOBAL aggregation scales of its share
  (`RankShare.scales`), and the ranks' gradients are SUMMED (`set_gradient_divide_factor(1.0)`
  and `set_force_sum_reduction_for_comms(True)` on every FSDP unit: a plain SUM reduce-scatter,
  which gloo supports, and no division), so the summed gradient is the single-process one;
* clipping uses the global norm (`torch.nn.utils.get_total_norm` over the sharded gradients,
  reduced across ranks), the same value on every rank, so every rank takes the same decision
  (a non-finite norm refuses the step on all ranks with `PolicyZone`'s StateError);
* the micro-batch loop is `policy.accumulate_microbatches`, the one the local zone runs.

Equal collective counts: FSDP all-gathers each unit in every forward and reduce-scatters in
every backward, so all ranks must run the SAME number of micro-batches. Before a `forward` or
`forward_backward` the ranks agree on the largest count (an all_reduce MAX) and a rank with
fewer (or with no groups at all) runs dummy micro-batches: one token through the model with
the loss multiplied by 0, so it adds exact zeros to the gradients.

Mixed precision: a bfloat16 model is converted to fp32 parameters before sharding and runs
with `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: forward and backward in
bf16, gradients reduced in fp32, AdamW steps the fp32 shards (the masters) and keeps fp32
moments. Published and exported tensors are cast back to the model's loaded dtypes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import PreTrainedModel

from floe.backend import state_sharded
from floe.backend.data_parallel import RankPartial, RankShare
from floe.backend.policy import (
    NO_PENDING,
    NONFINITE_STEP,
    PENDING_SAVE,
    accumulate_microbatches,
    check_saved_policy,
    clip_and_step,
    make_adamw,
    needs_masters,
    prepare_model,
    score_flat,
)
from floe.backend.scoring import plan_batch, uses_prefix_dedup
from floe.backend.state import (
    POLICY_RNG_FILE,
    TIED,
    ZoneState,
    policy_layout,
    read_policy_files,
    saved_shapes,
    tied_names,
    with_tied,
)
from floe.compute.layout import GroupPart, MicroBatch
from floe.compute.losses import LossSpec
from floe.config import ComputeConfig, OptimizerConfig
from floe.devices import device_name
from floe.errors import StateError
from floe.sampler.engine import is_finite
from floe.types import Batch, ForwardResult, Group, OptimStepResult, Sample

__all__ = ["ShardedPolicyZone"]

# One token through the model: what a rank with fewer micro-batches runs to match the others' collectives.
_DUMMY_BATCH = Batch([Group([0], [Sample([0])])])
_DUMMY_MB = MicroBatch((GroupPart(0, (0,), 2),), "padded")


class _Scorer(torch.nn.Module):
    """The root FSDP unit: owns the model, scores one micro-batch in its forward (so FSDP's
    hooks wrap the whole scoring) and returns plain tensors (FSDP hooks tensor outputs)."""

    def __init__(self, model: PreTrainedModel, scoring: Any = None):
        super().__init__()
        self.model = model
        # What scoring reads when it is not `model` (a LoRA policy's AdapterView: the adapted LM
        # head). Not a Module, so not registered: FSDP shards `model` alone.
        self.scoring = scoring

    def forward(  # type: ignore[override]
        self, batch: Batch, mb: MicroBatch, temperature: float, with_entropy: bool, compute: ComputeConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logp, entropy = score_flat(self.model if self.scoring is None else self.scoring, batch, mb, temperature, with_entropy, compute)
        return logp, entropy if entropy is not None else logp.new_zeros(0)


class ShardedPolicyZone:
    """The rank side of a data-parallel `PolicyWorker` (see the module docstring).

    `model` is loaded by the caller on `device` (fp32 or bf16); `group` is the policy's
    data-parallel process group (this rank's place in it is `rank` of `world_size`). Its
    trainable parameters (requires_grad) are what AdamW steps; frozen ones are sharded too and
    get no gradient (`policy_sharded_lora`: a frozen base and its adapter). `scoring`: what
    scores a micro-batch when it is not `model` itself (a LoRA policy's AdapterView)."""

    def __init__(
        self,
        model: PreTrainedModel,
        optimizer: OptimizerConfig,
        compute: ComputeConfig,
        group: dist.ProcessGroup,
        device: torch.device,
        scoring: Any = None,
    ):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device
        self.compute = compute
        self.optimizer_config = optimizer
        prepare_model(model, compute)
        trainable = [p for p in model.parameters() if p.requires_grad]
        # Every parameter, frozen ones too: FSDP all-gathers a unit in one dtype (peft keeps a
        # bf16 base's adapter in fp32), so a bf16 model is sharded in fp32 as a whole.
        bf16 = needs_masters(list(model.parameters()))  # InvalidInput("dtype") for float16
        # The dtypes published and exported: the model's own, whatever the shards hold.
        self.out_dtypes = {name: t.dtype for name, t in model.state_dict().items()}
        if bf16:
            model.float()
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            mp = MixedPrecisionPolicy()
        self.dtype = "bfloat16" if bf16 else str(trainable[0].dtype).removeprefix("torch.")
        uses_prefix_dedup(model, compute)  # installs the prefix attention before sharding when it applies
        mesh = DeviceMesh.from_group(group, device.type)
        self.mesh = mesh
        units: list[Any] = []
        for layer in model.get_decoder().layers:  # type: ignore[union-attr]  (a ModuleList)
            units.append(fully_shard(layer, mesh=mesh, mp_policy=mp))
        self.model = model
        self.scorer: torch.nn.Module = _Scorer(model, scoring)
        units.append(fully_shard(self.scorer, mesh=mesh, mp_policy=mp))  # shards in place
        for unit in units:
            assert isinstance(unit, FSDPModule)
            unit.set_gradient_divide_factor(1.0)  # gradients are summed across ranks: global loss scales
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM), no division
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.tied = tied_names(model)  # other name -> first name of each tied tensor (still one parameter after sharding)
        self.out_tied = self.tied  # the same by published name (`_published`)
        self.optimizer = make_adamw(self.params, optimizer)
        self.step = 0
        self.pending_calls = 0
        self.offloaded = False

    # -- collectives helpers --------------------------------------------------------------

    def _max_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)  # NCCL needs it on the GPU
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def _plan(self, batch: Batch | None) -> list[MicroBatch]:
        if batch is None:
            return []
        return plan_batch(batch, self.compute, uses_prefix_dedup(self.model, self.compute), self.model)

    # -- training -------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, share: RankShare, temperature: float, with_entropy: bool) -> ForwardResult:
        """Collective. Log-probs (and entropies) of the share's groups, [group k of the share][sample][token]."""
        batch = share.batch
        plan = self._plan(batch)
        count = self._max_over_ranks(len(plan))
        logprobs: list[list[list[float]]] = [[[] for _ in g.samples] for g in batch.groups] if batch else []
        entropy = [[[] for _ in g.samples] for g in batch.groups] if batch and with_entropy else None
        for mb in plan:
            assert batch is not None
            logp, ent = self.scorer(batch, mb, temperature, with_entropy, self.compute)
            mb_samples = [(p.group, i) for p in mb.parts for i in p.samples]
            lens = [len(batch.groups[g].samples[i].tokens) for g, i in mb_samples]
            for (g, i), lp in zip(mb_samples, torch.split(logp, lens)):
                logprobs[g][i] = lp.tolist()
            if entropy is not None:
                for (g, i), e in zip(mb_samples, torch.split(ent, lens)):
                    entropy[g][i] = e.tolist()
        for _ in range(count - len(plan)):
            self.scorer(_DUMMY_BATCH, _DUMMY_MB, 1.0, False, self.compute)
        return ForwardResult(logprobs, entropy if with_entropy else None)

    def forward_backward(self, share: RankShare, spec: LossSpec, temperature: float) -> RankPartial:
        """Collective. Loss and gradients of the share's groups under the global scales it carries;
        gradients add up (summed over ranks) until optim_step."""
        batch = share.batch
        plan = self._plan(batch)
        count = self._max_over_ranks(len(plan))
        try:
            if batch is not None:

                def score(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
                    return self.scorer(batch, mb, temperature, True, self.compute)

                logprobs, sums = accumulate_microbatches(score, batch, plan, share.scales, spec, self.device,
                                                       share.stats)
            else:
                logprobs, sums = [], []
            for _ in range(count - len(plan)):
                logp, _ = self.scorer(_DUMMY_BATCH, _DUMMY_MB, 1.0, False, self.compute)
                (logp.sum() * 0.0).backward()
        except BaseException:
            self.discard_gradients()
            raise
        self.pending_calls += 1
        return RankPartial(logprobs, sums)

    def discard_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.pending_calls = 0

    def global_grad_norm(self) -> float:
        """Collective. L2 norm of the whole (summed, unsharded) gradient; the same on every rank."""
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def optim_step(self, lr: float | None = None) -> OptimStepResult:
        """Collective. Clip by the global norm, AdamW on every rank's shards at `lr` (None: the
        schedule's), step + 1."""
        if self.pending_calls == 0:
            raise StateError(NO_PENDING)
        grad_norm = self.global_grad_norm()
        if not math.isfinite(grad_norm):
            self.discard_gradients()
            raise StateError(NONFINITE_STEP.format(grad_norm))
        grads = [p.grad for p in self.params if p.grad is not None]
        lr = clip_and_step(self.optimizer, grads, grad_norm, self.optimizer_config, self.step, lr)
        applied, self.pending_calls = self.pending_calls, 0
        self.step += 1
        return OptimStepResult(step=self.step, lr=lr, grad_norm=grad_norm, accumulated_calls=applied)

    # -- weights out ------------------------------------------------------------------------

    @torch.no_grad()
    def all_finite(self) -> bool:
        """Collective. True when every parameter shard on every rank is finite."""
        ok = all(is_finite(_local(p)) for p in self.params)
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    @torch.no_grad()
    def full_tensor_buckets(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """Collective. The full weights by state-dict name (PolicyZone.publish()'s names and
        dtypes) in buckets of at most `bucket_bytes` (a larger tensor gets a bucket alone); a
        tied tensor is gathered once and appears under all its names (one tensor object) in the
        bucket of its first name.

        Rank 0 yields the tensors; other ranks yield {} at the same points (they take part in
        every gather). Extra memory: one bucket plus the tensor being gathered (in the shards'
        dtype) on rank 0; one gathered tensor on the others."""
        bucket: dict[str, torch.Tensor] = {}
        size = 0
        aliases: dict[str, list[str]] = {}  # first name -> its tied names: gathered once, in the first name's bucket
        for other, first in self.out_tied.items():
            aliases.setdefault(first, []).append(other)
        for name, held, gather in self._published():
            dtype = self.out_dtypes[name]
            nbytes = held.numel() * dtype.itemsize
            if size and size + nbytes > bucket_bytes:
                yield bucket if self.rank == 0 else {}
                bucket, size = {}, 0
            full = gather()
            if self.rank == 0:
                bucket[name] = full.detach().to(dtype, copy=True)
                for other in aliases.get(name, ()):  # the same tensor object: a broadcast sends it once
                    if self.out_dtypes[other] == dtype:
                        bucket[other] = bucket[name]
                    else:
                        bucket[other] = full.detach().to(self.out_dtypes[other], copy=True)
            del full
            size += nbytes
        if size:
            yield bucket if self.rank == 0 else {}

    def _published(self) -> Iterator[tuple[str, torch.Tensor, Callable[[], torch.Tensor]]]:
        """(published name, the tensor as this rank holds it, gather: collective, its full value)
        for every published tensor but the tied aliases (`out_tied`), in state-dict order."""
        for name, t in self.model.state_dict().items():
            if name not in self.out_tied:
                yield name, t, partial(full_tensor, t)

    def export_hf(self, directory: Path) -> None:
        """Collective. Rank 0 writes the full weights (the model's dtypes) and config as an
        ordinary HF model directory into `directory`."""
        full: dict[str, torch.Tensor] = {}
        for bucket in self.full_tensor_buckets(1 << 30):
            full.update({k: v for k, v in bucket.items() if k not in self.tied})  # a tied tensor once, as HF saves it
        if self.rank == 0:
            self.model.save_pretrained(directory, state_dict=full, safe_serialization=True)
        dist.barrier(group=self.group)

    def describe(self) -> dict[str, str]:
        return {
            "dtype": self.dtype,
            "device": "cpu (offloaded)" if self.offloaded else str(self.device),
            "device_name": device_name(self.device),  # the device it computes on, offloaded or not
            "ranks": str(self.world_size),
        }

    def offload(self) -> None:
        """Parameters, gradients and optimizer state to CPU (colocation: the sampler gets the
        device). On a CPU device there is nothing to move: a no-op, `describe()` says "cpu"."""
        if self.device.type == "cpu" or self.offloaded:
            return
        self._move(torch.device("cpu"))
        self.offloaded = True

    def onload(self) -> None:
        """Back to the zone's device after `offload` (a no-op on a CPU device)."""
        if self.device.type == "cpu" or not self.offloaded:
            return
        self._move(self.device)
        self.offloaded = False

    @torch.no_grad()
    def _move(self, device: torch.device) -> None:
        self.scorer.to(device)  # FSDP2 moves the sharded parameters (and their gradients)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- own state --------------------------------------------------------------------------

    def param_names(self) -> list[str]:
        by_id = {id(p): n for n, p in self.model.named_parameters()}
        return [by_id[id(p)] for p in self.params]

    def _checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        out = {state_sharded.WEIGHTS + k: v for k, v in self.model.state_dict().items() if k not in self.tied}
        for name, p in zip(self.param_names(), self.params):
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"{state_sharded.OPTIM}{name}.{key}"] = value
        return out

    def save_state(self, directory: Path) -> dict[str, Any]:
        """Collective. Write the "sharded" layout (`state_sharded`) into `directory` (the same
        path on every rank: a shared filesystem across nodes); returns state.json's keys.
        StateError (on every rank, nothing written) while gradients wait for optim_step."""
        if self.pending_calls:
            raise StateError(PENDING_SAVE)
        state_sharded.save_sharded(directory, self._checkpoint_tensors(), self.group)  # StateError on every rank
        failed = ""
        if self.rank == 0:
            try:
                save_file({"torch_cpu": torch.get_rng_state()}, str(directory / POLICY_RNG_FILE))
            except Exception as e:  # noqa: BLE001 - told to every rank below, then raised on each
                failed = f"{type(e).__name__}: {e}"
        if not self._all_agree(not failed):
            raise StateError(f"save_state: policy rank 0 could not write {POLICY_RNG_FILE} under {directory}"
                             + (f": {failed}" if failed else ""))
        meta = {**self._optimizer_meta(), "policy_layout": "sharded"}
        if self.tied:
            meta[TIED] = self.tied
        return meta

    def _optimizer_meta(self) -> dict[str, Any]:
        """state.json's step, param_groups and optimizer_scalars (AdamW's non-tensor values)."""
        opt = self.optimizer.state_dict()
        scalars: dict[str, dict[str, Any]] = {}
        for idx, param_state in opt["state"].items():
            for key, value in param_state.items():
                if not isinstance(value, torch.Tensor):
                    scalars.setdefault(str(idx), {})[key] = value
        return {"step": self.step, "param_groups": opt["param_groups"], "optimizer_scalars": scalars}

    def _all_agree(self, ok: bool) -> bool:
        """Collective: True when `ok` on every rank (so every rank takes the same branch)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def check_state(self, directory: Path, meta: dict[str, Any]) -> None:
        """StateError when the saved policy (either layout, any rank count) does not fit this
        model and optimizer; reads headers only, changes nothing. Not collective."""
        if policy_layout(meta) == "sharded":
            saved = state_sharded.saved_weight_shapes(directory)
        else:
            saved = saved_shapes(directory, "policy.safetensors")
        live = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        check_saved_policy(with_tied(saved, meta), live, meta, len(self.params), state_sharded.has_rng(directory))

    @torch.no_grad()
    def load_state(self, directory: Path, meta: dict[str, Any]) -> None:
        """Collective. Apply a state `check_state` accepted: weights, AdamW moments, step, RNG;
        gradients not yet applied are discarded; hyper-parameters stay the configured ones.

        "sharded" layout: each rank reads its slices. "full" layout (saved by one process):
        each rank reads the whole files and keeps its shards."""
        names = self.param_names()
        by_name = dict(zip(names, self.params))
        if policy_layout(meta) == "sharded":
            # Names the state holds; a name it ties to another is the same tensor here and is filled with it.
            saved_tied = meta.get(TIED) or {}
            targets = {state_sharded.WEIGHTS + k: v for k, v in self.model.state_dict().items() if k not in saved_tied}
            opt_targets: dict[int, dict[str, torch.Tensor]] = {}
            for key, (shape, dtype) in state_sharded.saved_index(directory).items():
                if not key.startswith(state_sharded.OPTIM):
                    continue
                name, field = key.removeprefix(state_sharded.OPTIM).rsplit(".", 1)
                param = by_name[name]
                value = torch.zeros_like(param) if tuple(shape) == tuple(param.shape) and shape else torch.zeros(shape, dtype=dtype)
                targets[key] = value
                opt_targets.setdefault(names.index(name), {})[field] = value
            state_sharded.load_sharded(directory, targets, self.group)
            opt_state: dict[int, dict[str, Any]] = dict(opt_targets)
            rng = state_sharded.read_rng(directory)
            self._restore(opt_state, rng, meta)
        else:
            self.load_whole(read_policy_files(directory, meta), self.model.state_dict())

    @torch.no_grad()
    def load_whole(self, part: ZoneState, live: Mapping[str, torch.Tensor]) -> None:
        """Apply a state of whole tensors (`PolicyZone.state_part`'s shape: "policy.safetensors"
        by the names of `live`, the tensors it fills; AdamW tensors by parameter index): every
        rank reads it all and keeps its shards. Not collective."""
        for name, full in part.tensors["policy.safetensors"].items():
            self._assign(live[name], full)
        opt_state: dict[int, dict[str, Any]] = {}
        for key, value in part.tensors["optimizer.safetensors"].items():
            idx, field = key.split(".", 1)
            param = self.params[int(idx)]
            if value.dim() and tuple(value.shape) == tuple(param.shape):
                assert isinstance(param, DTensor)
                value = distribute_tensor(value.to(param.dtype), self.mesh, param.placements, src_data_rank=None)
            opt_state.setdefault(int(idx), {})[field] = value
        self._restore(opt_state, part.tensors["rng.safetensors"]["torch_cpu"], part.meta)

    def _restore(self, opt_state: dict[int, dict[str, Any]], rng: torch.Tensor, meta: dict[str, Any]) -> None:
        """The loaded AdamW state (this rank's shards) with the configured hyper-parameters, the
        step and the RNG; gradients not yet applied are discarded."""
        for idx, values in meta.get("optimizer_scalars", {}).items():
            opt_state.setdefault(int(idx), {}).update(values)
        configured = self.optimizer.state_dict()["param_groups"]
        self.optimizer.load_state_dict({"state": opt_state, "param_groups": configured})
        self.discard_gradients()
        self.step = int(meta["step"])
        torch.set_rng_state(rng)

    def _assign(self, target: torch.Tensor, full: torch.Tensor) -> None:
        """target (a DTensor shard or a replicated tensor) ← its part of the full tensor `full`."""
        if isinstance(target, DTensor):
            shard = distribute_tensor(full.to(target.dtype), self.mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(shard.to_local())
        else:
            target.copy_(full)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (collective over its mesh) or a replicated tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t
