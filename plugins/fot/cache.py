"""FoT's cache: every layer keeps a local window; memory layers move what leaves it into memory.

Before a forward pass over ``q`` new tokens, a layer holding ``L`` local tokens
evicts the oldest ``L + q - local`` of them (a sliding-window layer without memory:
every key older than its window).  In a memory layer, evicted keys are
un-rotated to "position 0" (R(-p) k, so a positions mode can place them later)
and added, with their values, absolute positions and document id, to one
``MemoryStore`` per (batch row, KV head).  Left padding never enters memory.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers.cache_utils import Cache

from lcx.adapters.rotary import rotate
from lcx.masking import SubsetCacheLayer
from lcx.plugins.fot.memory import MemoryStore


class FoTLayer(SubsetCacheLayer):
    def __init__(self, local: int, memory: dict[tuple[int, int], MemoryStore] | None,
                 inv_freq: torch.Tensor | None, pad: torch.Tensor, doc_ids: list[int], sinks: int = 0,
                 band: int | None = None) -> None:
        super().__init__()
        self.local, self.memory, self.inv_freq, self.sinks = local, memory, inv_freq, sinks
        # a sliding-window layer's queries see themselves and the band - 1 keys before: older ones would be masked out
        self.band = band if memory is None else None
        self.pad = pad  # (B,) left-padding per row: RoPE position = cache index - pad
        self.doc_ids = doc_ids
        self.local_start = 0  # absolute cache index of the first non-sink key returned by the last update
        self.held_sinks = 0  # sink keys (cache indices 0..held_sinks-1) returned before the local ones

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self.sink_k, self.sink_v = self.keys, self.values
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        L, q = self.keys.shape[-2], key_states.shape[-2]
        overflow = min(L, L + q - self.local) if L + q > self.local else 0
        if self.band is not None:
            overflow = max(overflow, L - (self.band - 1))
        start = self.cumulative_length - L  # cache index of the oldest local key
        if overflow:
            keep = max(0, min(overflow, self.sinks - start))  # the prompt's first tokens stay: attention sinks
            if keep:
                self.sink_k = torch.cat([self.sink_k, self.keys[:, :, :keep]], dim=-2)
                self.sink_v = torch.cat([self.sink_v, self.values[:, :, :keep]], dim=-2)
            if self.memory is not None and overflow > keep:
                self._to_memory(self.keys[:, :, keep:overflow], self.values[:, :, keep:overflow], start + keep)
            self.keys, self.values = self.keys[:, :, overflow:], self.values[:, :, overflow:]
            start += overflow
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.cumulative_length += q
        self.local_start = start
        self.held_sinks = ns = self.sink_k.shape[-2]
        if not ns:
            return self.keys, self.values
        # sinks re-rotated to sit right before the local keys: every query-key distance stays within local + sinks
        sink_k = rotate(self.sink_k, start - ns, self.inv_freq) if start > ns else self.sink_k
        return torch.cat([sink_k, self.keys], dim=-2), torch.cat([self.sink_v, self.values], dim=-2)

    def kept(self) -> list[tuple[int, int]]:
        """Cache indices of the keys the last update returned, in order, as (start, stop) runs."""
        return [(0, self.held_sinks), (self.local_start, self.cumulative_length)]

    @torch.no_grad()
    def _to_memory(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        B, n = keys.shape[0], keys.shape[2]
        index = torch.arange(start, start + n)
        for b in range(B):
            pos = index - int(self.pad[b])  # RoPE positions of this row
            real = pos >= 0  # left padding stays out of memory
            if not real.any():
                continue
            on = real.to(keys.device)
            add_to_memory(self.memory, b, keys[b][:, on], values[b][:, on], pos[real], self.inv_freq, self.doc_ids[b])

    def _reset_state(self) -> None:
        self.local_start = self.held_sinks = 0


def add_to_memory(memory: dict[tuple[int, int], MemoryStore], row: int, keys: torch.Tensor, values: torch.Tensor,
                  positions: torch.Tensor, inv_freq: torch.Tensor, doc_id: int) -> None:
    """Keys (H, n, D) of one batch row, rotated at RoPE ``positions``, un-rotated to "position 0" and added
    with their values to ``memory[(row, h)]`` per KV head, or to ``memory[row]`` when one store holds all
    the row's heads (``memory_attention`` reads either)."""
    k0 = rotate(keys.float(), -positions, inv_freq)  # float32, as stores keep keys: no second bf16 rounding
    heads = memory.get(row)
    if heads is not None:
        heads.add(k0, values)
        return
    for h in range(keys.shape[0]):
        memory[(row, h)].add(k0[h], values[h], positions, doc_id)


def fot_cache(n_layers: int, memory_layers: list[int], local: int, batch_size: int, kv_heads: int,
              make_store: Callable[[], MemoryStore], inv_freq: Callable[[int], torch.Tensor], pad: torch.Tensor,
              doc_ids: list[int], stores: dict[int, dict[tuple[int, int], MemoryStore]] | None = None,
              sinks: int = 0, bands: list[int | None] | None = None) -> Cache:
    """A Cache with a local window per layer (plus its first ``sinks`` tokens) and memory stores for
    ``memory_layers``.

    ``stores`` (layer -> {(row, head): store}) reuses existing memories (multi-document mode).  ``bands``: per
    layer, the sliding window of a sliding-window layer (None: a full-attention one); such a layer without
    memory keeps no more than its window of past keys.
    """
    stores = stores if stores is not None else {}
    layers: list[Any] = []
    for i in range(n_layers):
        mem = None
        if i in memory_layers:
            mem = stores.setdefault(i, {})
            for b in range(batch_size):
                for h in range(kv_heads):
                    mem.setdefault((b, h), make_store())
        layers.append(FoTLayer(local, mem, inv_freq(i) if mem is not None or sinks else None, pad, doc_ids, sinks,
                               bands[i] if bands else None))
    cache = Cache(layers=layers)
    cache.lcx_stores = stores  # type: ignore[attr-defined]
    return cache
