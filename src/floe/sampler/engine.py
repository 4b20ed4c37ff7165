"""The interface every sampler engine implements (torch today, vLLM next).

An engine generates from token ids with its own copy of the weights and accepts new weights
pushed in place (whole, or bucket by bucket with `partial=True`). It holds no weights version
and no seed generator: the sampler zone (`floe.backend.sampler.SamplerZone`) owns those and
passes the version and one seed per prompt (`floe.backend.sampler.prompt_seeds`) per call.

Contract of `generate` (every engine must meet it; tests/sampler checks the torch engine):
* log-probs are those of the temperature-scaled distribution *before* top-k/top-p filtering,
  the same quantity the policy's `forward(temperature=...)` computes, so PPO ratios between
  sampler and policy are consistent;
* each sample's `tokens` exclude the prompt and include the stop token (or the token that
  completed a stop string), so a sample can be fed back as a `floe.Sample` unchanged;
* with `params.top_logprobs` = k > 0, each sample's `top_logprobs` holds, per token, the k
  most likely (token id, log-prob) of that same distribution, most likely first (the sampled
  token's log-prob equals its entry when it is among them); asking for them changes no draw;
* the same (prompts, n, params, seeds) on the same weights gives the same tokens, and the
  samples of a prompt depend on its own seed only: splitting a call's prompts (with their
  seeds) over several calls or replicas gives the same samples (up to the engine's
  batch-dependent float rounding of the logits; the torch engine draws counter-based noise,
  `floe.sampler.noise`, so its draws themselves never depend on the batch);
* `sleep()` releases the engine's device memory (weights to host memory, caches freed) and
  `wake()` brings it back; `generate` while asleep raises StateError; an engine that cannot
  sleep raises StateError saying why (never a silent no-op);
* it is safe to call from several threads at once: an engine keeps no mutable state across
  a call (per-call generator and KV cache). Loading weights is never concurrent with
  `generate` (the Backend holds the sampler exclusively for it);
* with `on_step`, the engine calls it once per decode step, in the generating thread, with one
  `StepToken` per row that produced a token at that step (row = gi * n + k: sample k of prompt
  gi of the call); a row's step tokens, in order, are exactly its returned sample's tokens and
  log-probs (and `top_logprobs` when asked). An exception `on_step` raises (`StopGeneration` to
  cancel) stops the generation and propagates out of `generate`. An engine that cannot report
  steps while it decodes calls `replay_steps` on its finished samples instead (same tokens,
  after the fact).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from floe.errors import InvalidInput, StateError
from floe.types import SampledGroup, SamplingParams

BLOCK_WORDS = 4096  # int64 words per fingerprint block


@dataclass(frozen=True)
class StepToken:
    """One token a row produced at one decode step.

    `row`: gi * n + k (sample k of the call's prompt gi); `token`: its id; `logprob`: its
    log-prob (the same value the returned sample records); `top_logprobs`: with
    `params.top_logprobs` = k > 0, the k most likely (token id, log-prob) at that position,
    most likely first (else None)."""

    row: int
    token: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] | None = None


OnStep = Callable[[list[StepToken]], None]
"""A generation's step callback: called once per decode step with that step's tokens (at most
one per row, rows ascending). Runs in the generating thread; raising stops the generation."""


class StopGeneration(Exception):
    """Raised by an `OnStep` callback to stop the generation (every client of it has left);
    propagates out of `generate` / `sample` unchanged."""


def replay_steps(groups: list[SampledGroup], on_step: OnStep) -> None:
    """Replay finished samples as steps: step t carries token t of every row (row = gi * n + k
    over `groups`, n = samples per group) that has one, so a caller sees what a live
    engine's `on_step` would have reported, after the fact. Used by engines and placements
    that cannot report steps while decoding. An exception from `on_step` propagates."""
    rows = [s for g in groups for s in g.samples]
    for t in range(max((len(s.tokens) for s in rows), default=0)):
        step = [
            StepToken(r, s.tokens[t], s.logprobs[t],
                      tuple(s.top_logprobs[t]) if s.top_logprobs is not None else None)
            for r, s in enumerate(rows) if t < len(s.tokens)
        ]
        on_step(step)


class Fingerprint(NamedTuple):
    """What one tensor's bytes are, exactly: `words` = wrapping int64 sum of the tensor's
    bytes read as little-endian int64 words (the tail zero-padded to 8 bytes), `weighted` =
    wrapping int64 sum of each block's word sum times its block index + 1 (blocks of
    `BLOCK_WORDS` words: catches blocks moved, dropped or stale), plus dtype name and shape.
    Integer arithmetic, so the same value on any device, thread count or bucket order."""

    words: int
    weighted: int
    dtype: str
    shape: tuple[int, ...]


def _words(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as a flat int64 tensor (a view when `t` is contiguous and 8-byte aligned
    with a size multiple of 8 bytes; else one zero-padded copy)."""
    flat = t.detach().reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    if nbytes % 8 == 0:
        try:
            return flat.view(torch.uint8).view(torch.int64) if flat.element_size() != 8 else flat.view(torch.int64)
        except RuntimeError:  # unaligned storage offset: copy below
            pass
    raw = torch.zeros(-(-nbytes // 8) * 8, dtype=torch.uint8, device=flat.device)
    raw[:nbytes].copy_(flat.contiguous().view(torch.uint8))
    return raw.view(torch.int64)


@torch.no_grad()
def fingerprint(t: torch.Tensor) -> Fingerprint:
    """`Fingerprint` of `t` (any dtype and shape, on any device; computed where `t` is, one
    pass at memory bandwidth, one host sync). Equal for bit-identical tensors of the same
    dtype and shape, whatever the device or thread count."""
    words = _words(t)
    n = words.numel()
    full = n // BLOCK_WORDS
    sums = words[: full * BLOCK_WORDS].view(full, BLOCK_WORDS).sum(1) if full else words[:0]
    if n > full * BLOCK_WORDS:
        sums = torch.cat([sums, words[full * BLOCK_WORDS:].sum().reshape(1)])
    index = torch.arange(1, sums.numel() + 1, dtype=torch.int64, device=sums.device)
    both = torch.stack([sums.sum(), (sums * index).sum()]).tolist() if sums.numel() else [0, 0]
    return Fingerprint(int(both[0]), int(both[1]), str(t.dtype).removeprefix("torch."), tuple(t.shape))


@torch.no_grad()
def is_finite(t: torch.Tensor) -> bool:
    """True when every element of `t` is finite (integer and bool tensors always are).
    Cheap: a sum in `t`'s own dtype is finite only if every element is (NaN and ±inf
    propagate); only when it is not (a non-finite element, or an overflow of the sum) the
    exact `torch.isfinite` check decides. Computed where `t` is."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return True
    if bool(torch.isfinite(t.detach().sum())):
        return True
    return bool(torch.isfinite(t.detach()).all())


def nonfinite(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the tensors that hold a NaN or an infinity (`is_finite`), in order; a tensor
    under several names (tied weights, `tensor_key`) is checked once and reported under each."""
    finite: dict[tuple, bool] = {}
    broken = []
    for name, t in tensors.items():
        key = tensor_key(t)
        if key not in finite:
            finite[key] = is_finite(t)
        if not finite[key]:
            broken.append(name)
    return broken


def check_layout(
    own: Mapping[str, tuple[int, ...]], tensors: Mapping[str, torch.Tensor], what: str, partial: bool = False
) -> None:
    """StateError unless `tensors` has exactly the names and shapes of `own` (name -> shape);
    with `partial`, any subset of the names (one bucket of a streamed sync).

    `what` names the two sides in the message, e.g. "sync_weights: policy and sampler models".
    Raised before anything is copied, so a mismatch changes nothing."""
    if partial:
        unknown = sorted(set(tensors) - set(own))
        if unknown:
            raise StateError(f"{what} differ in tensors: {unknown[:5]}")
    elif own.keys() != tensors.keys():
        raise StateError(f"{what} differ in tensors: {sorted(set(own) ^ set(tensors))[:5]}")
    wrong = [k for k, t in tensors.items() if tuple(t.shape) != tuple(own[k])]
    if wrong:
        raise StateError(f"{what} differ in shape: {wrong[:5]}")


def tensor_key(t: torch.Tensor) -> tuple:
    """What makes two tensor objects the same data: device, storage pointer, offset, shape,
    strides, dtype (tied weights, e.g. embed_tokens / lm_head, share one key)."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def unique_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of `tensors`, each distinct tensor (`tensor_key`) counted once: what a sync moves."""
    return sum(t.numel() * t.element_size() for t in {tensor_key(t): t for t in tensors.values()}.values())


@torch.no_grad()
def copy_in_place(
    own: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], what: str, partial: bool = False
) -> None:
    """Copy `tensors` into `own`'s tensors in place (nothing reallocated) after `check_layout`
    (`partial`: a subset of the names is allowed). Tied names (the same source tensor into
    the same destination tensor, `tensor_key`) are copied once."""
    check_layout({k: tuple(v.shape) for k, v in own.items()}, tensors, what, partial)
    done: set[tuple[tuple, tuple]] = set()
    for name, tensor in tensors.items():
        pair = (tensor_key(own[name]), tensor_key(tensor))
        if pair in done:  # tied names: the same source into the same destination, copied once
            continue
        own[name].copy_(tensor)
        done.add(pair)


def dtype_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Name -> dtype name ("float32", "bfloat16", ...) of every tensor: what `SamplerEngine.dtypes` returns."""
    return {name: str(t.dtype).removeprefix("torch.") for name, t in tensors.items()}


def fingerprints(tensors: Mapping[str, torch.Tensor]) -> dict[str, Fingerprint]:
    """`fingerprint` of every named tensor: what `SamplerEngine.fingerprints` returns and
    what a weight sync (`floe.backend.sync`) compares with the policy's. Names that share one
    tensor (tied weights: same storage pointer, offset, shape, strides and dtype) are
    fingerprinted once."""
    seen: dict[tuple, Fingerprint] = {}
    out = {}
    for name, t in tensors.items():
        key = tensor_key(t)
        if key not in seen:
            seen[key] = fingerprint(t)
        out[name] = seen[key]
    return out


def seeds_match_prompts(prompts: list[list[int]], seeds: list[int]) -> None:
    """InvalidInput("seeds", ...) unless there is one int seed in [0, 2^63) per prompt."""
    if len(seeds) != len(prompts):
        raise InvalidInput("seeds", f"{len(seeds)} seeds for {len(prompts)} prompts: give one seed per prompt "
                                    "(floe.backend.sampler.prompt_seeds)")
    if any(type(s) is not int or not 0 <= s < 2**63 for s in seeds):
        raise InvalidInput("seeds", "seeds must be ints in [0, 2^63) (floe.backend.sampler.prompt_seeds makes them)")


@runtime_checkable
class SamplerEngine(Protocol):
    """Generation from token ids on the engine's own copy of the weights."""

    def validate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> None:
        """Engine-specific limits of a request already checked by `floe.backend.validation`;
        raises `InvalidInput` naming the field. Reads nothing that changes."""
        ...

    def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams, seeds: list[int], version: int,
        on_step: OnStep | None = None,
    ) -> list[SampledGroup]:
        """One `SampledGroup` per prompt (in order), n samples each, every sample stamped with
        `version`. `seeds[i]` (one per prompt, `seeds_match_prompts`) fixes every random draw
        of prompt i's samples. `on_step`: called per decode step (module docstring); what it
        raises stops the generation and propagates. StateError while asleep."""
        ...

    @property
    def streams_tokens(self) -> bool:
        """True when `on_step` is called while decoding (live), False when it is replayed from
        the finished samples (`replay_steps`)."""
        ...

    def load_weights(self, tensors: Mapping[str, torch.Tensor], partial: bool = False) -> None:
        """Replace the engine's weights by `tensors` (name -> tensor, the policy's state-dict
        names); with `partial`, only the named ones (a bucket: any subset of the names).
        Raises `StateError` before changing anything when names or shapes differ."""
        ...

    def fingerprints(self) -> dict[str, Fingerprint]:
        """`fingerprints` of the weights the engine holds now, by state-dict name."""
        ...

    def dtypes(self) -> dict[str, str]:
        """The dtype ("float32", "bfloat16", ...) of every weight the engine holds, by state-dict
        name: a sync casts the policy's tensors to these before sending, so the fingerprints it
        publishes are those of what the engine will hold."""
        ...

    @property
    def asleep(self) -> bool:
        """True between `sleep` and `wake`."""
        ...

    def sleep(self) -> None:
        """Release the engine's device memory (weights to host memory, caches freed).
        StateError when the engine cannot sleep here. Idempotent."""
        ...

    def wake(self) -> None:
        """Bring back what `sleep` released. Idempotent."""
        ...

    def memory(self) -> dict[str, str | int | bool]:
        """Where the engine's memory is: at least "device", "weights_on", "device_bytes"
        (bytes of its weights and caches on its device now) and "asleep"."""
        ...

    def close(self) -> None:
        """Release the engine's resources (memory, worker processes). Idempotent."""
        ...
