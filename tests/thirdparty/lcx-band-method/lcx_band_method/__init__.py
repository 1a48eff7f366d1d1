"""band: every query reads the last ``width`` tokens only (itself included), on lcx's path and served by vLLM."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import lcx


def band(queries: torch.Tensor, keys: torch.Tensor, width: int) -> torch.Tensor:
    """(n, S) bool: query at position ``queries[i]`` may read the key at ``keys[j]``."""
    gap = queries[:, None] - keys[None, :]
    return (gap >= 0) & (gap < width)


@dataclass
class Band(lcx.Method):
    name = "band"
    description = "sliding window: each query reads the last `width` tokens (third-party test method)"
    requires = frozenset({"attention_interface"})
    serving = "attention"

    width: int = lcx.option(256, "tokens each query reads, itself included")

    def served_attention(self) -> type:
        from lcx_band_method.served import BandServed

        return BandServed

    @lcx.hookimpl
    def lcx_attention(self, run, module, query, key, value, attention_mask, kwargs):
        T, S = query.shape[-2], key.shape[-2]  # batch 1 without padding: the keys are positions [0, S)
        allowed = band(torch.arange(S - T, S, device=query.device), torch.arange(S, device=query.device), self.width)
        if attention_mask is None:
            mask = allowed[None, None]
        elif attention_mask.dtype == torch.bool:
            mask = attention_mask[..., :S] & allowed
        else:
            mask = attention_mask[..., :S].masked_fill(~allowed, torch.finfo(attention_mask.dtype).min)
        return run.base_attention(module, query, key, value, mask, **kwargs)


class _Plugin:
    @lcx.hookimpl
    def lcx_register_methods(self, register):
        register(Band)


plugin = _Plugin()
