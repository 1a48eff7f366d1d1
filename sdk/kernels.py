"""The attention lcx runs beneath its methods: transformers' ``sdpa``, except one query token on a CPU in bf16/fp16.

torch's CPU ``scaled_dot_product_attention`` takes a slow path for a single bf16 query (a decode step) on CPUs
without AMX; two matrix products with a float32 softmax between them, as transformers' eager attention computes,
are faster there and no slower elsewhere (bench/dtype.py).  Prefill stays on torch's flash kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def takes_short_path(query: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float,
                     kwargs: dict[str, Any]) -> bool:
    """Whether ``sdpa`` below answers by matrix products: one query token, bf16/fp16, on a CPU, and none of the
    extras (a paged cache, a position bias, dropout) that only transformers' sdpa handles."""
    return (query.shape[2] == 1 and query.device.type == "cpu" and query.dtype in _LOW_PRECISION
            and not dropout and kwargs.get("cache") is None and kwargs.get("position_bias") is None
            and (attention_mask is None or attention_mask.shape[-2] == 1))


def short_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
    """(B, 1, H, Dv): one query token's attention over every key, grouped queries read in place (no repeat of
    the keys).  ``attention_mask``: None, bool (True = attend) or additive, (B|1, 1|H, 1, S)."""
    B, H, _, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    G = H // Hkv  # query heads per KV head
    q = query.reshape(B, Hkv, G, D)  # head h * G + g
    scores = torch.matmul(q, key.transpose(-1, -2)).float().mul_(D ** -0.5 if scaling is None else scaling)  # (B, Hkv, G, S)
    if attention_mask is not None:
        m = attention_mask[:, :, 0]  # (B|1, 1|H, S)
        m = m.reshape(m.shape[0], 1, 1, S) if m.shape[1] == 1 else m.reshape(m.shape[0], Hkv, G, S)
        # the lowest finite value, not -inf: a query that sees nothing averages instead of giving NaN (masking.to_additive)
        scores = scores.masked_fill(~m, torch.finfo(scores.dtype).min) if m.dtype == torch.bool else scores + m
    out = torch.matmul(scores.softmax(-1).to(value.dtype), value)  # (B, Hkv, G, Dv)
    return out.reshape(B, 1, H, value.shape[-1])


def sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
         **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention function, with a decode step on a CPU in bf16/fp16 by ``short_query_attention``."""
    if takes_short_path(query, attention_mask, dropout, kwargs):
        return short_query_attention(query, key, value, attention_mask, scaling), None
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
