"""The sampler zone: batched generation with a KV cache on its own copy of the weights.

Per call, prompts are processed in chunks of at most `max_batch_sequences` rows. Each prompt
is prefilled once (left-padded with its chunk-mates), then its KV cache is repeated for its n
samples, so the prompt costs one prefill however large n is. Decoding runs all rows of the
chunk together; finished rows are dropped from the cache as they stop.

The KV cache (`kv_cache.preallocated_cache`) and the attention mask are allocated once per
chunk for prompt width + max_tokens positions, so a decode step writes one position instead
of re-concatenating the whole cache.

Log-probs are those of the temperature-scaled distribution before top-k/top-p filtering, the
same quantity the policy's `forward(temperature=...)` computes.
"""

from __future__ import annotations

import inspect
import time

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from floe.backend.kv_cache import preallocated_cache
from floe.types import SampledGroup, SampledSequence, SampleResult, SamplingParams


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


class SamplerZone:
    """Owns the sampling model copy, its weights version and its random generator."""

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_batch_sequences: int, seed: int
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_sequences = max_batch_sequences
        self.version = 0
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device="cpu").manual_seed(seed)  # seeds unseeded calls
        for p in model.parameters():
            p.requires_grad_(False)
        # transformers 5 renamed `past_key_values` to `cache`; support both.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def sample(self, prompts: list[list[int]], n: int, params: SamplingParams) -> SampleResult:
        start = time.perf_counter()
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        gen = torch.Generator(device=self.device).manual_seed(seed)
        prompts_per_chunk = max(1, self.max_batch_sequences // n)
        groups: list[SampledGroup] = []
        for i in range(0, len(prompts), prompts_per_chunk):
            groups.extend(self._sample_chunk(prompts[i : i + prompts_per_chunk], n, params, gen))
        num_tokens = sum(len(s.tokens) for g in groups for s in g.samples)
        return SampleResult(groups, self.version, num_tokens, time.perf_counter() - start)

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        ids = set(params.stop_token_ids)
        if params.stop_at_eos and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _sample_chunk(
        self, prompts: list[list[int]], n: int, params: SamplingParams, gen: torch.Generator
    ) -> list[SampledGroup]:
        dev = self.device
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=dev)
        # Preallocated like the cache: prompt (left padding = 0) then one column per new token.
        # A column is set to 1 just before the step that fills that cache position; the model
        # sees `full_mask[:, :length]`.
        full_mask = torch.zeros((len(prompts), width + params.max_tokens), dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, device=dev)
            full_mask[i, width - len(p) : width] = 1
        mask = full_mask[:, :width]
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = preallocated_cache(self.model.config, capacity=width + params.max_tokens)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions,
            use_cache=True, logits_to_keep=1, **{self._cache_kw: cache},
        )
        # Share each prompt's prefill among its n samples.
        cache.batch_repeat_interleave(n)
        logits = out.logits[:, -1, :].float().repeat_interleave(n, dim=0)
        full_mask = full_mask.repeat_interleave(n, dim=0)
        next_pos = positions[:, -1:].repeat_interleave(n, dim=0) + 1
        length = width  # positions in the cache (and mask columns in use)

        rows = len(prompts) * n
        tokens: list[list[int]] = [[] for _ in range(rows)]
        logps: list[list[float]] = [[] for _ in range(rows)]
        reasons: list[str] = ["length"] * rows
        alive = list(range(rows))  # row ids still decoding, in cache order
        stop_ids = self._stop_ids(params)
        stop_strings = params.stop
        tail = max((len(s) for s in stop_strings), default=0) + 8

        for step in range(params.max_tokens):
            scaled = logits / params.temperature
            logp_all = torch.log_softmax(scaled, dim=-1)
            probs = torch.softmax(filter_logits(scaled, params.top_k, params.top_p), dim=-1)
            chosen = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            chosen_logp = logp_all.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
            keep: list[int] = []
            for j, (row, tok, lp) in enumerate(zip(alive, chosen.tolist(), chosen_logp.tolist())):
                tokens[row].append(tok)
                logps[row].append(lp)
                if tok in stop_ids:
                    reasons[row] = "stop_token"
                elif stop_strings and any(
                    s in self.tokenizer.decode(tokens[row][-tail:]) for s in stop_strings
                ):
                    reasons[row] = "stop_string"
                else:
                    keep.append(j)
            if not keep or step == params.max_tokens - 1:
                break
            if len(keep) < len(alive):
                index = torch.tensor(keep, device=dev)
                cache.batch_select_indices(index)
                chosen, full_mask, next_pos = chosen[index], full_mask[index], next_pos[index]
                alive = [alive[j] for j in keep]
            full_mask[:, length] = 1
            length += 1
            out = self.model(
                input_ids=chosen.unsqueeze(-1), attention_mask=full_mask[:, :length], position_ids=next_pos,
                use_cache=True, **{self._cache_kw: cache},
            )
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1

        return [
            SampledGroup(
                prompt=list(p),
                samples=[
                    SampledSequence(tokens[r], logps[r], reasons[r], self.version)  # type: ignore[arg-type]
                    for r in range(gi * n, (gi + 1) * n)
                ],
            )
            for gi, p in enumerate(prompts)
        ]
