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
from lcx.plugins.fot.memory import MemoryStore


def memory_attention(
    query: torch.Tensor,  # (B, H, T, D) rotated at absolute positions
    key: torch.Tensor,  # (B, Hkv, S, D) local keys
    value: torch.Tensor,  # (B, Hkv, S, Dv)
    mask: torch.Tensor,  # additive (B|1, 1, T, S)
    memory: dict,  # (row, kv head) -> store of un-rotated keys, or row -> one store of all its KV heads
    q_shift: torch.Tensor,  # (B, T) rotation that takes each query to its memory-relative position
    inv_freq: torch.Tensor | None,
    scaling: float,
    k: int,
    dense: bool,
    block: int,
    gate: float | None = None,
    heads: torch.Tensor | None = None,  # (H,) bool: the query heads that read memory (None: every head)
    gate_keys: torch.Tensor | None = None,  # (B|1, S) bool: the local keys the gate measures against (None: all)
    margins: list | None = None,
) -> torch.Tensor:
    """(B, T, H, Dv): each query head's softmax over its local keys (under ``mask``) joined with its KV head's
    top-``k`` memory keys (``dense``: every memory key; ``gate``: see ``joint_softmax``; a head left out of
    ``heads`` attends to its local keys only).  ``margins``: where given, each row's query blocks append their
    (H, c) gate margins to it (on the CPU): a query head's best memory score minus its best local score (among
    ``gate_keys``), the quantity ``gate`` thresholds (-inf for a head left out of ``heads``).  All KV heads of a row are computed together (the G
    query heads of KV head h are rows g * c + i of a (Hkv, G * c, D) block); the search runs per store, or once
    per row where ``memory[row]`` holds all the row's KV heads (a store with ``search_heads``, as lcx's served
    fot keeps: ``lcx.plugins.fot.served.HeadsStore``)."""
    B, H, T, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    G = H // Hkv  # query heads per KV head
    # float32 like the scores (rotate() answers in its input's dtype): a bf16 query rounded once more after
    # re-rotation would score memory keys less exactly than local ones
    q_rel = rotate(query.float(), q_shift[:, None, :], inv_freq) if inv_freq is not None else query
    out = torch.empty(B, T, H, value.shape[-1], dtype=query.dtype, device=query.device)
    for b in range(B):
        m = mask[b if mask.shape[0] > 1 else 0, 0].expand(T, S)
        empty = not row_entries(memory, b, Hkv)
        kl, vl = key[b].float(), value[b].float()  # (Hkv, S, D), (Hkv, S, Dv)
        for s in range(0, T, block):
            e = min(s + block, T)
            c = e - s
            q = query[b, :, s:e].float().reshape(Hkv, G * c, D)  # row g * c + i: query i of head h * G + g
            local = torch.bmm(q * scaling, kl.transpose(1, 2))  # (Hkv, G*c, S)
            local.view(Hkv, G, c, S).add_(m[s:e])  # the mask broadcast over the G heads, not copied G times
            if empty:
                o = torch.bmm(local.softmax(-1), vl)  # (Hkv, G*c, Dv)
            else:
                qm = q_rel[b, :, s:e].float().reshape(Hkv, G * c, D)
                # (Hkv, G*c, W), values (Hkv, [G*c,] W, Dv); a half-precision model's candidates picked in its dtype
                mem, mv = row_search(memory, b, qm, k, dense, query.dtype)
                if heads is not None:
                    mem = mem.masked_fill(~heads.view(Hkv, G).repeat_interleave(c, 1)[..., None], float("-inf"))
                ref = None if gate_keys is None else gate_keys[b if gate_keys.shape[0] > 1 else 0]
                mem = mem * scaling
                if margins is not None:
                    margins.append((mem.amax(-1, keepdim=True) - best_local(local, ref))[..., 0].view(H, c).cpu())
                # autograd keeps the local scores for amax's backward: spent in place only without it
                o = joint_softmax(local, vl, mem, mv, dense, gate, ref, inplace=not local.requires_grad)
            out[b, s:e] = o.view(H, c, -1).transpose(0, 1).to(out.dtype)
    return out


def joint_softmax(local: torch.Tensor, local_values: torch.Tensor, mem: torch.Tensor, mem_values: torch.Tensor,
                  dense: bool, gate: float | None = None, gate_keys: torch.Tensor | None = None, *,
                  inplace: bool = False) -> torch.Tensor:
    """One softmax over scaled local scores (..., Q, S) and memory scores (..., Q, W) together: the local
    values (..., S, Dv) weighted by the first part plus the memory values by the second, each query's own
    (..., Q, W, Dv), or shared by the queries when ``dense`` (..., W, Dv).  ``gate``: a memory key is read
    only where its score is at least the query's best local score + gate (weak matches are left out), the best
    among the local keys ``gate_keys`` (bool, broadcast to (..., S)) marks where given.  ``inplace``: ``local``
    is overwritten (with its unnormalised weights) instead of copied: for a caller done with its scores."""
    local_top = local.amax(-1, keepdim=True)
    if gate is not None:
        best = local_top if gate_keys is None else best_local(local, gate_keys)
        mem = mem.masked_fill(mem < best + gate, float("-inf"))
    # normalised once after the value products: no joined (Q, S + W) copy of the scores for one softmax
    top = torch.maximum(local_top, mem.amax(-1, keepdim=True)) if mem.shape[-1] else local_top
    pl = (local.sub_(top) if inplace else local - top).exp_()
    pm = (mem - top).exp_()
    mem_out = torch.matmul(pm, mem_values) if dense else (pm[..., None, :] @ mem_values)[..., 0, :]
    return (torch.matmul(pl, local_values) + mem_out).div_(pl.sum(-1, keepdim=True) + pm.sum(-1, keepdim=True))


def best_local(local: torch.Tensor, gate_keys: torch.Tensor | None = None) -> torch.Tensor:
    """Each query's best local score (..., Q, 1), among the keys ``gate_keys`` marks where given: what a gate
    measures memory scores against."""
    return (local if gate_keys is None else local.masked_fill(~gate_keys, float("-inf"))).amax(-1, keepdim=True)


def row_entries(memory: dict, row: int, kv_heads: int) -> int:
    """How many entries the memory of batch row ``row`` holds (its fullest KV head's)."""
    heads = memory.get(row)
    return len(heads) if heads is not None else max(len(memory[(row, h)]) for h in range(kv_heads))


def row_search(memory: dict, row: int, qm: torch.Tensor, k: int, dense: bool,
               select_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``row``'s memory searched with queries qm (Hkv, Q, D), each KV head's against its own keys:
    ``_memory_scores``'s answer, from one store per KV head or from one holding them all (``search_heads``)."""
    heads = memory.get(row)
    if heads is not None:
        return heads.search_heads(qm, k, dense, select_dtype)
    return _memory_scores(qm, [memory[(row, h)] for h in range(qm.shape[0])], k, dense, select_dtype)


def _memory_scores(qm: torch.Tensor, stores: list[MemoryStore], k: int, dense: bool,
                   select_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Unscaled inner products of the queries qm (Hkv, Q, D) with their KV head's memory keys and the keys'
    values: the top ``k`` per query (values (Hkv, Q, W, Dv)), or every key when ``dense`` (values (Hkv, W, Dv)).
    Heads whose stores hold fewer entries are padded to the widest with -inf scores and zero values.
    ``select_dtype``: the precision a store may pick its candidates in (``MemoryStore.search``)."""
    scores, values = [], []
    for h, store in enumerate(stores):
        if not len(store):
            scores.append(qm.new_zeros(qm.shape[1], 0))
            values.append(None)
        elif dense:
            scores.append(qm[h] @ store.keys.to(qm.device).T)  # (Q, M)
            values.append(store.values.float().to(qm.device))  # (M, Dv)
        else:  # a store answers on its own device (FAISS: the CPU)
            sc, idx = store.search(qm[h], k, select_dtype)  # (Q, k'): every backend returns exact inner products
            scores.append(sc.to(qm.device))
            values.append(store.values[idx].float().to(qm.device))  # (Q, k', Dv)
    W = max(x.shape[1] for x in scores)
    like = next(v for v in values if v is not None)
    if all(x.shape[1] == W for x in scores):
        return torch.stack(scores), torch.stack(values)
    mem = qm.new_full((len(stores), qm.shape[1], W), float("-inf"))
    mv = like.new_zeros(len(stores), *like.shape[:-2], W, like.shape[-1])  # kNN: (Hkv, Q, W, Dv); dense: (Hkv, W, Dv)
    for h, (sc, v) in enumerate(zip(scores, values)):
        n = sc.shape[1]
        mem[h, :, :n] = sc
        if v is not None:
            mv[h, ..., :n, :] = v
    return mem, mv
