"""focusllm's candidates: each memory chunk read with the local tokens' fragment, its last position kept.

``chunk_spans`` cuts the memory into chunks; ``candidate_kv`` decodes them (equal lengths batched) into one
candidate each, optionally keeping every chunk's cache; ``refresh_candidates`` feeds generated tokens to those
caches; ``fresh_candidates`` gives training the candidate sets that exact refresh gives; ``to_slots`` re-rotates
candidates from their chunk positions to the decoder's slots 0..n-1.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from lcx.adapters import families
from lcx.adapters.rotary import rotate
from lcx.plugins.focusllm.cache import _kv_cache


# ---------------------------------------------------------------------- chunking
def chunk_spans(memory: int, chunk: int, overlap: int = 0) -> list[tuple[int, int]]:
    """``[start, end)`` of each memory chunk: ``chunk`` new tokens (the last chunk possibly fewer), each chunk
    but the first also reading the ``overlap`` tokens before them (the end of the chunk before)."""
    return [(max(0, s - overlap), min(s + chunk, memory)) for s in range(0, memory, chunk)]


# ---------------------------------------------------------------------- candidates
@dataclass
class ChunkGroup:
    """Chunks of equal length decoded as one batch (rows chunk-major: chunk ``idx[j]`` is rows j*B..(j+1)*B),
    with their cache when generation refreshes candidates."""

    idx: list[int]
    length: int  # tokens in each row's cache (chunk + fragment + generated tokens fed so far)
    cache: Any = None


def _forward_group(model, group: ChunkGroup, ids: torch.Tensor, cache, gate, keep: bool,
                   grad: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Feed ``ids`` (rows, m) after ``cache``; returns per layer the last position's (keys, values)
    computed with the candidate projections (gate open there).  With ``keep``, the cache ends up holding
    the base projections of all m tokens (a second, ungated pass over the last token when gated).

    With a gate, the first m-1 tokens go through the base weights without autograd and only the last
    one (the candidate) through the adapter: attention is causal, so that equals one pass with the gate
    open at the last position, and with ``grad`` (training) the graph holds one token per chunk."""
    L = cache.get_seq_length() if cache is not None else 0
    pos = torch.arange(L, L + ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
    if gate is None:
        with torch.set_grad_enabled(grad):
            cache = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1).past_key_values
    else:
        if ids.shape[1] > 1:
            with torch.no_grad(), gate.only(torch.zeros_like(ids[:, :-1], dtype=torch.float32)):
                cache = model(input_ids=ids[:, :-1], position_ids=pos[:, :-1], past_key_values=cache, use_cache=True,
                              logits_to_keep=1).past_key_values
        with torch.set_grad_enabled(grad), gate.only(torch.ones_like(ids[:, -1:], dtype=torch.float32)):
            cache = model(input_ids=ids[:, -1:], position_ids=pos[:, -1:], past_key_values=cache, use_cache=True,
                          logits_to_keep=1).past_key_values
    last = [(layer.keys[:, :, -1:], layer.values[:, :, -1:]) for layer in cache.layers]
    if not grad:
        last = [(k.clone(), v.clone()) for k, v in last]
    if keep and gate is not None:  # the cache keeps the newest token with the base weights
        cache.crop(-1)  # drop the newest token (transformers 5.18+: a negative count, not a length)
        with torch.no_grad(), gate.only(torch.zeros_like(ids[:, -1:], dtype=torch.float32)):
            model(input_ids=ids[:, -1:], position_ids=pos[:, -1:], past_key_values=cache, use_cache=True, logits_to_keep=1)
    group.cache = cache if keep else None
    group.length = L + ids.shape[1]
    return last


def candidate_positions(spans: list[tuple[int, int]], fragment: int) -> torch.Tensor:
    """Where each chunk's candidate sits in its own [chunk ; fragment] forward: the last position (its keys
    are rotated there; ``to_slots`` moves them)."""
    return torch.tensor([e - s + fragment - 1 for s, e in spans], dtype=torch.long)


def _chunk_groups(spans: list[tuple[int, int]], parallel: int, only: list[int] | None = None) -> list[ChunkGroup]:
    """Chunks of equal length, ``parallel`` at a time (0 = all), as the groups decoded in one batch (of the
    chunks ``only`` names, when given)."""
    by_length: dict[int, list[int]] = {}
    for i in range(len(spans)) if only is None else only:
        s, e = spans[i]
        by_length.setdefault(e - s, []).append(i)
    step = parallel or len(spans)
    return [ChunkGroup(members[g:g + step], 0) for members in by_length.values() for g in range(0, len(members), step)]


def _group_rows(memory_ids: torch.Tensor, spans: list[tuple[int, int]], group: ChunkGroup, tail: torch.Tensor) -> torch.Tensor:
    """The group's rows, chunk-major: [chunk ; tail] for each of its chunks."""
    return torch.cat([torch.cat([memory_ids[:, spans[i][0]:spans[i][1]], tail], dim=1) for i in group.idx])


@dataclass
class _MemoChunk:
    last: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, the candidate's (keys, values) (1, H_kv, 1, D)
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None  # per layer, the chunk's kept cache (1, H_kv, L, D)
    length: int


class ChunkMemo:
    """The chunks of the last prompt, by their [chunk ; fragment] tokens: a later prompt's chunk with the same
    tokens takes its candidate (and kept cache) instead of a forward.  In a passkey grid every prompt of a
    length has the same filler chunks and fragment (the needle's chunks differ), so a 128K prompt after the
    first runs two chunk forwards instead of 63.  Exact but for float rounding: a chunk decoded in another
    batch (as ``parallel`` already gives).  One prompt's chunks are kept, as views of the tensors they were
    decoded into: DynamicCache appends by concatenation, so refreshing a chunk's cache while generating
    replaces those tensors and never writes into them (tested over three prompts).  With a memo, generation
    refreshes each chunk's own copy of its cache (a group per chunk)."""

    def __init__(self) -> None:
        self.chunks: dict[bytes, _MemoChunk] = {}
        self.hits = 0  # chunk forwards saved, over all prompts

    @staticmethod
    def key(ids: torch.Tensor) -> bytes:
        return ids.cpu().numpy().tobytes()

    def misses(self, memory_ids: torch.Tensor, fragment_ids: torch.Tensor, spans: list[tuple[int, int]],
               keep: bool) -> tuple[list[bytes], list[int]]:
        """Each chunk's key, and the chunks a forward must decode: those the memo lacks (with their cache,
        when ``keep``)."""
        keys = [self.key(_group_rows(memory_ids, spans, ChunkGroup([i], 0), fragment_ids)) for i in range(len(spans))]
        return keys, [i for i, k in enumerate(keys) if (hit := self.chunks.get(k)) is None or (keep and hit.kv is None)]


def candidate_kv(model, memory_ids: torch.Tensor, fragment_ids: torch.Tensor, spans: list[tuple[int, int]],
                 parallel: int, gate=None, groups: list[ChunkGroup] | None = None,
                 grad: bool = False, memo: ChunkMemo | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the candidates' (keys, values) of shape (B, H_kv, n_chunks, D), keys rotated at the
    position each candidate had in its own [chunk ; fragment] forward (its last position).

    ``memory_ids`` (B, M), ``fragment_ids`` (B, F), ``spans`` the chunks (``chunk_spans``).  Chunks of equal length are batched ``parallel`` at
    a time (0 = all); ``gate`` (a ``TokenGate``) opens the candidate adapter at the last position only.
    Pass a list as ``groups`` to keep every chunk's cache in it (for ``refresh_candidates``); with
    ``grad`` (training) the candidates carry autograd through the adapter.  With a ``memo`` (one prompt, no
    ``grad``) chunks the previous prompt had are taken from it, each a group of its own (:class:`ChunkMemo`).
    """
    B = fragment_ids.shape[0]
    keep = groups is not None
    per_chunk: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = [None] * len(spans)
    made: list[ChunkGroup] = []
    todo, keys, kept = None, [], {}
    if memo is not None and B == 1 and not grad:
        keys, todo = memo.misses(memory_ids, fragment_ids, spans, keep)
        missing = set(todo)
        for i, key in enumerate(keys):
            if i in missing:
                continue
            hit = memo.chunks[key]
            per_chunk[i] = hit.last
            kept[key] = hit
            if keep:  # the cache's first update copies these rows; refreshing appends to that copy
                made.append(ChunkGroup([i], hit.length, _kv_cache(model.config, hit.kv)))
        memo.hits += len(spans) - len(todo)
        memo.chunks = dict(kept)  # the chunks this prompt does not share go before its own are decoded
    for group in _chunk_groups(spans, parallel, todo):
        ids = _group_rows(memory_ids, spans, group, fragment_ids)
        _scatter(per_chunk, group, _forward_group(model, group, ids, None, gate, keep=keep, grad=grad), B)
        if not keys:
            made.append(group)
            continue
        for j, i in enumerate(group.idx):
            kv = [(l.keys[j:j + 1], l.values[j:j + 1]) for l in group.cache.layers] if keep else None
            kept[keys[i]] = _MemoChunk(per_chunk[i], kv, group.length)
            if keep:  # refreshed one chunk at a time: the batch's cache stays as the memo holds it, and a refresh
                # copies one chunk's cache, not all of them at once (at long lengths each is gigabytes)
                made.append(ChunkGroup([i], group.length, _kv_cache(model.config, kv)))
    if keys:
        memo.chunks = kept  # this prompt's chunks (the previous prompt's others are let go)
    if groups is not None:
        groups.extend(made)
    return _stack(per_chunk)


def fresh_candidates(model, memory_ids: torch.Tensor, local_ids: torch.Tensor, fragment: int,
                     spans: list[tuple[int, int]], parallel: int, gate=None,
                     grad: bool = False) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Training for exact generation: the candidates that exact refresh gives each of the last N local tokens.

    ``local_ids`` (B, F + N - 1): the fragment (F tokens) then the N - 1 tokens fed after it.  Set j holds,
    per chunk, the candidate of [chunk ; fragment ; the first j tokens after it] -- what ``refresh=1`` puts
    in the decoder's slots before reading token F - 1 + j of ``local_ids`` (set 0: the prompt's).  One base
    pass per chunk over [chunk ; local_ids] (no autograd), then the N candidate positions in one gated
    pass: candidate j attends to the base keys before its position and to itself only, as it would after
    j refreshes.  Returns per layer (keys, values) of shape (B, H_kv, N * n_chunks, D), set-major (set j
    = columns j*n..(j+1)*n-1), keys rotated at each candidate's position in its chunk, and those
    positions (N * n_chunks,)."""
    B, m_local = local_ids.shape
    N = m_local - fragment + 1
    per_chunk: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = [None] * len(spans)
    for group in _chunk_groups(spans, parallel):
        ids = _group_rows(memory_ids, spans, group, local_ids)
        R, m = ids.shape
        pos = torch.arange(m, device=ids.device)[None].expand(R, -1)
        with torch.no_grad(), _gated(gate, torch.zeros(R, m, device=ids.device)):
            cache = model(input_ids=ids, position_ids=pos, past_key_values=DynamicCache(config=model.config),
                          use_cache=True, logits_to_keep=1).past_key_values
        first = m - N  # the candidate of set 0 sits at the fragment's last position
        allowed = torch.zeros(N, m + N, dtype=torch.bool, device=ids.device)
        for j in range(N):
            allowed[j, :first + j] = True
            allowed[j, m + j] = True
        mask = _additive(allowed, model)
        with torch.set_grad_enabled(grad), _gated(gate, torch.ones(R, N, device=ids.device)):
            cache = model(input_ids=ids[:, first:], position_ids=pos[:, first:], past_key_values=cache,
                          attention_mask=mask[None, None].expand(R, 1, -1, -1), use_cache=True,
                          logits_to_keep=1).past_key_values
        _scatter(per_chunk, group, [(l.keys[:, :, -N:], l.values[:, :, -N:]) for l in cache.layers], B)
    n = len(spans)

    def set_major(x: torch.Tensor) -> torch.Tensor:  # columns (chunk i, set j) -> (set j, chunk i)
        return x.unflatten(2, (n, N)).transpose(2, 3).flatten(2, 3)

    layers = [(set_major(k), set_major(v)) for k, v in _stack(per_chunk)]
    positions = (candidate_positions(spans, fragment)[None, :] + torch.arange(N)[:, None]).flatten()
    return layers, positions


def _additive(allowed: torch.Tensor, model) -> torch.Tensor:
    """A boolean (queries, keys) mask as the additive float mask every attention implementation takes."""
    dtype = next(model.parameters()).dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def _gated(gate, mask: torch.Tensor):
    """``gate.only(mask)``, or nothing for a model without the candidate adapter."""
    return gate.only(mask) if gate is not None else contextlib.nullcontext()


@torch.no_grad()
def refresh_candidates(model, groups: list[ChunkGroup], new_ids: torch.Tensor, gate=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Feed ``new_ids`` (B, m), the tokens generated since the last refresh, to every chunk's cache;
    returns the refreshed candidates as ``candidate_kv`` does (keys rotated at their position in their
    chunk's sequence: ``group.length - 1`` after the call)."""
    B = new_ids.shape[0]
    per_chunk: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = [None] * sum(len(g.idx) for g in groups)
    for group in groups:
        ids = new_ids.repeat(len(group.idx), 1)
        _scatter(per_chunk, group, _forward_group(model, group, ids, group.cache, gate, keep=True), B)
    return _stack(per_chunk)


def _scatter(per_chunk: list, group: ChunkGroup, last: list[tuple[torch.Tensor, torch.Tensor]], B: int) -> None:
    for j, i in enumerate(group.idx):
        rows = slice(j * B, (j + 1) * B)
        per_chunk[i] = [(k[rows], v[rows]) for k, v in last]


def _stack(per_chunk: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
    n_layers = len(per_chunk[0])
    return [(torch.cat([c[l][0] for c in per_chunk], dim=2), torch.cat([c[l][1] for c in per_chunk], dim=2))
            for l in range(n_layers)]


def to_slots(cand: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor, run,
             slots: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Re-rotate candidate ``i`` (rotated at ``positions[i]`` in its chunk) to slot ``i`` of the decoder
    (or to ``slots[i]``)."""
    target = torch.arange(len(positions)) if slots is None else slots.cpu()
    shift = target - positions.cpu()  # rotate() moves it to the keys' device
    return [(rotate(k, shift, families.rotary_inv_freq(run.model, run.family, layer)), v)
            for layer, (k, v) in enumerate(cand)]
