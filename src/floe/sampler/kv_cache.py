"""A KV cache for the sampler that preallocates each layer's keys and values.

transformers' `DynamicCache` grows every layer with `torch.cat` at every decode step, which
copies the whole cache each time (about half the decode time on small models). Here each
full-attention layer owns a buffer with room for the chunk's longest possible sequence
(prompt width + max_tokens); `update` writes the new positions into it and hands the model a
view of the filled part. The model therefore sees exactly what a `DynamicCache` would give
it (same shapes, same attention mask, same positions), so no `cache_position` or
static-mask handling is needed and any model that works with `DynamicCache` works here.

Layers of other kinds (sliding-window, linear-attention, ...) keep transformers' own layer
classes. On transformers < 4.56, whose `DynamicCache` has no per-layer objects, plain
`DynamicCache` is used.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig

try:
    from transformers.cache_utils import DynamicLayer
except ImportError:  # transformers < 4.56
    DynamicLayer = None  # type: ignore[assignment,misc]


def preallocated_cache(config: PretrainedConfig, capacity: int) -> DynamicCache:
    """A `DynamicCache` whose full-attention layers hold up to `capacity` positions without copying."""
    cache = DynamicCache(config=config)
    layers = getattr(cache, "layers", None)
    if DynamicLayer is None or not layers:
        return cache
    for i, layer in enumerate(layers):
        # Exact type: subclasses (sliding window, indexed, ...) have their own update rules.
        if type(layer) is DynamicLayer:
            layers[i] = PreallocatedLayer(capacity)
    return cache


if DynamicLayer is not None:

    class PreallocatedLayer(DynamicLayer):  # type: ignore[valid-type,misc]
        """Keys/values in a `[batch, heads, capacity, head_dim]` buffer; `keys`/`values` view its filled part."""

        def __init__(self, capacity: int):
            super().__init__()
            self.capacity = capacity
            self.length = 0
            self._k: torch.Tensor | None = None
            self._v: torch.Tensor | None = None

        def _allocate(self, like_k: torch.Tensor, like_v: torch.Tensor, batch: int) -> None:
            # Uninitialised memory is fine: only positions < self.length are ever viewed.
            self._k = like_k.new_empty(batch, like_k.shape[1], self.capacity, like_k.shape[-1])
            self._v = like_v.new_empty(batch, like_v.shape[1], self.capacity, like_v.shape[-1])

        def _refresh_views(self) -> None:
            assert self._k is not None and self._v is not None
            self.keys = self._k[:, :, : self.length]
            self.values = self._v[:, :, : self.length]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self._allocate(key_states, value_states, key_states.shape[0])
            assert self._k is not None and self._v is not None
            end = self.length + key_states.shape[-2]
            if end > self.capacity:
                raise RuntimeError(f"KV cache full: {end} positions > capacity {self.capacity}")
            self._k[:, :, self.length : end] = key_states
            self._v[:, :, self.length : end] = value_states
            self.length = end
            self._refresh_views()
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self._k is None or self._v is None:
                return
            old_k, old_v, batch = self._k, self._v, self._k.shape[0]
            self._allocate(old_k, old_v, batch * repeats)
            # Broadcast copy of the filled part only, straight into the new buffer.
            for new, old in ((self._k, old_k), (self._v, old_v)):
                new.view(batch, repeats, *new.shape[1:])[:, :, :, : self.length] = old[:, None, :, : self.length]
            self._refresh_views()

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            """Keep rows `indices`: gather their filled part into a fresh, smaller buffer (one copy)."""
            if self._k is None or self._v is None:
                return
            old_k, old_v = self._k, self._v
            self._allocate(old_k, old_v, indices.shape[0])
            for new, old in ((self._k, old_k), (self._v, old_v)):
                torch.index_select(old[:, :, : self.length], 0, indices, out=new[:, :, : self.length])
            self._refresh_views()

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:
                raise ValueError("crop takes a negative number of tokens to remove")
            self.length = max(0, self.length + tokens_to_remove)
            if self._k is not None:
                self._refresh_views()

        def reset(self) -> None:
            self.length = 0
            self._k = self._v = None
            super().reset()
