"""focusllm: parallel chunk decoding into candidate tokens (FocusLLM, Li et al. 2024).

A long input is split into *memory* (everything but the last ``local`` tokens) and *local* tokens.
The memory is cut into chunks of at most ``chunk`` tokens (never more than the model's window); the
last ``fragment`` local tokens are appended to every chunk, and the last position of each
[chunk ; fragment] is a *candidate token*: its per-layer key/value summarises the chunk as seen from
the local context.  The frozen model then reads the local tokens after the candidates, with
contiguous positions: candidates at 0..n-1, local tokens from n (the chunking stage builds that plan).
With ``overlap`` (an lcx extension; the paper's chunks are disjoint) each chunk but the first also reads
the last ``overlap`` tokens of the chunk before it, so that a short fact cut by a boundary is whole in one.

The candidate position uses the method's own q/k/v/o projections: a LoRA adapter gated per token
(``lcx.adapters.gated_lora``) open only there, so an untrained (zero) adapter is the base model and a
trained one is a plain PEFT adapter.  Chunks are processed ``parallel`` at a time as one batch
(1 = serially, flat memory; 0 = all at once).  The candidates enter through the cache: the plan's
first window holds one placeholder token per candidate, and the cache stores the candidates'
keys/values instead of the placeholders' (memory stage), so ``model.generate()`` continues as usual.

Generation (``refresh``): every generated token joins the local tokens, so it also joins every
chunk's [chunk ; fragment] sequence and becomes that chunk's new candidate.  Each chunk keeps its own
cache; ``refresh=1`` (exact) feeds every new token to every chunk (batched across chunks, one token
each) and swaps the refreshed candidates into the decoder's cache before the token is read;
``refresh=N`` does that every N tokens, feeding the N pending tokens at once (approximate: in between,
the decoder reads candidates up to N-1 tokens old; cheaper, measured in bench/focusllm_generation.py);
``refresh=0`` keeps the prompt's candidates and no chunk cache (flat memory).  The newest token is
computed with the candidate projections (gate open) and kept in the chunk cache with the base ones.
Batches of several inputs need equal lengths without padding.

Training (``lcx train --method focusllm``; only the candidate adapter trains, the base weights stay
frozen): per step and loss term, a chunk size is drawn from ``train_chunks`` and a local size at
random; the *continuation* term reads the training window's end as the local tokens, the
*repetition* term a span copied from inside the memory, the *recall* term (with ``fresh``) the window's
end followed by a short cue copied from the memory and the value that follows it there, as a question is
followed by what a document said after the same words; the value is random tokens of the window, which the
local tokens cannot guess (as a passkey's digits); with ``recall_local``, a share of the draws puts a random
cue and value among the local tokens instead, earlier than the question (a passkey near the end).  The
candidates see the local tokens' first ``fragment`` tokens; the loss is the frozen decoder's next-token
loss on the local tokens after them.  Only the candidate position of each chunk carries autograd (its
chunk is read without it), so a step costs one no-grad pass over the window plus a backward pass over
the local tokens.

That training predicts most local tokens with candidates that have not seen the tokens before them,
while exact generation refreshes every candidate before each token.  ``fresh=N`` trains for what
generation does: only the last N local tokens are predicted, token j with every candidate refreshed
through the token before it (``fresh_candidates``: N candidate sets from one gated pass), and the
earlier local tokens read the first set without autograd, as a prefill would.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from lcx.adapters import families
from lcx.adapters.rotary import rotate
from lcx.errors import LcxError
from lcx.hookspecs import hookimpl
from lcx.masking import visible_mask
from lcx.method import Method, option
from lcx.plan import Plan

#: Training loss terms (``-o focusllm.losses``).
LOSSES = ("continuation", "repetition", "recall")
#: The recall term's cue: how many copied tokens come before the predicted ones (drawn per step).
RECALL_CUE = (4, 32)


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
        keys = [ChunkMemo.key(_group_rows(memory_ids, spans, ChunkGroup([i], 0), fragment_ids)) for i in range(len(spans))]
        todo = []
        for i, key in enumerate(keys):
            hit = memo.chunks.get(key)
            if hit is None or (keep and hit.kv is None):
                todo.append(i)
                continue
            per_chunk[i] = hit.last
            kept[key] = hit
            if keep:  # the cache's first update copies these rows; refreshing appends to that copy
                made.append(ChunkGroup([i], hit.length, _kv_cache(model.config, hit.kv)))
        memo.hits += len(spans) - len(todo)
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


def _kv_cache(config, kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A cache holding the given per-layer (keys, values)."""
    cache = DynamicCache(config=config)
    for layer, (k, v) in enumerate(kvs):
        cache.update(k, v, layer)
    return cache


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


def topk_keep(query: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """Which candidates each query reads: queries (..., Hkv, G, T, D) grouped by KV head, the candidates'
    keys (..., Hkv, n, D); True at each query's ``k`` highest q.k, (..., Hkv, G, T, n).  lcx's attention
    (``candidate_topk_mask``) and the served one (``vllm_attention._topk_sdpa``) both cut with it."""
    # float32: bf16 scores would tie and reorder near-equal candidates (and a bf16 bmm of these strided views is slow)
    scores = query.float() @ candidates.float().unsqueeze(-3).transpose(-1, -2)
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
    base = visible_mask(attention_mask, torch.arange(S, device=query.device), S, T, base_impl, query.dtype)
    mask = base.expand(B, Hq, T, S).clone()
    if mask.dtype == torch.bool:
        mask[..., :n] &= keep
    else:
        mask[..., :n] = mask[..., :n].masked_fill(~keep, torch.finfo(mask.dtype).min)
    return mask


# ---------------------------------------------------------------------- the method
@dataclass
class FocusLLM(Method):
    name = "focusllm"
    description = "FocusLLM: one candidate token per memory chunk (decoded in parallel), read by the frozen model"
    requires = frozenset({"rotary"})
    # served (lcx.integrations.vllm_attention.FocusServed): lcx's request middleware computes a prompt's
    # candidates on lcx's own path and rewrites the prompt to [placeholders ; local tokens]; the served
    # attention stores the candidates' keys/values in the placeholders' stead, as CandidateLayer does
    serving = "attention"
    serve_state = True
    lora_gated = True  # the candidate adapter is open at candidate positions only

    chunk: int = option(2048, "memory chunk size in tokens (at most the model's window); each chunk makes one "
                              "candidate, and a decoder reading too many loses keys: SmolLM2's passkey at 128K found "
                              "16/25 with 2048 (63 candidates), 23/25 with 4096 (31; 22/25 on a held-out draw); at 64K "
                              "23/25 with 2048 (31), 24/25 with 4096 (15) (results/README.md)")
    overlap: int = option(0, "tokens each chunk also reads from the end of the chunk before it (0 = the paper's "
                             "disjoint chunks): a fact that a chunk boundary cuts, such as a passkey sentence, is "
                             "then whole in one chunk; a chunk's forward reads up to chunk + overlap + fragment tokens")
    local: int = option(2048, "local tokens: the input's tail the frozen model reads after the candidates")
    fragment: int = option(512, "local tokens appended to every chunk (at most the chunk size)")
    parallel: int = option(0, "chunks per forward pass: 0 = all at once (fast), 1 = serial (flat memory)")
    refresh: int = option(1, "generation: refresh every chunk's candidate every N new tokens (1 = exact; N > 1 = "
                             "approximate, faster; 0 = never: the prompt's candidates, no chunk caches kept)")
    losses: str = option("continuation,repetition", "training: loss terms, comma-separated: continuation (the local "
                         "tokens are the window's end), repetition (a span copied from the memory), recall (the "
                         "window's end, then a 4-32 token cue copied from the memory: the fresh tokens that follow "
                         "it there, replaced by random tokens of the window in both places, are predicted; needs fresh)")
    fresh: int = option(0, "training: predict only the last N local tokens of each term, the way exact generation "
                           "reads them: each with every candidate refreshed through the token before it (one "
                           "candidate set per predicted token; the earlier local tokens run without gradient). "
                           "0 = the paper's training: the candidates see the fragment, every later token is predicted")
    recall_local: float = option(0.0, "training (recall): the share of draws whose cue and value (random tokens) sit "
                                      "among the local tokens, before the question, instead of the memory: the answer "
                                      "is then local, as a passkey near the end (0 = always in the memory)")
    topk: int = option(0, "candidates each local query reads, per head: the ones with the highest q.k among the "
                          "candidates, the others hidden (lcx's addition: with many chunks, the right candidate's "
                          "share of attention is diluted by the others). 0 = all of them (the paper)")
    train_chunks: str = option("64,128,256,512,1024,2048", "training: chunk sizes, one drawn per step and loss term "
                               "(among those that fit the window and the training window)")

    def __post_init__(self) -> None:
        if min(self.chunk, self.local, self.fragment) <= 0 or min(self.parallel, self.refresh, self.fresh, self.topk) < 0:
            raise ValueError(f"chunk, local and fragment must be > 0, parallel, refresh, fresh and topk >= 0 (got "
                             f"chunk={self.chunk}, local={self.local}, fragment={self.fragment}, "
                             f"parallel={self.parallel}, refresh={self.refresh}, fresh={self.fresh}, topk={self.topk})")
        if self.fragment > self.chunk:
            raise ValueError(f"fragment ({self.fragment}) must not be longer than the chunk ({self.chunk})")
        if not 0 <= self.overlap < self.chunk:
            raise ValueError(f"overlap must be at least 0 and shorter than the chunk ({self.chunk}), got {self.overlap}")
        if self.fragment > self.local:
            raise ValueError(f"fragment ({self.fragment}) must not be longer than the local tokens ({self.local})")
        terms = [t.strip() for t in self.losses.split(",") if t.strip()]
        if not terms or set(terms) - set(LOSSES):
            raise ValueError(f"losses must name one or more of {', '.join(LOSSES)}, got {self.losses!r}")
        if not 0 <= self.recall_local <= 1:
            raise ValueError(f"recall_local is a share of the recall draws, from 0 to 1, got {self.recall_local}")
        if "recall" in terms and not self.fresh:
            raise ValueError("the recall loss predicts the tokens after its cue, the way exact generation reads them: "
                             "set -o focusllm.fresh=N (e.g. 32)")
        try:
            chunks = sorted({int(c) for c in self.train_chunks.split(",") if c.strip()})
        except ValueError:
            chunks = []
        if not chunks or chunks[0] <= 0:
            raise ValueError(f"train_chunks must be positive integers separated by commas, got {self.train_chunks!r}")
        self._terms, self._chunks = terms, chunks

    def check_window(self, run) -> None:
        if self.chunk + self.overlap + self.fragment > run.window:
            w, room = run.window, run.window - self.fragment - self.overlap
            fix = (f"-o focusllm.chunk={room} or less" if room >= max(self.fragment, self.overlap + 1) else
                   f"smaller pieces, e.g. -o focusllm.chunk={w // 2} -o focusllm.fragment={w // 8} -o focusllm.local={w // 2}"
                   + (" and a smaller -o focusllm.overlap" if self.overlap else ""))
            reads = f"chunk={self.chunk}" + (f" + overlap={self.overlap}" if self.overlap else "")
            raise LcxError(f"focusllm {reads} + fragment={self.fragment} exceeds the model's window ({w}); use {fix}")
        if self.local >= run.window:
            raise LcxError(f"focusllm local={self.local} leaves no room for candidates in the model's window "
                           f"({run.window}); lower -o focusllm.local")

    # ------------------------------------------------------------------ patching: the candidate adapter
    @hookimpl
    def lcx_patch_model(self, run, model):
        """A LoRA adapter on the model (trained with focusllm) becomes the candidate projections: gated
        open at candidate positions only, so every other token uses the base weights."""
        from peft.tuners.lora import LoraLayer

        from lcx.adapters.gated_lora import TokenGate, gate_lora

        handle = model.register_forward_pre_hook(lambda mod, args, kwargs: self._refresh(run, kwargs), with_kwargs=True)
        run.patches.callback(handle.remove)
        if not any(isinstance(m, LoraLayer) for m in model.modules()):
            return  # training-free: the candidates use the base projections
        gate = TokenGate(default_open=False)
        for handle in gate_lora(model, gate):
            run.patches.callback(handle.remove)
        run.state["focusllm_gate"] = gate

    def _refresh(self, run, kwargs) -> None:
        """Before each decoding step: the step's tokens join every chunk (every ``refresh`` tokens), and the
        decoder's candidate slots take the refreshed candidates."""
        gen = run.state.get("focusllm_generation")
        cache = kwargs.get("past_key_values")
        if gen is None or cache is None or cache is not gen["cache"] or cache.layers[0].pending is not None:
            return  # not our decoder (a chunk forward, training, another call) or still the prefill
        ids = kwargs.get("input_ids")
        if ids is None:
            raise LcxError("focusllm refresh needs token ids (not input embeddings) during generation")
        ids = ids[:, max(0, gen["prompt"] - cache.get_seq_length()):]  # prompt tokens are in the chunks already
        if ids.shape[1] == 0:
            return
        gen["pending"].append(ids)
        if sum(t.shape[1] for t in gen["pending"]) < self.refresh:
            return
        new = torch.cat(gen["pending"], dim=1)
        gen["pending"].clear()
        cand = refresh_candidates(run.model, gen["groups"], new, run.state.get("focusllm_gate"))
        positions = torch.empty(cand[0][0].shape[2], dtype=torch.long)
        for g in gen["groups"]:
            positions[g.idx] = g.length - 1
        for layer, (k, v) in zip(cache.layers, to_slots(cand, positions, run)):
            n = k.shape[2]
            layer.keys[:, :, :n] = k.to(layer.keys.dtype)
            layer.values[:, :, :n] = v.to(layer.values.dtype)
        gen["refreshes"] += 1

    # ------------------------------------------------------------------ chunking stage
    @hookimpl
    def lcx_plan(self, run, input_ids, attention_mask, max_new_tokens):
        return self._plan(run, input_ids, attention_mask, max_new_tokens)

    def _plan(self, run, input_ids, attention_mask, max_new_tokens, forward=None):
        """``lcx_plan``; with ``forward`` (``serve_request``'s), the chunks' candidates are computed by it."""
        from lcx.generation import REUSE, SCORED

        # an earlier plan's candidates that never reached lcx_memory (its caller failed in between) must not
        # reach this prompt's cache, nor the last prompt's chunk caches live on while this one's are made
        # (make_plan has done this already; serve_request plans directly)
        self.release(run)
        self.check_window(run)
        B, T = input_ids.shape
        if T <= self.local:
            return None  # one window: the model reads it as it is
        if not bool(attention_mask.all()):
            raise LcxError("focusllm: padded batches are not supported yet; give inputs of equal length "
                           "(or one at a time)")
        memory, local = input_ids[:, : T - self.local], input_ids[:, T - self.local:]
        spans = self._spans(T)
        n = len(spans)
        if n + self.local + max_new_tokens > run.window:
            raise LcxError(f"focusllm: {n} candidates + {self.local} local tokens + {max_new_tokens} new tokens "
                           f"exceed the model's window ({run.window}); raise -o focusllm.chunk or lower -o focusllm.local")
        # the fragment: the last local tokens, or when scoring, the last ones before the scored tokens (every
        # local token reads the candidates, so they may only have read what the first scored logit reads)
        scored = int(run.state.get(SCORED, 0))
        if scored >= self.local:
            raise LcxError(f"focusllm scores at most its local tokens minus one ({self.local - 1}), got {scored}; "
                           f"score fewer tokens or raise -o focusllm.local")
        fragment = local[:, : self.local - scored][:, -self.fragment:]
        groups: list[ChunkGroup] | None = [] if self.refresh and max_new_tokens > 1 else None
        longest = max(e - s for s, e in spans) + fragment.shape[1]
        if groups is not None and longest + max_new_tokens - 1 > run.window:
            # refreshing grows each chunk's sequence by the generated tokens: past the window, its positions
            # are ones the model never saw
            raise LcxError(f"focusllm refreshes each chunk's candidate as it generates: a chunk's {longest} tokens + "
                           f"{max_new_tokens - 1} generated ones exceed the model's window ({run.window}); use "
                           f"-o focusllm.chunk={self.chunk - (longest + max_new_tokens - 1 - run.window)} or less, "
                           f"fewer new tokens, or -o focusllm.refresh=0")
        if groups is not None and run.state.get("focusllm_gate") is not None and getattr(run.model.config, "sliding_window", None):
            # a kept chunk cache trades its gated last token for the base one (crop, then one more token),
            # which transformers' sliding-window cache layers refuse
            raise LcxError(f"focusllm with a candidate adapter refreshes its candidates from each chunk's cache, which "
                           f"this model's sliding-window layers (sliding_window={run.model.config.sliding_window}) "
                           f"cannot take back; use -o focusllm.refresh=0 (the prompt's candidates)")
        if forward is not None:
            cand = self._forwarded(run, forward, memory, fragment, spans)
        else:
            reuse = run.state.get(REUSE)  # a caller that expects prompts sharing chunks (a passkey grid)
            memo = reuse.memo(run, "focusllm_chunks", ChunkMemo) if reuse is not None else None
            cand = candidate_kv(run.model, memory, fragment, spans, self.parallel, run.state.get("focusllm_gate"),
                                groups, memo=memo)
        # each candidate was rotated at the last position of its own forward; move it to its slot i
        run.state["focusllm_candidates"] = to_slots(cand, candidate_positions(spans, fragment.shape[1]), run)
        run.state["focusllm_groups"] = groups
        placeholder = torch.full((B, n), int(local[0, 0]), dtype=input_ids.dtype, device=input_ids.device)
        ids = torch.cat([placeholder, local], dim=1)
        return Plan(ids, torch.ones_like(ids), [(0, n), (n, n + self.local)], dropped=0,
                    info={"candidates": n, "memory_tokens": int(memory.shape[1])})

    @staticmethod
    def _forwarded(run, forward, memory, fragment, spans) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``candidate_kv``'s result (B = 1) from ``forward`` (``serve_request``)."""
        if run.state.get("focusllm_gate") is not None:
            raise LcxError("focusllm's candidate adapter is open at the candidate position only, which only lcx's "
                           "own chunk forwards can do; compute these candidates without an outside forward")
        rows = [_group_rows(memory, spans, ChunkGroup([i], 0), fragment)[0].tolist() for i in range(len(spans))]
        per_chunk = forward(rows)
        layers = run.model.config.num_hidden_layers
        if len(per_chunk) != len(rows) or any(len(c) != layers for c in per_chunk):
            raise LcxError(f"focusllm: the outside chunk forward returned {len(per_chunk)} candidates for {len(rows)} "
                           f"chunks (of {[len(c) for c in per_chunk][:4]} layers; the model has {layers})")
        dtype = run.model.dtype
        return [(torch.stack([c[l][0] for c in per_chunk], dim=1)[None].to(dtype),
                 torch.stack([c[l][1] for c in per_chunk], dim=1)[None].to(dtype)) for l in range(len(per_chunk[0]))]

    def _spans(self, input_tokens: int) -> list[tuple[int, int]]:
        """The memory chunks of a prompt of ``input_tokens`` (none when it fits the local tokens)."""
        return chunk_spans(max(0, input_tokens - self.local), self.chunk, self.overlap)

    def release(self, run) -> None:
        for key in ("focusllm_candidates", "focusllm_groups", "focusllm_generation"):
            run.state.pop(key, None)

    def forward_shapes(self, run, tokens: int) -> list[tuple[int, int, int]]:
        """The candidates' pass (its chunks as rows: all at once with parallel=0) and the local tokens' pass."""
        spans = self._spans(tokens)
        local = min(tokens, self.local)
        if not spans:
            return [(1, local, local)]
        width = max(e - s for s, e in spans) + self.fragment
        return [(self.parallel or len(spans), width, width), (1, local, len(spans) + local)]

    def forward_hint(self, run) -> str | None:
        if self.parallel == 1:
            return None
        return "decode fewer candidate chunks at once (-o focusllm.parallel=N; 1 = one at a time)"

    def cache_tokens(self, run, tokens: int) -> int:
        """The decoder's cache: [candidates ; local tokens ; new tokens], at most the window (``lcx_plan``
        refuses more)."""
        return min(tokens, run.window)

    def memory_entries(self, run, input_tokens: int) -> int:
        """The chunk caches at their peak (``lcx.limits``): [chunk (+ overlap) ; fragment] per chunk, every chunk
        at once with parallel=0 or when candidates are refreshed (their caches are kept), else ``parallel``."""
        spans = self._spans(input_tokens)
        if not spans:
            return 0
        at_once = len(spans) if (not self.parallel or self.refresh) else min(self.parallel, len(spans))
        return at_once * (max(e - s for s, e in spans) + self.fragment)

    def generation_entries(self, run, input_tokens: int, max_new_tokens: int) -> int:
        """Refreshed candidates: each kept chunk cache grows by every generated token but the last."""
        if not self.refresh or max_new_tokens <= 1:
            return 0
        return len(self._spans(input_tokens)) * (max_new_tokens - 1)

    def check_serving(self):
        if self.refresh:
            raise LcxError(f"served focusllm keeps the prompt's candidates (vLLM runs no chunk forwards while it "
                           f"generates): serve it with -o focusllm.refresh=0, and compare it with `lcx generate "
                           f"--method focusllm -o focusllm.refresh=0` (got refresh={self.refresh})")

    def serves_prefix_kv(self):
        """The candidates' keys/values are the served state, read by plain attention: vLLM's own model code serves
        them through lcx's KV connector; with ``topk`` each query head picks its candidates, which only lcx's
        served attention can do (``vllm_attention.FocusServed``)."""
        return not self.topk

    @torch.no_grad()
    def serve_request(self, run, ids, max_new_tokens, forward=None):
        """The plan's tokens ([one placeholder per candidate ; local tokens]) and, per layer, the candidates'
        keys ``"{layer}.k"`` and values ``"{layer}.v"`` (H_kv, n, D), already at their slots 0..n-1; None for
        a prompt of at most ``local`` tokens (read as it is).  Served candidates are the prompt's
        (``refresh=0``): vLLM runs no chunk forwards while it generates.

        ``forward`` runs the chunk forwards elsewhere (the server's engine, ``lcx.integrations.vllm_connector``):
        given each chunk's [chunk ; fragment] token ids, it returns per chunk and layer the last position's
        (keys, values), each (H_kv, D), keys rotated at that position -- what ``candidate_kv`` computes
        training-free.  A candidate adapter needs lcx's forwards (its LoRA is open at one position only)."""
        self.check_serving()
        input_ids = torch.tensor([ids])
        plan = self._plan(run, input_ids, torch.ones_like(input_ids), max_new_tokens, forward)
        if plan is None:
            return None
        cand = run.state.pop("focusllm_candidates")
        tensors = {}
        for layer, (k, v) in enumerate(cand):
            tensors[f"{layer}.k"], tensors[f"{layer}.v"] = k[0].float().contiguous(), v[0].float().contiguous()
        return plan.input_ids[0].tolist(), tensors

    # ------------------------------------------------------------------ memory stage
    @hookimpl
    def lcx_memory(self, run, batch_size):
        cand = run.state.pop("focusllm_candidates", None)
        groups = run.state.pop("focusllm_groups", None)
        run.state.pop("focusllm_generation", None)
        if cand is None:
            return None
        cache = Cache(layers=[CandidateLayer(k, v) for k, v in cand])
        if groups is not None:
            plan = run.state.get("plan")
            run.state["focusllm_generation"] = {"cache": cache, "groups": groups, "pending": [], "refreshes": 0,
                                                "prompt": int(plan.input_ids.shape[1]) if plan is not None else 0}
        return cache


    # ------------------------------------------------------------------ attention stage
    def idle_stages(self):
        return frozenset() if self.topk else frozenset({"lcx_attention"})  # without topk: the paper's attention

    @hookimpl
    def lcx_attention(self, run, module, query, key, value, attention_mask, kwargs):
        """``topk``: the decoder's queries read their ``topk`` best-scoring candidates only (per head)."""
        cache = run.state.get("memory")
        layers = cache.layers if isinstance(cache, Cache) else []
        layer = layers[module.layer_idx] if module.layer_idx < len(layers) else None
        # the decoder's forward only (the chunk forwards that refresh candidates read their own caches)
        if (not isinstance(layer, CandidateLayer) or layer.candidates <= self.topk
                or key.data_ptr() != layer.keys.data_ptr()):
            return None
        mask = candidate_topk_mask(query, key, layer.candidates, self.topk, attention_mask, run.base_impl)
        return run.base_attention(module, query, key, value, mask, **kwargs)

    # ------------------------------------------------------------------ training: sampling stage
    @hookimpl
    def lcx_sample(self, run, batch, step):
        """Per loss term, a draw of chunk size, local size and (repetition) the copied span: a pure
        function of (seed, step), so resumed runs draw the same.  Every process draws the same: the draw
        sets how many forwards a step makes, and DDP needs the same number on each (each forward of the
        wrapped model is a collective); the processes differ by their data."""
        self._check_trainable(run)
        ids = batch["input_ids"]
        rng = random.Random(f"focusllm:{run.state.get('seed', 0)}:{step}")
        return {"input_ids": ids, "focusllm": {t: self._draw(run.window, ids.shape[1], t, rng) for t in self._terms}}

    def _draw(self, window: int, N: int, term: str, rng: random.Random) -> TrainDraw:
        """Chunk c from ``train_chunks`` (one chunk + its fragment within the window, at least one chunk of
        memory, candidates + local tokens within the window); local size l uniform in [hi / 4, hi] with
        hi = ``local`` (continuation, recall) or c (repetition: a span no longer than a chunk, so that one or two
        candidates hold it); fragment = min(``fragment``, c, l // 2), so at least half the local tokens are
        predicted.  Continuation: memory = the first N - l tokens, local = the last l.  Repetition: the same
        memory, local = a copy of memory[s:s + l].  Recall: local = the last l - m tokens, then a copy of
        memory[s:s + m], m = cue + ``fresh`` (the fresh tokens predicted are the copy's after the cue;
        the cue is 4-32 tokens, and at least 2 local tokens precede it); those ``fresh`` tokens, in the memory
        and so in the copy, are the window's tokens at ``values`` (random positions).  With probability
        ``recall_local`` (when l >= 2m) the copy is instead m random tokens of the window (cue and value), which
        also replace local[p:p + m], p = ``placed``, before the copy."""
        least = RECALL_CUE[0] + self.fresh + 2 if term == "recall" else 2

        def limit(c: int) -> int:
            hi = min(c, (N - c) // 2) if term == "repetition" else min(self.local, N - c)
            if term == "recall":  # the memory holds the copied span (a cue of 4 or more, then `fresh` tokens)
                hi = min(hi, N - RECALL_CUE[0] - self.fresh)
            reads = c + self.overlap + min(self.fragment, c) + self.fresh  # one chunk's forward
            return hi if hi >= least and reads <= window and -(-(N - 2) // c) + hi <= window and self.overlap < c else 0

        fits = [c for c in self._chunks if limit(c)]
        if not fits:
            raise LcxError(f"focusllm {term} training: no chunk size in train_chunks={self.train_chunks} fits "
                           f"{N}-token training windows and the model's {window}-token window; use a longer --seq-len "
                           f"or smaller -o focusllm.train_chunks" + (f" (each longer than overlap={self.overlap})" if self.overlap else ""))
        c = rng.choice(fits)
        hi = limit(c)
        l = rng.randint(max(least, hi // 4), hi)
        start = rng.randrange(0, N - l - l + 1) if term == "repetition" else N - l
        if not self.fresh:
            return TrainDraw(chunk=c, local=l, fragment=max(1, min(self.fragment, c, l // 2)), memory=N - l, start=start)
        # the last `fresh` tokens predicted (at most half the local ones; recall: every one, after its cue);
        # the fragment ends before them
        fresh = self.fresh if term == "recall" else min(self.fresh, l // 2)
        draw = TrainDraw(chunk=c, local=l, fragment=max(1, min(self.fragment, c, l - fresh)), memory=N - l,
                         start=start, fresh=fresh)
        if term != "recall":
            return draw
        m = rng.randint(RECALL_CUE[0], min(RECALL_CUE[1], l - fresh - 2, N - l - fresh)) + fresh
        placed = -1
        if self.recall_local and rng.random() < self.recall_local and l >= 2 * m:
            placed = rng.randrange(0, l - 2 * m + 1)
        return replace(draw, source=rng.randrange(0, N - l - m + 1), copied=m, placed=placed,
                       values=tuple(rng.randrange(0, N) for _ in range(m if placed >= 0 else fresh)))

    def _check_trainable(self, run) -> None:
        if run.state.get("focusllm_checked"):
            return
        if "focusllm_gate" not in run.state:
            raise LcxError("focusllm trains its candidate adapter (a LoRA on q/k/v/o), and this model has none; "
                           "train without --full all")
        extra = [n for n, p in run.model.named_parameters() if p.requires_grad and "lora_" not in n]
        if extra:
            raise LcxError(f"focusllm trains only its candidate adapter, which keeps the base weights frozen; "
                           f"{extra[0]!r} would train for every token; drop --full")
        run.state["focusllm_checked"] = True

    # ------------------------------------------------------------------ training: loss stage
    @hookimpl
    def lcx_loss(self, run, model, batch):
        """Per term: candidates of the memory's chunks (with autograd through the adapter at the candidate
        positions only), then the frozen decoder reads [candidates ; local] with contiguous positions and
        the loss is the next-token loss on the local tokens after the fragment (the candidates saw the
        fragment, never the tokens predicted)."""
        draws = batch.get("focusllm")
        if draws is None:
            return None
        ids = batch["input_ids"]
        gate = run.state["focusllm_gate"]
        terms = {}
        for term, d in draws.items():
            local = ids[:, d.start:d.start + d.local]
            memory = ids[:, :d.memory]
            if d.copied:  # recall: the local tokens end with a cue and its value, the value random tokens
                head = local[:, :d.local - d.copied]
                if d.placed < 0:  # the cue is a span of the memory, its value written after it there
                    memory = memory.clone()
                    memory[:, d.source + d.copied - d.fresh:d.source + d.copied] = ids[:, list(d.values)]
                    span = memory[:, d.source:d.source + d.copied]
                else:  # cue and value random, and among the local tokens before the question
                    span = ids[:, list(d.values)]
                    head = torch.cat([head[:, :d.placed], span, head[:, d.placed + d.copied:]], 1)
                local = torch.cat([head, span], 1)
            if d.fresh:
                terms[term] = self._fresh_loss(run, model, gate, memory, local, d)
                continue
            spans = chunk_spans(d.memory, d.chunk, self.overlap)
            cand = candidate_kv(model, memory, local[:, :d.fragment], spans, self.parallel, gate, grad=True)
            cache = _kv_cache(run.model.config, to_slots(cand, candidate_positions(spans, d.fragment), run))
            n = len(spans)
            labels = local.clone()
            labels[:, :d.fragment] = -100
            pos = torch.arange(n, n + d.local, device=ids.device)[None].expand(ids.shape[0], -1)
            with gate.only(torch.zeros_like(local, dtype=torch.float32)):
                terms[term] = model(input_ids=local, position_ids=pos, past_key_values=cache, labels=labels,
                                    attention_mask=torch.ones(ids.shape[0], n + d.local, dtype=torch.long,
                                                              device=ids.device),
                                    use_cache=True).loss
        return terms


    def _fresh_loss(self, run, model, gate, memory, local, d: TrainDraw) -> torch.Tensor:
        """``fresh`` training: the last N = ``d.fresh`` local tokens predicted as exact generation predicts
        them.  The prompt is local[:t0 + 1] (t0 = l - N - 1), its fragment the F tokens ending at t0; token
        t0 + j is read with candidate set j (refreshed through it) and the prompt tokens before t0 with set
        0, without autograd (as a prefill would compute them)."""
        l, N, F = d.local, d.fresh, d.fragment
        t0 = l - N - 1
        sets, positions = fresh_candidates(model, memory, local[:, t0 - F + 1:l - 1], F,
                                           chunk_spans(d.memory, d.chunk, self.overlap), self.parallel, gate, grad=True)
        n = len(positions) // N
        sets = to_slots(sets, positions, run, slots=torch.arange(n).repeat(N))
        B, dev = local.shape[0], local.device
        prefix = [(k[:, :, :n].detach(), v[:, :, :n].detach()) for k, v in sets]
        if t0:  # the prompt before its last token, reading set 0 (the prefill's candidates)
            cache = _kv_cache(run.model.config, prefix)
            with torch.no_grad(), gate.only(torch.zeros(B, t0, device=dev)):
                cache = model(input_ids=local[:, :t0], position_ids=torch.arange(n, n + t0, device=dev)[None].expand(B, -1),
                              past_key_values=cache, attention_mask=torch.ones(B, n + t0, dtype=torch.long, device=dev),
                              use_cache=True, logits_to_keep=1).past_key_values
            prefix = [(layer.keys[:, :, n:], layer.values[:, :, n:]) for layer in cache.layers]
        else:
            prefix = [(k[:, :, :0], v[:, :, :0]) for k, v in prefix]
        cache = _kv_cache(run.model.config, [(torch.cat([k, pk], 2), torch.cat([v, pv], 2))
                                             for (k, v), (pk, pv) in zip(sets, prefix)])
        allowed = torch.zeros(N, N * n + t0 + N, dtype=torch.bool, device=dev)
        for j in range(N):  # token t0 + j: candidate set j, the prompt before t0, the fed tokens t0..t0 + j
            allowed[j, j * n:(j + 1) * n] = True
            allowed[j, N * n:N * n + t0 + j + 1] = True
        mask = _additive(allowed, model)
        with gate.only(torch.zeros(B, N, device=dev)):
            logits = model(input_ids=local[:, t0:l - 1], position_ids=torch.arange(n + t0, n + l - 1, device=dev)[None].expand(B, -1),
                           past_key_values=cache, attention_mask=mask[None, None].expand(B, 1, -1, -1),
                           use_cache=True).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), local[:, t0 + 1:].flatten())


@dataclass(frozen=True)
class TrainDraw:
    """One loss term's draw for a training step (token counts; ``start`` is where the local tokens begin)."""

    chunk: int
    local: int
    fragment: int
    memory: int
    start: int
    fresh: int = 0  # predicted tokens with refreshed candidates (0: every local token after the fragment)
    source: int = 0  # recall: where in the memory the local tokens' last `copied` tokens come from
    copied: int = 0
    values: tuple[int, ...] = ()  # recall: window positions whose tokens are the value (placed: the cue and value)
    placed: int = -1  # recall: where among the local tokens the cue and value sit (-1: in the memory)


@hookimpl
def lcx_register_methods(register):
    register(FocusLLM)
