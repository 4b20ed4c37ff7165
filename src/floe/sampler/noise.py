"""Counter-based randomness for sampling: every draw is a pure function of (seed, counters).

A seeded sample must not depend on which other prompts share its batch, chunk or replica, so
engines never draw from a stateful generator shared by a call. Instead:

* `derive(seed, index)` turns a seed and a counter into a new, well-mixed 63-bit seed
  (SplitMix64 finaliser, Steele, Lea & Flood, "Fast splittable pseudorandom number
  generators", OOPSLA 2014). `floe.backend.sampler.prompt_seeds` uses it for one seed per
  prompt, the torch engine for one per (prompt seed, sample index) row and per decode step.
* `uniforms(keys, width)` gives, for each key (one per row), `width` uniforms in (0, 1): the
  first `width` outputs of the SplitMix64 stream started at that key, computed with
  vectorised int64 torch ops on the keys' device (two's-complement wrap-around, logical shifts
  emulated by masking), so CPU and GPU produce the same bits.
* `sample_categorical(logits, keys)` samples one index per row from softmax(logits) by inverse
  transform sampling: with one uniform U per row (the key's first stream output), the first
  index whose cumulative probability exceeds U is distributed exactly as softmax(logits)
  (up to float64 rounding of the cumulative sum); entries at -inf (probability 0) are never
  chosen. One uniform per row keeps the noise cheap for large vocabularies (a Gumbel-max draw
  needs one hash per vocabulary entry: 3.5× a multinomial draw on CPU at 151,936 tokens).

Python ints and torch tensors give the same values for the same inputs (tests check
`splitmix64` against `splitmix64_tensor`).
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's stream increment (2^64 / golden ratio)
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
SEED_BITS = 63  # derived seeds are non-negative int64 values (fit a tensor, JSON, a vLLM seed)


def _signed(x: int) -> int:
    """The int64 (two's complement) value of a 64-bit unsigned `x`."""
    return x - (1 << 64) if x >= 1 << 63 else x


def splitmix64(x: int) -> int:
    """The SplitMix64 output for state `x` (any int, taken mod 2^64): an unsigned 64-bit int."""
    z = (x + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * _M1) & MASK64
    z = ((z ^ (z >> 27)) * _M2) & MASK64
    return z ^ (z >> 31)


def derive(seed: int, index: int) -> int:
    """A new seed in [0, 2^63) from `seed` and a counter `index` (both any ints): output
    `index` of the SplitMix64 stream keyed by splitmix64(seed). Distinct indices give
    independent-looking seeds; the same inputs always give the same seed."""
    return splitmix64(splitmix64(seed) + (index & MASK64) * GOLDEN) >> (64 - SEED_BITS)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits by `s` (torch's >> on int64 is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """`splitmix64` element-wise on an int64 tensor (bits as int64, wrap-around arithmetic)."""
    z = x + _signed(GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(_M1)
    z = (z ^ _shr(z, 27)) * _signed(_M2)
    return z ^ _shr(z, 31)


def derive_tensor(seeds: torch.Tensor, index: int | torch.Tensor) -> torch.Tensor:
    """`derive` element-wise: int64 `seeds` (values in [0, 2^63)) with counter(s) `index`."""
    if isinstance(index, int):
        step = torch.tensor(_signed((index & MASK64) * GOLDEN & MASK64), dtype=torch.int64, device=seeds.device)
    else:
        step = index.to(torch.int64) * _signed(GOLDEN)
    return _shr(splitmix64_tensor(splitmix64_tensor(seeds) + step), 64 - SEED_BITS)


def uniforms(keys: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, width] float64 uniforms in (0, 1) from int64 `keys` [rows]: entry (r, i) is
    ((output i of the SplitMix64 stream at keys[r]) >> 11 + 0.5) / 2^53."""
    counters = torch.arange(width, dtype=torch.int64, device=keys.device) * _signed(GOLDEN)
    bits = splitmix64_tensor(keys.to(torch.int64).unsqueeze(-1) + counters)
    return (_shr(bits, 11).double() + 0.5) * 2.0**-53


def sample_categorical(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One index per row of `logits` [rows, vocab] (any float dtype; -inf = excluded), drawn
    from softmax(logits) by inverse transform sampling with the uniform `uniforms(keys, 1)`;
    `keys` [rows] int64. Returns [rows] int64 on `logits`' device. A row's index depends on
    that row's logits and key only."""
    u = uniforms(keys.to(logits.device), 1)  # [rows, 1]
    cdf = torch.softmax(logits.double(), dim=-1).cumsum(dim=-1)
    # First index with cdf > u * total: a zero-probability entry repeats its predecessor's cdf,
    # so it can never be that first index.
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    return index.clamp_max(logits.shape[-1] - 1)


def sample_from_weights(weights: torch.Tensor, keys: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """`sample_categorical` on unnormalised probabilities: one index per row of `weights`
    [rows, vocab] (>= 0, 0 = excluded), inverse transform sampling with the same uniform
    `uniforms(keys, 1)`, so it picks what `sample_categorical(log(weights), keys)` picks up to
    float64 rounding of the cumulative sums. Cheap: float64 sums over blocks of `block` entries,
    then a cumulative sum within the one chosen block only (not over the whole vocabulary)."""
    rows, vocab = weights.shape
    u = uniforms(keys.to(weights.device), 1)  # [rows, 1]
    nblocks = -(-vocab // block)
    padded = weights if nblocks * block == vocab else torch.nn.functional.pad(weights, (0, nblocks * block - vocab))
    blocks = padded.view(rows, nblocks, block)
    block_cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [rows, nblocks]
    total = block_cdf[:, -1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    b = torch.searchsorted(block_cdf, target, right=True).clamp_max(nblocks - 1)  # [rows, 1]
    before = torch.where(b > 0, block_cdf.gather(-1, (b - 1).clamp_min(0)), torch.zeros_like(target))
    inner = blocks.gather(1, b.unsqueeze(-1).expand(rows, 1, block)).squeeze(1).double().cumsum(-1)  # [rows, block]
    last = inner[:, -1:]
    rest = torch.minimum(target - before, torch.nextafter(last, torch.zeros_like(last)))
    j = torch.searchsorted(inner, rest, right=True).clamp_max(block - 1)
    return (b * block + j).squeeze(-1).clamp_max(vocab - 1)
