"""Checks every request before it touches state; each failure names the field and the fix.

The backend calls these first, so a rejected request leaves weights, optimizer state, step
and version exactly as they were.
"""

from __future__ import annotations

import math
from typing import Any

from floe.compute.losses import LossSpec
from floe.errors import InvalidInput
from floe.types import Batch, Group, Sample, SamplingParams

MAX_TOP_LOGPROBS = 20  # alternatives per token a sample call may ask for (OpenAI's limit)
SEED_LIMIT = 2**63  # seeds are in [0, 2**63): they seed a 64-bit torch generator
COUNT_LIMIT = 2**31  # top_k and n are below this (32-bit counts); larger values mean nothing more
# Weights versions are in [0, 2**63 - 1]: every wire format carries them as signed 64-bit
# integers, so a larger one would break every later sample's reply (and the saved state).
VERSION_LIMIT = 2**63 - 1
# A sampling log-prob above this is refused: log-probs are <= 0, and float noise of a token with
# probability ~1 stays far below 1e-4.
LOGPROB_TOLERANCE = 1e-4
# Stop conditions, bounded because every decode step of every row checks each stop string against
# the decoded tail (the longest stop string + 8 tokens) while the sampler's model is held, so an
# unbounded list lets one request stall every other caller of a shared sampler. OpenAI allows 4
# stop strings, vLLM does not bound them; 32 strings of at most 256 characters cover every stop
# list an RL recipe or chat template uses (end-of-turn markers, "\n\n", tool-call tags) at a
# per-step cost of a few microseconds. Stop token ids are looked up in a set (the torch engine)
# or a short list (vLLM), so they get a wider bound that only keeps requests small.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256


def _is_finite_number(value: Any) -> bool:
    """An int or float (not bool) that converts to a finite float (huge ints do not)."""
    if type(value) not in (int, float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float's range
        return False


def _is_int_in(value: Any, lo: int, hi: int) -> bool:
    """An int (not bool) with lo <= value < hi."""
    return type(value) is int and lo <= value < hi


def _check_token_list(field: str, tokens: Any, vocab_size: int) -> None:
    if not isinstance(tokens, list):
        raise InvalidInput(field, f"must be a list of token ids, got {type(tokens).__name__}")
    if not tokens:
        raise InvalidInput(field, "must not be empty")
    if not all(type(t) is int for t in tokens):
        bad = next(t for t in tokens if type(t) is not int)
        raise InvalidInput(field, f"token ids must be integers, got {bad!r}")
    lo, hi = min(tokens), max(tokens)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InvalidInput(field, f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def _check_floats(field: str, values: Any, length: int) -> None:
    if not isinstance(values, list):
        raise InvalidInput(field, f"must be a list of numbers, got {type(values).__name__}")
    if len(values) != length:
        raise InvalidInput(field, f"has {len(values)} values but the sample has {length} tokens")
    for i, v in enumerate(values):
        if not _is_finite_number(v):
            raise InvalidInput(f"{field}[{i}]", f"must be a finite number, got {v!r}")


def _check_logprobs(field: str, values: list[float]) -> None:
    """Log-probs (already finite numbers) are <= 0, up to LOGPROB_TOLERANCE of float noise."""
    for i, v in enumerate(values):
        if v > LOGPROB_TOLERANCE:
            raise InvalidInput(
                f"{field}[{i}]",
                f"is {v!r}, but a log-probability is <= 0 (a probability <= 1; {LOGPROB_TOLERANCE} of float "
                "noise is allowed); pass the log-probs of the sampled tokens, not probabilities or logits",
            )


def validate_batch(
    batch: Any, vocab_size: int, max_context: int, loss: LossSpec | None = None, where: str = "batch"
) -> None:
    """A batch for forward (loss=None) or forward_backward (with its resolved loss)."""
    if not isinstance(batch, Batch):
        raise InvalidInput(where, f"must be a floe.Batch, got {type(batch).__name__}")
    if not isinstance(batch.groups, list) or not batch.groups:
        raise InvalidInput(f"{where}.groups", "must be a non-empty list of floe.Group")
    for gi, group in enumerate(batch.groups):
        gf = f"{where}.groups[{gi}]"
        if not isinstance(group, Group):
            raise InvalidInput(gf, f"must be a floe.Group, got {type(group).__name__}")
        _check_token_list(f"{gf}.prompt", group.prompt, vocab_size)
        if not isinstance(group.samples, list) or not group.samples:
            raise InvalidInput(f"{gf}.samples", "must be a non-empty list of floe.Sample")
        for si, sample in enumerate(group.samples):
            _validate_sample(f"{gf}.samples[{si}]", sample, len(group.prompt), vocab_size, max_context, loss)


def _validate_sample(
    sf: str, sample: Any, prompt_len: int, vocab_size: int, max_context: int, loss: LossSpec | None
) -> None:
    if not isinstance(sample, Sample):
        raise InvalidInput(sf, f"must be a floe.Sample, got {type(sample).__name__}")
    _check_token_list(f"{sf}.tokens", sample.tokens, vocab_size)
    n = len(sample.tokens)
    if prompt_len + n > max_context:
        raise InvalidInput(
            f"{sf}.tokens",
            f"prompt ({prompt_len}) + sample ({n}) tokens exceed the model's context of {max_context}",
        )
    for name in ("logprobs", "weights", "ref_logprobs"):
        value = getattr(sample, name)
        if value is not None:
            _check_floats(f"{sf}.{name}", value, n)
            if name != "weights":
                _check_logprobs(f"{sf}.{name}", value)
    if sample.weights is not None and min(sample.weights) < 0:
        # Weights scale and mask tokens; a negative one would make the mean denominators meaningless.
        raise InvalidInput(f"{sf}.weights", "must be >= 0 (a per-token scale or 0/1 mask); put signs in the advantage")
    if sample.temperature is not None and not _is_positive_finite(sample.temperature):
        raise InvalidInput(
            f"{sf}.temperature",
            f"must be a finite number > 0 (the sampling temperature of its log-probs) or None, got {sample.temperature!r}",
        )
    if sample.advantage is not None:
        if isinstance(sample.advantage, list):
            _check_floats(f"{sf}.advantage", sample.advantage, n)
        elif not _is_finite_number(sample.advantage):
            raise InvalidInput(f"{sf}.advantage", f"must be a finite number or a per-token list, got {sample.advantage!r}")
    if loss is None:
        return
    if loss.needs_old_logprobs and sample.logprobs is None:
        raise InvalidInput(f"{sf}.logprobs", f"loss {loss.name!r} needs the sampling log-probs of every token")
    if loss.needs_advantages and sample.advantage is None:
        raise InvalidInput(f"{sf}.advantage", f"loss {loss.name!r} needs an advantage (scalar or per token)")
    if not loss.needs_advantages and sample.advantage is not None:
        raise InvalidInput(
            f"{sf}.advantage",
            f"loss {loss.name!r} does not use advantages; drop them or choose importance_sampling/ppo",
        )
    if loss.needs_ref_logprobs and sample.ref_logprobs is None:
        raise InvalidInput(
            f"{sf}.ref_logprobs", "loss_config.kl.coef > 0 needs reference log-probs (forward with zone='reference')"
        )


def _is_positive_finite(value: Any) -> bool:
    return _is_finite_number(value) and value > 0


def check_temperature(temperature: Any) -> float | None:
    """The `temperature` argument of forward / forward_backward: a finite number > 0, or None
    (take it from the batch's samples); InvalidInput("temperature") otherwise."""
    if temperature is None:
        return None
    if not _is_positive_finite(temperature):
        raise InvalidInput("temperature", f"must be a finite number > 0 or None (the samples' own), got {temperature!r}")
    return float(temperature)


MAX_LEARNING_RATE = 1.0  # Adam moves every weight by about lr per step: above 1 no fine-tune survives a step


def check_step_lr(lr: Any) -> float | None:
    """The `lr` argument of optim_step: None (the configured schedule's rate), or a finite
    number in [0, MAX_LEARNING_RATE] (0 is a valid step: the frameworks' warm-ups start there);
    InvalidInput("lr") otherwise."""
    if lr is None:
        return None
    if not _is_finite_number(lr) or not 0 <= lr <= MAX_LEARNING_RATE:
        raise InvalidInput("lr", f"must be a finite number in [0, {MAX_LEARNING_RATE}] or None (the configured schedule), "
                           f"got {lr!r}")
    return float(lr)


def resolve_temperature(batch: Batch, temperature: float | None, where: str = "batch") -> float:
    """The temperature to score a validated `batch` at (the one rule, floe.types docstring).

    Given `temperature` (checked by `check_temperature`): every sample that states a
    temperature must state this one. None: the temperature the samples state, which must be
    the same for all that state one; 1.0 when none does. A disagreement raises InvalidInput
    naming the sample's `temperature` field and both values.
    """
    first: tuple[str, float] | None = None
    for gi, group in enumerate(batch.groups):
        for si, sample in enumerate(group.samples):
            if sample.temperature is None:
                continue
            field = f"{where}.groups[{gi}].samples[{si}].temperature"
            stated = float(sample.temperature)
            if temperature is not None and stated != temperature:
                raise InvalidInput(
                    field,
                    f"the sample's log-probs are at temperature {stated} but the call scores at temperature="
                    f"{temperature}; pass temperature={stated} (or omit it to use the samples'), or set the "
                    "sample's temperature to None if its log-probs are not used",
                )
            if first is None:
                first = (field, stated)
            elif stated != first[1]:
                raise InvalidInput(
                    field,
                    f"the sample states temperature {stated} but {first[0]} states {first[1]}; one call scores "
                    "every sample at one temperature: split the batch by temperature",
                )
    if temperature is not None:
        return temperature
    return first[1] if first is not None else 1.0


def validate_prompts(prompts: Any, n: Any, params: Any, vocab_size: int, max_context: int) -> None:
    """A sample call's prompts (token ids in [0, vocab_size)), `n` (in [1, 2**31)) and params.

    A prompt of max_context tokens or more leaves no room to generate: InvalidInput names it
    (`prompts[i]`). Prompts that fit but not with `params.max_tokens` more name
    `params.max_tokens`.
    """
    if not isinstance(prompts, list) or not prompts:
        raise InvalidInput("prompts", "must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        _check_token_list(f"prompts[{i}]", p, vocab_size)
    if not _is_int_in(n, 1, COUNT_LIMIT):
        raise InvalidInput("n", f"must be an integer in [1, {COUNT_LIMIT}), got {n!r}")
    validate_sampling_params(params, vocab_size)
    for i, p in enumerate(prompts):
        if len(p) >= max_context:
            raise InvalidInput(
                f"prompts[{i}]",
                f"has {len(p)} tokens; the model's context is {max_context}, which leaves no room to generate: "
                "shorten the prompt",
            )
    longest = max(len(p) for p in prompts)
    if longest + params.max_tokens > max_context:
        raise InvalidInput(
            "params.max_tokens",
            f"longest prompt ({longest}) + max_tokens ({params.max_tokens}) exceeds the context of {max_context}",
        )


def validate_sampling_params(params: Any, vocab_size: int) -> None:
    """Every field of `params` in range (see floe.SamplingParams); InvalidInput("params.<field>").

    Integer fields are bounded so none overflows the sampler: seed in [0, 2**63), top_k in
    [0, 2**31), stop token ids in [0, vocab_size), top_logprobs in [0, 20]; max_tokens >= 1
    (bounded by the context in validate_prompts); stop conditions as `check_stops` says.
    Every route (native, OpenAI, Tinker, prime-rl) reaches the sampler through this check.
    """
    if not isinstance(params, SamplingParams):
        raise InvalidInput("params", f"must be floe.SamplingParams, got {type(params).__name__}")
    if type(params.max_tokens) is not int or params.max_tokens < 1:
        raise InvalidInput("params.max_tokens", f"must be an integer >= 1, got {params.max_tokens!r}")
    if not _is_finite_number(params.temperature) or params.temperature < 0:
        raise InvalidInput(
            "params.temperature", f"must be a finite number >= 0 (0 = greedy), got {params.temperature!r}"
        )
    if type(params.top_p) not in (int, float) or not 0 < params.top_p <= 1:
        raise InvalidInput("params.top_p", f"must be in (0, 1], got {params.top_p!r}")
    if not _is_int_in(params.top_k, 0, COUNT_LIMIT):
        raise InvalidInput(
            "params.top_k", f"must be an integer in [0, {COUNT_LIMIT}) (0 = off), got {params.top_k!r}"
        )
    check_stops(params.stop, params.stop_token_ids, vocab_size)
    if type(params.stop_at_eos) is not bool:
        raise InvalidInput("params.stop_at_eos", f"must be true or false, got {params.stop_at_eos!r}")
    if params.seed is not None and not _is_int_in(params.seed, 0, SEED_LIMIT):
        raise InvalidInput(
            "params.seed", f"must be an integer in [0, 2**63) or None (a seed drawn per call), got {params.seed!r}"
        )
    if type(params.top_logprobs) is not int or not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidInput(
            "params.top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}] (0 = none), got {params.top_logprobs!r}"
        )


def check_stops(stop: Any, stop_token_ids: Any, vocab_size: int) -> None:
    """`stop`: a list of at most MAX_STOP_STRINGS strings, each 1..MAX_STOP_CHARS characters of
    valid Unicode (a lone UTF-16 surrogate can never be generated); `stop_token_ids`: a list of at
    most MAX_STOP_TOKEN_IDS ids in [0, vocab_size). InvalidInput("params.stop" /
    "params.stop_token_ids", the message naming the entry) otherwise, checked before any work
    (see MAX_STOP_STRINGS)."""
    if not isinstance(stop_token_ids, list):
        raise InvalidInput("params.stop_token_ids", f"must be a list of token ids in [0, {vocab_size})")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidInput("params.stop_token_ids", f"has {len(stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} "
                           "stop token ids per request: send only the ids that end a sample")
    for i, t in enumerate(stop_token_ids):
        if type(t) is not int or not 0 <= t < vocab_size:
            raise InvalidInput("params.stop_token_ids", f"must be a list of token ids in [0, {vocab_size}); "
                               f"[{i}] is {_shown(t)}")
    if not isinstance(stop, list):
        raise InvalidInput("params.stop", f"must be a list of non-empty strings, got {type(stop).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidInput("params.stop", f"has {len(stop)} stop strings; at most {MAX_STOP_STRINGS} per request "
                           f"(each 1..{MAX_STOP_CHARS} characters): send only the strings that end a sample")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise InvalidInput("params.stop", f"must be a list of non-empty strings; [{i}] is {_shown(s)}")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidInput("params.stop", f"[{i}] has {len(s)} characters; a stop string has at most "
                               f"{MAX_STOP_CHARS}: stop on a shorter marker")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInput("params.stop", f"[{i}] holds a lone UTF-16 surrogate, which is not a character and "
                               "is never generated: send valid Unicode text") from None


def _shown(value: Any) -> str:
    """`value` for an error message, cut to 40 characters (a 5000-digit int has no repr)."""
    try:
        text = repr(value)
    except ValueError:
        return f"an int of {value.bit_length()} bits"
    return text if len(text) <= 40 else text[:37] + "..."
