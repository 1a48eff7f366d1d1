"""FoT memory attention: local causal keys + top-k memory keys under one softmax.

For each query the memory keys live at "position 0" (un-rotated); the query is
re-rotated to the distance the positions mode assigns to memory:

    first   distance = query position - first local position   (LongLLaMA)
    fixed   distance = a constant d for every memory key         (InfLLM-style)
    none    no rotation on either side

so that score(q, k_mem) = q_rel . k0 reproduces RoPE at that distance
(R(a)^T R(b) = R(b - a)).  The kNN search runs with the same re-rotated query,
so retrieval and attention agree.  Queries are processed in blocks to bound memory.
"""

from __future__ import annotations

import torch

from lcx.adapters.rotary import rotate
from lcx.memory import MemoryStore


def memory_attention(
    query: torch.Tensor,  # (B, H, T, D) rotated at absolute positions
    key: torch.Tensor,  # (B, Hkv, S, D) local keys
    value: torch.Tensor,  # (B, Hkv, S, Dv)
    mask: torch.Tensor,  # additive (B|1, 1, T, S)
    memory: dict[tuple[int, int], MemoryStore],  # (row, kv head) -> store of un-rotated keys
    q_shift: torch.Tensor,  # (B, T) rotation that takes each query to its memory-relative position
    inv_freq: torch.Tensor | None,
    scaling: float,
    k: int,
    dense: bool,
    block: int,
) -> torch.Tensor:
    B, H, T, D = query.shape
    Hkv = key.shape[1]
    G = H // Hkv  # query heads per KV head
    q_rel = rotate(query, q_shift[:, None, :], inv_freq) if inv_freq is not None else query
    out = torch.empty(B, T, H, value.shape[-1], dtype=query.dtype, device=query.device)
    for b in range(B):
        m = mask[b if mask.shape[0] > 1 else 0, 0]  # (T, S)
        for h in range(Hkv):
            heads = slice(h * G, (h + 1) * G)
            store = memory[(b, h)]
            kl, vl = key[b, h].float(), value[b, h].float()  # (S, D), (S, Dv)
            for s in range(0, T, block):
                e = min(s + block, T)
                q = query[b, heads, s:e].float()  # (G, c, D)
                local = (q @ kl.T) * scaling + m[s:e]  # (G, c, S)
                qm = q_rel[b, heads, s:e].float().reshape(-1, D)  # (G*c, D)
                if len(store) == 0:
                    probs = local.softmax(-1)
                    out[b, s:e, heads] = (probs @ vl).transpose(0, 1).to(out.dtype)
                    continue
                if dense:
                    mk, mv = store.keys, store.values.float()  # (M, D), (M, Dv)
                    mem = (qm @ mk.T) * scaling  # (G*c, M)
                    joint = torch.cat([local.reshape(-1, local.shape[-1]), mem], dim=-1).softmax(-1)
                    pl, pm = joint[:, : local.shape[-1]], joint[:, local.shape[-1]:]
                    o = pl @ vl + pm @ mv  # (G*c, Dv)
                else:
                    scores, idx = store.search(qm, k)  # (G*c, k'): every backend returns exact inner products
                    mem = scores.to(local.device) * scaling
                    mv = store.values[idx].float()  # (G*c, k', Dv)
                    joint = torch.cat([local.reshape(-1, local.shape[-1]), mem], dim=-1).softmax(-1)
                    pl, pm = joint[:, : local.shape[-1]], joint[:, local.shape[-1]:]
                    o = pl @ vl + torch.bmm(pm[:, None, :], mv)[:, 0]
                out[b, s:e, heads] = o.view(G, e - s, -1).transpose(0, 1).to(out.dtype)
    return out
