"""One prime-rl training step (its packed micro-batches, every rank's) -> one floe Batch.

A `MicroBatch` packs samples back to back (`sequence_lengths`; `position_ids` restart at 0).
Each sample becomes a floe Sample whose prompt is everything before its first trainable token
(`loss_mask`) and whose tokens run to its last trainable one; tokens in between that the model
did not sample (tool output, user turns) keep weight 0. Consecutive samples with the same
prompt share a Group (floe runs the prompt once). Per-token values are taken as prime-rl
aligns them: position t holds log p(token t | tokens < t), the same convention as floe's.

Normalisation: prime-rl divides the step's summed rl loss by the number of trainable tokens
(loss_mask & rl_weight != 0) over the whole step; the weights here are rl_weight / that count
and the loss runs with aggregation `sum`, so splitting the step into calls changes nothing.

Refused (InvalidInput naming the field): ce/ref_kl weight streams with any non-zero entry
(prime-rl's SFT and distillation components), multimodal inputs, routed experts (MoE router
replay), mixed temperatures within a sample, a trainable first token (it has no context),
and packing that does not add up.
"""

from __future__ import annotations

from dataclasses import dataclass

from floe.errors import InvalidInput
from floe.integrations.prime_rl.formats import MicroBatch
from floe.integrations.prime_rl.loss_mapping import MappedLoss
from floe.types import Batch, Group, Sample


@dataclass
class StepBatch:
    """The floe batch of one step, and prime-rl's global trainable-token count (rl_scale)."""

    batch: Batch
    rl_scale: int
    samples: int  # prime-rl samples in the step (with or without trainable tokens)


def _check(mb: MicroBatch, i: int) -> None:
    n = len(mb.input_ids)
    where = f"micro_batches[{i}]"
    for name in ("loss_mask", "advantages", "inference_logprobs", "position_ids", "temperatures"):
        if len(getattr(mb, name)) != n:
            raise InvalidInput(f"{where}.{name}", f"has {len(getattr(mb, name))} entries for {n} input_ids")
    if sum(mb.sequence_lengths) != n:
        raise InvalidInput(f"{where}.sequence_lengths", f"sum to {sum(mb.sequence_lengths)}, not {n} (input_ids)")
    for name in ("ce_weights", "ref_kl_weights"):
        stream = getattr(mb, name)
        if stream is not None and any(w != 0 for w in stream):
            raise InvalidInput(f"{where}.{name}", "prime-rl's ce / ref_kl loss components are not supported by "
                               "floe's trainer; use an algorithm with the rl component only")
    for name in ("rl_weights", "ref_logprobs"):
        stream = getattr(mb, name)
        if stream is not None and len(stream) != n:
            raise InvalidInput(f"{where}.{name}", f"has {len(stream)} entries for {n} input_ids")
    if mb.mm_kwargs or mb.mm_token_type_ids:
        raise InvalidInput(f"{where}.mm_kwargs", "multimodal samples are not supported by floe's trainer")
    if mb.routed_experts is not None:
        raise InvalidInput(f"{where}.routed_experts", "MoE router replay is not supported by floe's trainer; "
                           "turn off enable_router_replay")


def rl_scale(micro_batches: list[MicroBatch]) -> int:
    """prime-rl's global rl-token count: Σ (loss_mask & rl_weight != 0), at least 1."""
    count = 0
    for mb in micro_batches:
        weights = mb.rl_weights
        count += sum(1 for t, m in enumerate(mb.loss_mask) if m and (weights is None or weights[t] != 0))
    return max(count, 1)


def to_floe_batch(micro_batches: list[MicroBatch], loss: MappedLoss) -> StepBatch:
    """The step's micro-batches (all ranks, in order) as one floe Batch; see the module doc."""
    for i, mb in enumerate(micro_batches):
        _check(mb, i)
    scale = rl_scale(micro_batches)
    groups: list[Group] = []
    samples = 0
    for i, mb in enumerate(micro_batches):
        start = 0
        for j, length in enumerate(mb.sequence_lengths):
            where = f"micro_batches[{i}].sequence_lengths[{j}]"
            end = start + length
            samples += 1
            if length and mb.position_ids[start] != 0:
                raise InvalidInput(where, f"sample starts at position_id {mb.position_ids[start]}, not 0: "
                                   "sequence_lengths do not match the packing")
            mask = mb.loss_mask[start:end]
            rl_w = mb.rl_weights[start:end] if mb.rl_weights is not None else None
            live = [t for t, m in enumerate(mask) if m and (rl_w is None or rl_w[t] != 0)]
            if not live:
                start = end
                continue
            first, last = live[0], live[-1]
            if first == 0:
                raise InvalidInput(f"micro_batches[{i}].loss_mask", "a sample's first token is trainable, but it "
                                   "has no context to be predicted from")
            temps = {mb.temperatures[start + t] for t in live}
            if len(temps) != 1:
                raise InvalidInput(f"micro_batches[{i}].temperatures", f"one sample was sampled at several "
                                   f"temperatures {sorted(temps)}; floe scores a sample at one temperature")
            live_set = set(live)
            span = range(first, last + 1)
            weights = [(1.0 if rl_w is None else float(rl_w[t])) / scale if t in live_set else 0.0 for t in span]
            logprobs = [float(mb.inference_logprobs[start + t]) for t in span]
            ref = None
            if loss.ref_is_inference:
                ref = list(logprobs)
            sample = Sample(
                tokens=list(mb.input_ids[start + first:start + last + 1]),
                logprobs=logprobs,
                advantage=[float(mb.advantages[start + t]) * loss.advantage_scale for t in span],
                weights=weights,
                ref_logprobs=ref,
                temperature=float(temps.pop()),
            )
            prompt = list(mb.input_ids[start:start + first])
            if groups and groups[-1].prompt == prompt:
                groups[-1].samples.append(sample)
            else:
                groups.append(Group(prompt=prompt, samples=[sample]))
            start = end
    return StepBatch(Batch(groups), scale, samples)
