"""FoT crossbatch training (Tworkowski et al. 2023, section 3): the sampling stage's layout and the
memory layers' differentiable attention to earlier contexts of the same and of other documents.

Layout.  A training batch is ``(B, (w + 1) * L)``: row ``a`` holds ``w + 1`` consecutive contexts
(``L = local`` tokens each) of one document, and the next step continues the same document in the
same row (the trainer's ``streams`` data order).  Positions restart at 0 in every context, as
LongLLaMA does, so memory keys "as if at position 0" (positions=first) sit at the local window's start.

Attention.  Every layer attends causally within the query's own context.  A memory layer also sees,
under the same softmax, a set of earlier contexts of the batch (fully visible, keys re-encoded per the
positions mode, values as they are):

* positives: the ``p_j`` contexts just before context ``j`` of its own row;
* negatives: ``n_j`` contexts of other documents, taken from the rows before it (row ``a - 1`` at
  context ``j - 1, j - 2, ..., 0``, then row ``a - 2`` ...), from at most ``d - 1`` other documents.

Only rows before ``a`` are ever read (LongLLaMA caps its cross-batch range the same way), so nothing
flows from later rows; the first rows of a batch therefore see fewer negatives.  By default
``(p_j, n_j) = (j, (d - 1) * j)``: all earlier contexts of the document, and the same contexts of
``d - 1`` other documents.  ``segments`` sets them per context position instead, e.g. LongLLaMA's
``0:0,1:1,2:1,3:0``.

Bank (``bank`` > 0, not in FoT): the keys (at position 0) and values of the last ``bank`` contexts of
earlier training forwards, kept per memory layer without gradient; every query also attends to its
``bank_k`` best bank entries, searched as kNN retrieval searches at inference: a memory as large as
long-document inference fills, at the cost of a search rather than of more rows, and the entries that
outscore the right one there are the ones training pushes down.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lcx.adapters.rotary import rotate
from lcx.errors import LcxError


@dataclass(frozen=True)
class Layout:
    """One step's crossbatch layout: contexts per row, their length, and who sees what."""

    local: int  # L: tokens per context
    contexts: int  # w + 1 contexts per row
    d: int  # documents visible to a memory layer (its own + d - 1 others)
    segments: tuple[tuple[int, int], ...]  # (positives, negatives) per context position

    def sources(self, row: int, j: int) -> list[tuple[int, int, bool]]:
        """Earlier contexts (row, context, is_positive) that context ``j`` of ``row`` attends to."""
        p, n = self.segments[j]
        out = [(row, c, True) for c in range(j - 1, j - 1 - p, -1)]
        for other in range(row - 1, max(row - self.d, -1), -1):  # at most d - 1 earlier rows
            for c in range(j - 1, -1, -1):
                if n <= 0:
                    return out
                out.append((other, c, False))
                n -= 1
        return out


def parse_segments(spec: str, contexts: int, most_d: int | None = None) -> tuple[tuple[int, int], ...] | None:
    """``"0:0,1:1,2:1,3:0"`` -> ((0, 0), (1, 1), (2, 1), (3, 0)); empty -> None (the default rule).  With
    ``most_d`` (the largest d the run reaches), context j may ask for at most (most_d - 1) x j negatives: the
    earlier contexts of the other documents its memory sees (more were silently not there)."""
    spec = spec.strip()
    if not spec:
        return None
    try:
        segs = tuple((int(a), int(b)) for a, b in (part.split(":") for part in spec.split(",")))
    except ValueError:
        raise LcxError(f"segments={spec!r}: give POSITIVES:NEGATIVES per context, e.g. 0:0,1:1,2:1,3:0") from None
    if len(segs) != contexts:
        raise LcxError(f"segments={spec!r} has {len(segs)} entries but rows hold {contexts} contexts (w + 1); "
                       f"give one POSITIVES:NEGATIVES pair per context")
    for j, (p, n) in enumerate(segs):
        if not 0 <= p <= j or n < 0:
            raise LcxError(f"segments={spec!r}: context {j} can have 0..{j} positives (earlier contexts of its "
                           f"document) and >= 0 negatives, got {p}:{n}")
        if most_d is not None and n > (most_d - 1) * j:
            raise LcxError(f"segments={spec!r}: context {j} asks for {n} negatives, but with d={most_d} (documents a "
                           f"memory layer sees, at most) only {(most_d - 1) * j} earlier contexts of other documents "
                           f"exist; raise -o d (or the d_schedule's) or ask for fewer")
    return segs


def layout(local: int, w: int, d: int, segments: str = "", most_d: int | None = None) -> Layout:
    """One step's layout at d; ``most_d`` (the largest d of the run) checks what ``segments`` asks for (a step
    at a smaller d, before a d_schedule switches, gives the negatives it has)."""
    if w < 0:
        raise LcxError(f"w (previous contexts per document) must be >= 0, got {w}")
    if d < 1:
        raise LcxError(f"d (documents a memory layer sees) must be >= 1, got {d}")
    segs = parse_segments(segments, w + 1, most_d) or tuple((j, (d - 1) * j) for j in range(w + 1))
    return Layout(local, w + 1, d, segs)


def parse_d_schedule(schedule: str) -> tuple[str, tuple]:
    """``schedule`` parsed whole, each d checked: (kind, fields).  A field read only at the step that
    switches (``step:3:0``, ``acc:0.9:``) failed there, thousands of steps into a run."""
    kind, _, rest = schedule.partition(":")
    ds: tuple[int, ...] = ()
    try:
        if kind == "constant" and not rest:
            return kind, ()
        if kind == "step":
            n, target = rest.split(":")
            fields: tuple = (int(n), int(target))
            ds = (fields[1],)
        elif kind == "acc":
            a, target, *window = rest.split(":")
            fields = (float(a), int(target), int(window[0]) if window else 10)
            if fields[2] < 1 or len(window) > 1:
                raise ValueError
            ds = (fields[1],)
        elif kind == "choice":
            fields = ds = tuple(int(x) for x in rest.split(","))
        else:
            raise ValueError
    except ValueError:
        raise LcxError(f"d_schedule={schedule!r}: use constant, step:N:D (D from step N), acc:A:D[:N] (D once the "
                       f"training accuracy over the last N steps, default 10, is >= A) or choice:D1,D2,... (one "
                       f"per step)") from None
    if min(ds) < 1:
        raise LcxError(f"d_schedule={schedule!r}: d (documents a memory layer sees) must be >= 1, got {min(ds)}")
    return kind, fields


def most_d(schedule: str, d: int) -> int:
    """The largest d a run under ``schedule`` reaches."""
    kind, fields = parse_d_schedule(schedule)
    return max(d, fields[1] if kind in ("step", "acc") else max(fields) if kind == "choice" else d)


def d_for_step(schedule: str, d: int, step: int, seed: int, accuracy: list[float] | None,
               switched: bool) -> tuple[int, bool]:
    """The d of one training step under a schedule; returns (d, switched).

    ``constant`` d every step; ``step:N:D`` D from step N on; ``acc:A:D[:N]`` D once the training
    accuracy averaged over the last N steps (default 10; ``accuracy`` is the per-step history)
    reached A, and for good (the paper: d=1 until 98%, then 128); ``choice:D1,D2,...`` one of them
    per step (seeded).
    """
    kind, fields = parse_d_schedule(schedule)
    if kind == "step":
        return (fields[1], True) if step >= fields[0] else (d, False)
    if kind == "acc":
        a, target, n = fields
        recent = (accuracy or [])[-n:]
        if switched or (len(recent) == n and sum(recent) / n >= a):
            return target, True
        return d, False
    if kind == "choice":
        return random.Random(seed * 1_000_003 + step).choice(fields), False
    return d, False


def chunk_positions(batch: int, layout_: Layout, device: torch.device | None = None) -> torch.Tensor:
    """Position ids (B, (w + 1) * L): 0..L-1 in every context."""
    return torch.arange(layout_.local, device=device).repeat(layout_.contexts)[None].expand(batch, -1).contiguous()


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def local_attention(query, key, value, lay: Layout, scaling: float) -> torch.Tensor:
    """Causal attention inside each context only.  In (B, H, T, D); out (B, T, H, D)."""
    B, H, T, D = query.shape
    k, L = lay.contexts, lay.local
    q = query.view(B, H, k, L, D).transpose(1, 2).reshape(B * k, H, L, D)
    kk = _expand_kv(key, H // key.shape[1]).view(B, H, k, L, D).transpose(1, 2).reshape(B * k, H, L, D)
    vv = _expand_kv(value, H // value.shape[1])
    vv = vv.view(B, H, k, L, -1).transpose(1, 2).reshape(B * k, H, L, vv.shape[-1])
    out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, scale=scaling)  # (B*k, H, L, Dv)
    return out.view(B, k, H, L, -1).permute(0, 1, 3, 2, 4).reshape(B, T, H, -1)


def at_position_zero(kc: torch.Tensor, inv_freq: torch.Tensor | None) -> torch.Tensor:
    """Context keys (..., L, D) rotated at their in-context positions 0..L-1 -> as if at position 0."""
    if inv_freq is None:
        return kc
    return rotate(kc, -torch.arange(kc.shape[-2], device=kc.device), inv_freq)


def bank_update(bank: tuple[torch.Tensor, torch.Tensor] | None, key: torch.Tensor, value: torch.Tensor, lay: Layout,
                inv_freq: torch.Tensor | None, contexts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bank after a forward of ``key``/``value`` (B, Hkv, T, D): its newest ``contexts`` contexts, keys at
    position 0 and values, (Hkv, contexts * L, D) each, detached; the forward's own contexts last, row by row."""
    B, Hkv, _, D = key.shape
    kc = key.detach().to(torch.float32).view(B, Hkv, lay.contexts, lay.local, D)
    k0 = at_position_zero(kc, inv_freq).transpose(0, 1).reshape(Hkv, -1, D)
    v = value.detach().to(torch.float32).transpose(0, 1).reshape(Hkv, -1, value.shape[-1])
    if bank is not None:
        k0, v = torch.cat([bank[0], k0], 1), torch.cat([bank[1], v], 1)
    keep = contexts * lay.local
    return k0[:, -keep:].contiguous(), v[:, -keep:].contiguous()


def _bank_read(q: torch.Tensor, bank: tuple[torch.Tensor, torch.Tensor], k: int,
               scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's top-``k`` bank entries, searched without gradient as kNN retrieval does at inference:
    q (P, Hkv, G, L, D); bank keys/values (Hkv, M, D).  Returns their values (P, Hkv, G, L, k, D) and
    scaled scores (P, Hkv, G, L, k), differentiable in q."""
    bk, bv = bank[0].to(q.device), bank[1].to(q.device)
    k = min(k, bk.shape[1])
    with torch.no_grad():  # one pair at a time: (Hkv, G, L, M) scores, not (P, ...)
        idx = torch.stack([torch.einsum("hgqd,hmd->hgqm", q[i], bk).topk(k, dim=-1).indices for i in range(q.shape[0])])
    head = torch.arange(bk.shape[0], device=q.device).view(1, -1, 1, 1, 1)
    return bv[head, idx], torch.einsum("phgqd,phgqkd->phgqk", q, bk[head, idx]) * scaling  # (P, Hkv, G, L, k, D)


def memory_attention(query, key, value, lay: Layout, inv_freq: torch.Tensor | None, positions: str,
                     fixed_distance: int, scaling: float, probe: list | None = None, topk: int = 0,
                     bank: tuple[torch.Tensor, torch.Tensor] | None = None, bank_k: int = 32) -> torch.Tensor:
    """A memory layer under crossbatch: own context (causal) + earlier contexts, one softmax.

    query (B, H, T, D) and key (B, Hkv, T, D) arrive rotated at their in-context positions
    0..L-1.  Memory keys are un-rotated to position 0 and the query re-rotated to the distance the
    positions mode gives memory (first: its own position, fixed: ``fixed_distance``, none: 0).
    ``probe`` (a list) receives per-context attention masses on positives / all memory, for
    ``lcx analyze distraction``.  ``topk`` > 0: each query attends to its ``topk`` best-scoring memory keys
    only (what kNN retrieval hands it at inference), the others masked before the softmax; 0: all of them
    (FoT's dense crossbatch).  ``bank``: keys at position 0 and values (Hkv, M, D) of earlier forwards
    (``bank_update``); each query of every context also attends to its ``bank_k`` best-scoring bank
    entries (searched without gradient), under the same softmax.  Out (B, T, H, Dv).
    """
    B, H, T, D = query.shape
    Hkv = key.shape[1]
    G = H // Hkv
    k, L = lay.contexts, lay.local
    dt = torch.float32
    q = query.to(dt).view(B, Hkv, G, k, L, D)
    kc = key.to(dt).view(B, Hkv, k, L, D)
    vc = value.to(dt).view(B, Hkv, k, L, -1)
    # local: causal inside the context
    local = torch.einsum("bhgcqd,bhckd->bhgcqk", q, kc) * scaling
    causal = torch.ones(L, L, dtype=torch.bool, device=query.device).tril()
    local = local.masked_fill(~causal, float("-inf"))
    # memory keys at "position 0" and the query at the positions mode's distance
    pos = torch.arange(L, device=query.device)
    k0 = at_position_zero(kc, inv_freq)  # (B, Hkv, k, L, D)
    if inv_freq is None or positions == "first":
        q_rel = q
    elif positions == "fixed":
        q_rel = rotate(q, (fixed_distance or L) - pos, inv_freq)
    else:
        q_rel = rotate(q, -pos, inv_freq)
    # (row, context) pairs with the same number of sources are computed as one batch
    dev = query.device
    groups: dict[int, list[tuple[int, int, list]]] = {}
    for a in range(B):
        for j in range(k):
            src = lay.sources(a, j)
            groups.setdefault(len(src), []).append((a, j, src))
    outs, order = [], []
    for n, pairs in groups.items():
        P = len(pairs)
        A = torch.tensor([a for a, _, _ in pairs], device=dev)
        J = torch.tensor([j for _, j, _ in pairs], device=dev)
        lq = local[A, :, :, J]  # (P, Hkv, G, L, L)
        v_own = vc[A, :, J]  # (P, Hkv, L, Dv)
        if n == 0 and bank is None:
            o = torch.einsum("phgqk,phkd->phgqd", lq.softmax(-1), v_own)
        else:
            R = torch.tensor([[r for r, _, _ in src] for _, _, src in pairs], device=dev, dtype=torch.long)  # (P, n)
            C = torch.tensor([[c for _, c, _ in src] for _, _, src in pairs], device=dev, dtype=torch.long)
            mk = k0[R, :, C].permute(0, 2, 1, 3, 4).reshape(P, Hkv, n * L, D)  # (P, Hkv, M, D)
            mv = vc[R, :, C].permute(0, 2, 1, 3, 4).reshape(P, Hkv, n * L, vc.shape[-1])
            qp = q_rel[A, :, :, J]  # (P, Hkv, G, L, D)
            mem = torch.einsum("phgqd,phmd->phgqm", qp, mk) * scaling
            if 0 < topk < mem.shape[-1]:  # per query: its top-k memory keys (ties at the k-th score kept)
                mem = mem.masked_fill(mem < mem.topk(topk, dim=-1).values[..., -1:], float("-inf"))
            parts = [lq, mem]
            if bank is not None:
                bvals, bscore = _bank_read(qp, bank, bank_k, scaling)
                parts.append(bscore)
            probs = torch.cat(parts, dim=-1).softmax(-1)
            M = mem.shape[-1]
            pl, pm = probs[..., :L], probs[..., L:L + M]
            o = torch.einsum("phgqk,phkd->phgqd", pl, v_own) + torch.einsum("phgqm,phmd->phgqd", pm, mv)
            if bank is not None:
                o = o + torch.einsum("phgqk,phgqkd->phgqd", probs[..., L + M:], bvals)
            if probe is not None:
                for i, (a, j, src) in enumerate(pairs):
                    positive = torch.tensor([p for _, _, p in src], device=dev, dtype=torch.bool).repeat_interleave(L)
                    probe.append({"row": a, "context": j, "positives": sum(p for _, _, p in src),
                                  "negatives": sum(not p for _, _, p in src),
                                  "mass_positive": pm[i][..., positive].sum(-1).detach(),  # (Hkv, G, L)
                                  "mass_memory": probs[i][..., L:].sum(-1).detach()})  # the bank's too
        outs.append(o.reshape(P, H, L, -1).transpose(1, 2))  # (P, L, H, Dv)
        order += [a * k + j for a, j, _ in pairs]
    out = torch.cat(outs)[torch.tensor(order, device=dev).argsort()]  # (B * k, L, H, Dv) in (row, context) order
    return out.reshape(B, T, H, -1).to(query.dtype)  # (B, T, H, Dv)
