"""The torch engine: batched generation with a preallocated KV cache on its own model copy.

Per call, prompts are processed in chunks of at most `max_batch_sequences` rows. Two decode
paths share one loop:

* shared prefix (the default for Llama, Qwen2 and Qwen3 with full attention,
  `prefix_decode.supports_prefix_decode`): `prefix_decode.PrefixDecoder` prefills each prompt
  once and keeps its KV cache once for all its n samples; each row has a small KV buffer of its
  own for the tokens it generates, and attention joins the two in one softmax;
* padded (any other model, or `TorchEngine(shared_prefix=False)`): each prompt is prefilled
  once (left-padded with its chunk-mates), then its KV cache is repeated for its n samples, in
  a cache (`kv_cache.preallocated_cache`) and attention mask allocated once per chunk for
  prompt width + max_tokens positions, so a decode step writes one position.

Either way finished rows leave the batch as they stop. A chunk runs as: prefill → repeat
{ `draw_tokens` → `_Rows.record` (finished rows) → `on_step` (the step's token of every row
that drew one, when a callback is given) → `PrefixDecoder.step` or `_decode_step` } →
`_Rows.pack`. Every piece of per-call state (cache, mask, rows) lives in locals of the call, so
concurrent `generate` calls on one engine are safe.

Randomness is counter-based (`floe.sampler.noise`): row `k` of prompt `i` has the row seed
derive(seeds[i], k); decode step t of that row draws with the key derive(row seed, t), by
inverse transform sampling (`noise.sample_from_weights`, the draw `noise.sample_categorical`
defines). A token therefore depends only on (prompt seed, sample index, step) and the
logits, never on which prompts share a chunk, a call or a replica.

Sleep / wake (colocation): `sleep()` moves the weights to host memory (pinned) and empties the
CUDA allocator's cache (the KV cache is per call, so none is held between calls); `wake()`
moves them back. On a CPU engine there is nothing to move: both only record the state.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from floe.errors import InvalidInput, StateError
from floe.sampler.engine import (
    Fingerprint,
    OnStep,
    StepToken,
    copy_in_place,
    dtype_names,
    fingerprints,
    seeds_match_prompts,
)
from floe.sampler.kv_cache import preallocated_cache
from floe.sampler.noise import derive, derive_tensor, sample_from_weights
from floe.sampler.prefix_decode import PrefixDecoder, supports_prefix_decode
from floe.types import SampledGroup, SampledSequence, SamplingParams, StopReason


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and the top-p nucleus, row-wise."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def logprob_temperature(params: SamplingParams) -> float:
    """The temperature of the distribution a call's log-probs describe (what its samples
    record): `params.temperature`, or 1.0 for greedy decoding (temperature 0)."""
    return float(params.temperature) if params.temperature > 0 else 1.0


def draw_tokens(
    logits: torch.Tensor, params: SamplingParams, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` [rows, vocab] and its log-prob under the
    temperature-scaled distribution before top-k/top-p.

    The token is drawn from the temperature-scaled, top-k/top-p filtered distribution by
    inverse transform sampling (`noise.sample_from_weights`, the same draw as `noise.sample_categorical`) with the uniform of `keys` [rows]
    int64 (one key per row and step), so a row's draw depends on its key and logits only.

    Temperature 0 is greedy: the argmax of each row (top-k/top-p cannot exclude it, and
    `keys` are not used), with its log-prob under the temperature-1 distribution, which the
    policy's `forward(temperature=1.0)` reproduces."""
    if params.temperature == 0:
        chosen = logits.argmax(dim=-1)
        chosen_logp = torch.log_softmax(logits, dim=-1).gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
        return chosen, chosen_logp
    scaled = logits / params.temperature
    # One exp pass serves both the log-probs (max and log-sum-exp) and the draw's weights.
    top = scaled.amax(-1, keepdim=True)
    weights = torch.exp(scaled - top)
    log_total = weights.sum(-1, keepdim=True).log()
    if params.top_k > 0 or params.top_p < 1.0:
        weights = weights.masked_fill(filter_logits(scaled, params.top_k, params.top_p) == float("-inf"), 0.0)
    chosen = sample_from_weights(weights, keys)
    chosen_logp = (scaled.gather(-1, chosen.unsqueeze(-1)) - top - log_total).squeeze(-1)
    return chosen, chosen_logp


def top_logprobs(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The `params.top_logprobs` most likely tokens of each row of `logits` [rows, vocab]:
    (log-probs, ids), each [rows, k], most likely first, under the distribution `draw_tokens`
    reports log-probs of (temperature-scaled, before top-k/top-p); None when k is 0."""
    if params.top_logprobs <= 0:
        return None
    logp_all = torch.log_softmax(logits / logprob_temperature(params), dim=-1)
    return torch.topk(logp_all, min(params.top_logprobs, logp_all.shape[-1]), dim=-1)


@dataclass
class _DecodeState:
    """A chunk's KV cache and mask, with the next step's inputs; rows in cache order."""

    cache: DynamicCache
    logits: torch.Tensor  # [rows, vocab] float32, predicting each row's next token
    full_mask: torch.Tensor  # [rows, width + max_tokens]; columns < length are in use
    next_pos: torch.Tensor  # [rows, 1] position id of each row's next token
    length: int  # positions in the cache (and mask columns in use)


@dataclass
class _Rows:
    """What each of a chunk's `len(prompts) * n` rows has generated, and which still decode."""

    tokens: list[list[int]]
    logps: list[list[float]]
    reasons: list[StopReason]
    alive: list[int]  # row ids still decoding, in cache order
    stop_ids: set[int]
    stop_strings: list[str]
    tail: int = field(init=False)  # decoded tokens checked for a stop string
    tops: list[list[list[tuple[int, float]]]] | None = None  # per row, per token: top (id, log-prob)

    def __post_init__(self) -> None:
        self.tail = max((len(s) for s in self.stop_strings), default=0) + 8

    @classmethod
    def start(cls, rows: int, stop_ids: set[int], stop_strings: list[str], with_tops: bool = False) -> _Rows:
        return cls([[] for _ in range(rows)], [[] for _ in range(rows)], ["length"] * rows,
                   list(range(rows)), stop_ids, stop_strings, [[] for _ in range(rows)] if with_tops else None)

    def record(
        self, chosen: torch.Tensor, chosen_logp: torch.Tensor, tokenizer: PreTrainedTokenizerBase,
        top: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> list[int]:
        """Append each alive row's token and log-prob (and `top` alternatives, from
        `top_logprobs`); returns the cache indices of the rows that go on (a row stops at a
        stop token or at the token completing a stop string)."""
        if top is not None and self.tops is not None:
            for row, values, ids in zip(self.alive, top[0].tolist(), top[1].tolist()):
                self.tops[row].append(list(zip(ids, values)))
        keep: list[int] = []
        for j, (row, tok, lp) in enumerate(zip(self.alive, chosen.tolist(), chosen_logp.tolist())):
            self.tokens[row].append(tok)
            self.logps[row].append(lp)
            if tok in self.stop_ids:
                self.reasons[row] = "stop_token"
            elif self.stop_strings and any(
                s in tokenizer.decode(self.tokens[row][-self.tail :]) for s in self.stop_strings
            ):
                self.reasons[row] = "stop_string"
            else:
                keep.append(j)
        return keep

    def pack(self, prompts: list[list[int]], n: int, version: int, temperature: float) -> list[SampledGroup]:
        """One group per prompt; row `gi * n + k` is sample k of prompt gi; every sample
        records `version` and the `temperature` of its log-probs."""
        return [
            SampledGroup(
                prompt=list(p),
                samples=[
                    SampledSequence(self.tokens[r], self.logps[r], self.reasons[r], version, temperature,
                                    self.tops[r] if self.tops is not None else None)
                    for r in range(gi * n, (gi + 1) * n)
                ],
            )
            for gi, p in enumerate(prompts)
        ]


class TorchEngine:
    """`SamplerEngine` on a transformers model in this process (CPU or GPU)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_batch_sequences: int,
                 shared_prefix: bool = True):
        """`shared_prefix`: decode with `prefix_decode.PrefixDecoder` (each prompt's KV stored once)
        where the model supports it; False keeps the padded path (prompt KV repeated n times)."""
        self.model = model
        self.shared_prefix = shared_prefix and supports_prefix_decode(model)
        self.tokenizer = tokenizer
        self.max_batch_sequences = max_batch_sequences
        self.device = next(model.parameters()).device
        for p in model.parameters():
            p.requires_grad_(False)
        # transformers 5 renamed `past_key_values` to `cache`; support both.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._asleep = False

    # -- SamplerEngine ----------------------------------------------------------------------

    def validate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> None:
        """n must fit one chunk: all samples of a prompt share its prefill in one batch."""
        if n > self.max_batch_sequences:
            raise InvalidInput(
                "n", f"{n} samples per prompt exceed sampler.engine.max_batch_sequences ({self.max_batch_sequences})"
            )

    @property
    def streams_tokens(self) -> bool:
        """Always: `on_step` is called from the decode loop as each token is drawn."""
        return True

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams, seeds: list[int], version: int,
        on_step: OnStep | None = None,
    ) -> list[SampledGroup]:
        seeds_match_prompts(prompts, seeds)
        if self._asleep:
            raise StateError("the torch sampler engine is asleep: call wake() first")
        prompts_per_chunk = max(1, self.max_batch_sequences // n)
        groups: list[SampledGroup] = []
        for i in range(0, len(prompts), prompts_per_chunk):
            chunk = slice(i, i + prompts_per_chunk)
            groups.extend(self._generate_chunk(prompts[chunk], n, params, seeds[chunk], version, on_step, i * n))
        return groups

    @torch.no_grad()
    def load_weights(self, tensors: Mapping[str, torch.Tensor], partial: bool = False) -> None:
        """Copy `tensors` into the model's own tensors in place (nothing is reallocated); with
        `partial`, `tensors` may be any subset of the names (one bucket of a streamed sync).
        Works asleep too (the copy lands in host memory)."""
        copy_in_place(self.model.state_dict(), tensors, "sync_weights: policy and sampler models", partial)

    def fingerprints(self) -> dict[str, Fingerprint]:
        return fingerprints(self.model.state_dict())

    def dtypes(self) -> dict[str, str]:
        return dtype_names(self.model.state_dict())

    @property
    def asleep(self) -> bool:
        return self._asleep

    @torch.no_grad()
    def sleep(self) -> None:
        """Release device memory: weights to pinned host memory and the CUDA allocator's cache
        emptied. On a CPU engine nothing moves (only the state is recorded). Idempotent."""
        if self._asleep:
            return
        if self.device.type == "cuda":
            self.model._apply(lambda t: t.to("cpu").pin_memory())
            torch.cuda.empty_cache()
        self._asleep = True

    @torch.no_grad()
    def wake(self) -> None:
        """Undo `sleep`: weights back on the engine's device. Idempotent."""
        if not self._asleep:
            return
        if self.device.type == "cuda":
            self.model._apply(lambda t: t.to(self.device, non_blocking=True))
            torch.cuda.synchronize(self.device)
        self._asleep = False

    def memory(self) -> dict[str, str | int | bool]:
        """Where the weights are: {"device": the engine's device, "weights_on": the device they
        are on now, "weights_bytes": their size, "device_bytes": bytes of them held on the
        engine's device (on a CPU engine the CPU is the device: all of them), "asleep"}.
        The KV cache exists only during a `generate` call and is not counted."""
        tensors = list(self.model.state_dict().values())
        total = sum(t.numel() * t.element_size() for t in tensors)
        on_device = sum(t.numel() * t.element_size() for t in tensors if t.device == self.device)
        where = str(tensors[0].device) if tensors else str(self.device)
        return {"device": str(self.device), "weights_on": where, "weights_bytes": total, "device_bytes": on_device,
                "asleep": self._asleep}

    def close(self) -> None:
        """Nothing to release: the model is freed with the engine."""

    # -- one chunk --------------------------------------------------------------------------

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        ids = set(params.stop_token_ids)
        if params.stop_at_eos and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _generate_chunk(
        self, prompts: list[list[int]], n: int, params: SamplingParams, seeds: list[int], version: int,
        on_step: OnStep | None = None, first_row: int = 0,
    ) -> list[SampledGroup]:
        rows = _Rows.start(len(prompts) * n, self._stop_ids(params), params.stop, params.top_logprobs > 0)
        decoder: PrefixDecoder | None = None
        if self.shared_prefix:
            decoder = PrefixDecoder(self.model, prompts, n, params.max_tokens, self.tokenizer.pad_token_id or 0,
                                    self._cache_kw)
            logits = decoder.prefill()
        else:
            state = self._prefill(prompts, n, params.max_tokens)
            logits = state.logits
        # Row gi * n + k is sample k of prompt gi: its seed is derive(seeds[gi], k).
        row_seeds = torch.tensor([derive(s, k) for s in seeds for k in range(n)], dtype=torch.int64, device=self.device)
        for step in range(params.max_tokens):
            alive = torch.tensor(rows.alive, device=self.device)
            chosen, chosen_logp = draw_tokens(logits, params, derive_tensor(row_seeds[alive], step))
            keep = rows.record(chosen, chosen_logp, self.tokenizer, top_logprobs(logits, params))
            if on_step is not None:  # this step's token of every row that drew one (`rows.alive`: the call's row ids)
                on_step([StepToken(first_row + r, rows.tokens[r][-1], rows.logps[r][-1],
                                   tuple(rows.tops[r][-1]) if rows.tops is not None else None) for r in rows.alive])
            if not keep or step == params.max_tokens - 1:
                break
            if decoder is not None:
                logits = decoder.step(chosen, keep)  # finished rows leave the batch here
                if len(keep) < len(rows.alive):
                    rows.alive = [rows.alive[j] for j in keep]
            else:
                self._decode_step(state, rows, chosen, keep)
                logits = state.logits
        return rows.pack(prompts, n, version, logprob_temperature(params))

    def _prefill(self, prompts: list[list[int]], n: int, max_tokens: int) -> _DecodeState:
        """Run the left-padded prompts once and repeat their cache n times (rows = prompts × n)."""
        dev = self.device
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=dev)
        # Preallocated like the cache: prompt (left padding = 0) then one column per new token.
        # A column is set to 1 just before the step that fills that cache position; the model
        # sees `full_mask[:, :length]`.
        full_mask = torch.zeros((len(prompts), width + max_tokens), dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, device=dev)
            full_mask[i, width - len(p) : width] = 1
        mask = full_mask[:, :width]
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = preallocated_cache(self.model.config, capacity=width + max_tokens)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions,
            use_cache=True, logits_to_keep=1, **{self._cache_kw: cache},
        )
        # Share each prompt's prefill among its n samples.
        cache.batch_repeat_interleave(n)
        return _DecodeState(
            cache=cache,
            logits=out.logits[:, -1, :].float().repeat_interleave(n, dim=0),
            full_mask=full_mask.repeat_interleave(n, dim=0),
            next_pos=positions[:, -1:].repeat_interleave(n, dim=0) + 1,
            length=width,
        )

    def _decode_step(self, state: _DecodeState, rows: _Rows, chosen: torch.Tensor, keep: list[int]) -> None:
        """Drop finished rows from the cache, then feed each remaining row its chosen token."""
        if len(keep) < len(rows.alive):
            index = torch.tensor(keep, device=self.device)
            state.cache.batch_select_indices(index)
            chosen, state.full_mask, state.next_pos = chosen[index], state.full_mask[index], state.next_pos[index]
            rows.alive = [rows.alive[j] for j in keep]
        state.full_mask[:, state.length] = 1
        state.length += 1
        out = self.model(
            input_ids=chosen.unsqueeze(-1), attention_mask=state.full_mask[:, : state.length],
            position_ids=state.next_pos, use_cache=True, **{self._cache_kw: state.cache},
        )
        state.logits = out.logits[:, -1, :].float()
        state.next_pos = state.next_pos + 1
