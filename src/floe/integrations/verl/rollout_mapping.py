"""verl's per-request sampling params -> floe.SamplingParams (pure; no verl import).

verl's agent loops call a rollout server's `generate(prompt_ids, sampling_params, ...)` with
vLLM-style params: temperature (0 = greedy), top_p, top_k (-1 = off), repetition_penalty,
logprobs, and optionally max_tokens / max_new_tokens, ignore_eos, seed. The number of new
tokens follows verl's vLLM server: max_tokens if given, else min(response_length,
prompt_length + response_length - len(prompt)), clamped to [1, max_model_len - len(prompt)].
Anything floe cannot honour (a repetition penalty other than 1, unknown keys) is refused with
InvalidInput naming `sampling_params.<key>`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from floe.errors import InvalidInput
from floe.types import SamplingParams

_KNOWN = {"temperature", "top_p", "top_k", "repetition_penalty", "logprobs", "max_tokens", "max_new_tokens",
          "ignore_eos", "seed", "stop_token_ids"}


def floe_sampling_params(
    sampling_params: Mapping[str, Any], prompt_len: int, response_length: int, prompt_length: int,
    max_model_len: int | None = None,
) -> SamplingParams:
    """The floe.SamplingParams for one verl generate request (see the module docstring).

    response_length / prompt_length: verl's `actor_rollout_ref.rollout.response_length` /
    `prompt_length`; max_model_len: the rollout's context limit (default prompt_length +
    response_length).
    """
    unknown = sorted(set(sampling_params) - _KNOWN)
    if unknown:
        raise InvalidInput(f"sampling_params.{unknown[0]}", f"not supported by floe's verl rollout; known: {sorted(_KNOWN)}")
    penalty = sampling_params.get("repetition_penalty", 1.0)
    if penalty is not None and float(penalty) != 1.0:
        raise InvalidInput("sampling_params.repetition_penalty", f"floe samples without a repetition penalty; got {penalty}")
    max_model_len = max_model_len or prompt_length + response_length
    limit = max_model_len - prompt_len
    if limit < 1:
        raise InvalidInput("prompt_ids", f"the prompt ({prompt_len} tokens) leaves no room within {max_model_len} tokens")
    requested = sampling_params.get("max_tokens", sampling_params.get("max_new_tokens"))
    if requested is None:
        requested = min(response_length, prompt_length + response_length - prompt_len)
    top_k = int(sampling_params.get("top_k", -1) if sampling_params.get("top_k") is not None else -1)
    return SamplingParams(
        max_tokens=max(1, min(int(requested), limit)),
        temperature=float(sampling_params.get("temperature", 1.0)),
        top_p=float(sampling_params.get("top_p", 1.0) if sampling_params.get("top_p") is not None else 1.0),
        top_k=max(top_k, 0),
        stop_token_ids=list(sampling_params.get("stop_token_ids") or []),
        seed=sampling_params.get("seed"),
        stop_at_eos=not bool(sampling_params.get("ignore_eos", False)),
    )
