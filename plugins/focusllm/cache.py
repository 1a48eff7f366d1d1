"""focusllm's caches: the decoder's layer that takes the candidates' keys/values in the placeholders' stead
(the memory stage), and a plain cache built from given keys/values (chunk caches, training)."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from lcx.errors import LcxError


def _kv_cache(config, kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A cache holding the given per-layer (keys, values)."""
    cache = DynamicCache(config=config)
    for layer, (k, v) in enumerate(kvs):
        cache.update(k, v, layer)
    return cache


class CandidateLayer(DynamicLayer):
    """A cache layer whose first update stores the given candidate keys/values instead of the
    placeholders' (the plan's first window), then behaves like an ordinary dynamic layer."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = (keys, values)
        self.candidates = keys.shape[-2]  # the first key slots of every forward through this layer

    def update(self, key_states, value_states, *args, **kwargs):
        if self.pending is not None:
            keys, values = self.pending
            if keys.shape[-2] != key_states.shape[-2]:
                raise LcxError(f"focusllm: {keys.shape[-2]} candidates but {key_states.shape[-2]} placeholder tokens")
            self.pending = None
            key_states, value_states = keys.to(key_states.dtype), values.to(value_states.dtype)
        return super().update(key_states, value_states, *args, **kwargs)
