"""The data that crosses the client API: ragged, token-id based, one prompt per group.

Everything here is a plain dataclass of Python lists and numbers so that every transport
(in-process, HTTP, Ray) can carry it without pickling. A `Group` holds its prompt once and its
n samples as they are: no padding, no n-fold copies of the prompt.

Alignment convention (one for the whole project): a sample's `logprobs[t]`, `weights[t]`,
per-token `advantage[t]` and `ref_logprobs[t]` all describe `tokens[t]`, i.e.
log p(tokens[t] | prompt, tokens[:t]).

Temperature convention: a sample's `temperature` is that of the distribution its `logprobs`
describe (the sampler's temperature; 1.0 for greedy sampling). `forward` and
`forward_backward` score a batch at the call's `temperature`, or, when the call gives none, at
the temperature its samples state (all equal; 1.0 when none states one). A sample whose stated
temperature differs from the call's is refused (floe.backend.validation.resolve_temperature).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

StopReason = Literal["stop_token", "stop_string", "length"]


@dataclass
class Sample:
    """One response to a group's prompt, with whatever the loss needs for it."""

    tokens: list[int]
    logprobs: list[float] | None = None  # sampling-time log-probs (the "old" policy)
    advantage: float | list[float] | None = None  # scalar, or one value per token
    weights: list[float] | None = None  # per-token loss weights / mask; default all 1
    ref_logprobs: list[float] | None = None  # reference-zone log-probs, for the KL term
    # The temperature of the distribution `logprobs` come from (None = not stated); copy it
    # from the SampledSequence so forward_backward scores at the same one (module docstring).
    temperature: float | None = None


@dataclass
class Group:
    """One prompt and its samples. The prompt is stored once for all of them."""

    prompt: list[int]
    samples: list[Sample]


@dataclass
class Batch:
    """The unit of `forward` and `forward_backward`: a list of groups."""

    groups: list[Group]

    @property
    def num_samples(self) -> int:
        return sum(len(g.samples) for g in self.groups)

    @property
    def num_sample_tokens(self) -> int:
        return sum(len(s.tokens) for g in self.groups for s in g.samples)


@dataclass
class SamplingParams:
    """How to sample. `top_k=0` and `top_p=1.0` switch those filters off.

    `temperature=0` is greedy decoding: each token is the argmax of the logits (top-k, top-p
    and the seed then change nothing), and the log-probs reported are those of the
    temperature-1 distribution, which `forward(temperature=1.0)` reproduces; such samples
    record `temperature=1.0`. Otherwise log-probs returned with samples are those of the
    temperature-scaled distribution before top-k/top-p filtering, so they match
    `forward(temperature=...)` exactly.
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings, matched on decoded output
    seed: int | None = None
    stop_at_eos: bool = True  # the tokenizer's eos id counts as a stop token
    # Per generated token, also return the `top_logprobs` (0-20) most likely tokens of the same
    # distribution the token's log-prob is from (SampledSequence.top_logprobs); 0 = none.
    top_logprobs: int = 0


@dataclass
class SampledSequence:
    """One generated sample. `tokens` excludes the prompt and includes the stop token (or the
    token that completed a stop string), so it can be fed back as a `Sample` unchanged.

    `temperature` is that of the distribution `logprobs` describe: the call's
    `SamplingParams.temperature`, or 1.0 for greedy sampling (temperature 0). The sampler
    always sets it; None only in sequences built by hand."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    weights_version: int
    temperature: float | None = None
    # With SamplingParams.top_logprobs = k > 0: per token, the k most likely (token id,
    # log-prob) of the distribution `logprobs` are from (before top-k/top-p), most likely
    # first; None when k = 0.
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class SampledGroup:
    """One prompt's samples: `prompt` (token ids, as given) and its n `samples`."""

    prompt: list[int]
    samples: list[SampledSequence]


@dataclass
class SampleResult:
    """What one `sample` call generated: `groups[i]` answers prompt i."""

    groups: list[SampledGroup]
    weights_version: int  # the sampler's weights version that produced every sample of this call
    num_tokens: int  # generated tokens over all samples (stop tokens included)
    seconds: float  # wall-clock seconds the backend spent generating (transport time excluded)

    @property
    def temperature(self) -> float | None:
        """The temperature every sample's log-probs are at (SampledSequence.temperature), or
        None when there are no samples or they do not all state the same one."""
        found = {s.temperature for g in self.groups for s in g.samples}
        return found.pop() if len(found) == 1 else None


# The backend's measurement of a `forward` / `forward_backward` call, in both results' `metrics`
# (docs/api.md, "Throughput metrics"; formula: floe.compute.flops):
#   seconds           wall-clock seconds the backend computed (validation, lock waits, mode
#                     switches and the transport to the caller excluded)
#   sequence_tokens   Σ over samples of prompt + sample tokens (each sample with its prompt)
#   tokens_per_second sequence_tokens / seconds
#   model_flops       the call's model FLOPs (forward + backward for forward_backward, forward
#                     alone for forward); absent for a model the formula does not cover
#   mfu               model_flops / seconds / (peak FLOP/s × policy devices), a fraction; absent
#                     when the peak is unknown (info().capabilities["peak_flops"] is None)
THROUGHPUT_METRICS = ("seconds", "sequence_tokens", "tokens_per_second", "model_flops", "mfu")


@dataclass
class ForwardResult:
    """Per-token log-probs (and entropies when asked), indexed [group][sample][token], and the
    backend's measurement of the call in `metrics` (THROUGHPUT_METRICS)."""

    logprobs: list[list[list[float]]]
    entropy: list[list[list[float]]] | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ForwardBackwardResult:
    """Metrics of one `forward_backward` call plus the policy's log-probs of each token.

    `metrics` holds the loss's metrics (loss, tokens, clip_fraction, ...; docs/losses.md) and
    the backend's measurement of the call (THROUGHPUT_METRICS). `loss_config` is the fully
    resolved loss configuration, defaults included, so a caller can always see exactly what ran.
    """

    metrics: dict[str, float]
    logprobs: list[list[list[float]]]
    loss: str
    loss_config: dict[str, Any]


@dataclass
class OptimStepResult:
    """What `optim_step` applied."""

    step: int  # optimizer steps applied so far, this one included (the policy's version)
    lr: float  # the learning rate this step used (from the schedule)
    grad_norm: float  # global L2 norm of the accumulated gradients before clipping
    accumulated_calls: int  # forward_backward calls whose gradients this step applied


@dataclass
class SyncResult:
    """A sync that returns has verified every tensor's fingerprint (a failed one raises)."""

    version: int  # the sampler's weights version after the sync
    bytes: int  # bytes of weights moved
    seconds: float


@dataclass
class StateResult:
    """A saved (or loaded, or deleted) state: its `name`, its directory `path` on the backend's
    machine, the policy `step` and the sampler weights `version` it holds (-1 for a deleted
    state whose state.json was damaged)."""

    name: str
    path: str
    step: int
    version: int


@dataclass
class Info:
    """The backend as it is now (`client.info()`).

    `capabilities` keys: `losses`, `aggregations`, `kl_estimators` (lists of names from the loss
    registry), `sampler_engine` (the engine's name), `sampler_engine_start_seconds` (float),
    `pending_forward_backward_calls` (int: calls whose gradients wait for optim_step),
    `device_name` (the policy's hardware, floe.devices.device_name), `policy_devices` (int:
    devices the policy computes on), `peak_flops` (FLOP/s of one of them, or None: unknown),
    `peak_flops_source` ("compute.peak_tflops", "datasheet" or None), `model_flops` (bool:
    whether floe.compute.flops covers the model, i.e. results report `model_flops`),
    `optimizer` (the policy's `OptimizerConfig` as JSON plus `name` "adamw": lr, betas, eps,
    weight_decay, grad_clip, schedule, ...; a plugin checks a framework's optimizer keys against it).
    """

    model: str  # the model path or hub id the policy was loaded from
    zones: list[str]  # "policy", "sampler" and, when enabled, "reference"
    step: int  # optimizer steps applied
    policy_version: int  # = step
    sampler_version: int  # the sampler's weights version (syncs, or the caller's tags)
    vocab_size: int
    max_context: int  # tokens: prompt + generated must fit
    dtype: str  # compute dtype of the policy, e.g. "float32", "bfloat16"
    device: str
    capabilities: dict[str, Any] = field(default_factory=dict)
