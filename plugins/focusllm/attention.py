"""focusllm's attention stage (``topk``): each decoder query reads its best-scoring candidates only."""

from __future__ import annotations

import torch

from lcx.masking import visible_mask


def topk_keep(query: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """Which candidates each query reads: queries (..., Hkv, G, T, D) grouped by KV head, the candidates'
    keys (..., Hkv, n, D); True at each query's ``k`` highest q.k, (..., Hkv, G, T, n).  lcx's attention
    (``candidate_topk_mask``) and the served one (``served.topk_sdpa``) both cut with it."""
    # float32: bf16 scores would tie and reorder near-equal candidates (and a bf16 bmm of these strided views is slow)
    *lead, G, T, D = query.shape  # a KV head's G x T queries as rows: no copy of its candidates per query head
    scores = (query.float().reshape(*lead, G * T, D) @ candidates.float().transpose(-1, -2)).unflatten(-2, (G, T))
    keep = torch.zeros(scores.shape, dtype=torch.bool, device=query.device)
    return keep.scatter_(-1, scores.topk(k, dim=-1).indices, True)


def candidate_topk_mask(query: torch.Tensor, key: torch.Tensor, n: int, k: int, attention_mask: torch.Tensor | None,
                        base_impl: str) -> torch.Tensor:
    """The base attention's mask (causal over the ``S`` keys, the queries the last ``T``) with each query
    head's candidate columns (key slots ``0..n-1``) cut to its ``k`` highest ``q.k`` scores.  (B, Hq, T, S),
    bool for sdpa, additive for eager, as the base mask."""
    B, Hq, T, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    keep = topk_keep(query.reshape(B, Hkv, Hq // Hkv, T, D), key[:, :, :n], k).reshape(B, Hq, T, n)
    base = visible_mask(attention_mask, [(0, S)], S, T, base_impl, query.dtype, query.device)
    mask = base.expand(B, Hq, T, S).clone()
    if mask.dtype == torch.bool:
        mask[..., :n] &= keep
    else:
        mask[..., :n] = mask[..., :n].masked_fill(~keep, torch.finfo(mask.dtype).min)
    return mask
