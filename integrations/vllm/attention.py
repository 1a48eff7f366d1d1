"""Methods served inside vLLM's attention: the worker side.

vLLM's Transformers backend (``--model-impl transformers``) runs the model's Hugging Face modeling code
and calls the attention function registered as ``"vllm"`` with every scheduled token of every request
flattened into one sequence (query ``[1, heads, tokens, head_dim]``, keys already rotated at their true
positions).  ``install`` wraps that function: for a served method it answers from the method's own
per-request, per-layer state instead of vLLM's paged cache, reproducing what the method's cache layers do
on lcx's own path (``lcx generate``).  The method's served form is a ``ServedAttention`` subclass in its
plugin (``Method.served_attention``); this module splits the batch into requests and updates:

- the prompt is read in *updates* on the method's chunk grid (0, C, 2C, ... up to the prompt's end) and
  each generated token is an update of its own; vLLM's prefill chunks may cut an update anywhere: the
  update's tokens read so far stay visible to its later ones, exactly as if it had come in one forward;
- a subclass's ``begin`` / ``read`` / ``complete`` see each update's start, its queries, keys and values,
  and its end; ``read_batch`` may read one generated token of many requests at once.

Where a prompt ends comes from a vLLM logits processor (``PromptLengths``, which vLLM hands every
request's prompt as it joins the batch; its row order is the attention metadata's).  Per-request state
is keyed by the request's sampling params as that processor sees them (one object per request, held with
the state so its id is not reused); a request's first step (position 0) starts afresh.

With ``prefix_cache`` (a class attribute), lcx's attention also writes every step's keys and values into
vLLM's paged cache (the backend's own op), and a request vLLM schedules from a later position (its first
blocks computed by an earlier request with the same tokens) has its state rebuilt from them
(``lcx.integrations.vllm.paged_cache.CachedPrefix``) through the method's updates as if scheduled
(``ServedAttention.replay``; a token's keys depend on the tokens before it only).  A request's state is freed
when it leaves vLLM's batch finished: the same logits processor sees it removed with its output at
``max_tokens`` or ending in a stop token (vLLM also removes running requests it did not schedule this
step, which must keep their state).  A request that ends otherwise (aborted, a stop string) is freed when
it has not been scheduled for ``STALE_STEPS`` forward passes.  A request vLLM preempts and recomputes is
read as a fresh prompt of prompt + generated tokens.  vLLM still allocates its paged cache for every token,
unused.

Why this seam: request ``extra_args`` reach logits processors and KV connectors, never the model forward;
prompt embeddings replace a token's input, not a layer's keys; a KV connector injects a *fixed* prefix of
keys and values (``lcx.integrations.vllm.connector``, for methods whose state is one), while a memory method
re-rotates or searches what grows as the window slides, per query and layer.  Only the attention function
sees each layer's queries, keys and values as they are computed.  The cost: the Transformers backend instead
of vLLM's native model code, a replay of a cached prefix instead of sharing it, and attention in torch
instead of vLLM's CPU kernel (docs/serving.md).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from lcx.adapters import families
from lcx.errors import LcxError
from lcx.integrations.vllm.middleware import STATE_ARG  # the extra_args key with the id of a request's state
from lcx.integrations.vllm.paged_cache import CachedPrefix, write_cache

#: A request's state is dropped when it has not been scheduled for this many forward passes.
STALE_STEPS = 512


@dataclass
class Seq:
    """One request's tokens in a forward pass: its key, the first token's position, how many tokens, its
    prompt's length (None: unknown, then a one-token step is read as a generated token), and the id of the
    tensors lcx's request middleware computed for it (``STATE_ARG``; None: none)."""

    key: Any
    start: int
    length: int
    prompt: int | None = None
    state: str | None = None
    owner: Any = None  # the object that makes ``key`` unique while the request lives (its sampling params)
    cached: Any = None  # ``cached(module)``: keys, values (Hkv, start, D) of positions [0, start) in vLLM's cache


@dataclass
class Layer:
    """One request, one layer: the method's state plus the current update."""

    start: int = 0  # absolute position of the current update's first token
    end: int = 0  # where it ends (exclusive)
    next: int = 0  # the position of the next token this layer expects
    data: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # the request's own (``Request.info``), shared by its layers


@dataclass
class Request:
    layers: dict[int, Layer] = field(default_factory=dict)
    last_step: int = 0
    info: dict[str, Any] = field(default_factory=dict)  # per request, not per layer (``start_request``)
    owner: Any = None  # ``Seq.owner`` (held: its id, the key, is not reused while the state lives)


@dataclass(frozen=True)
class ServeContext:
    """What a served attention is built with in vLLM's worker, besides its method's options."""

    window: int  # the model's trained window
    spool: str | None = None  # where lcx's request middleware writes per-request tensors (``Method.serve_state``)
    memory: str | None = None  # a document memory every request reads (``lcx serve --memory``)


class ServedAttention:
    """Per-request, per-layer updates over vLLM's flattened token batches (see the module docstring).

    A method served inside vLLM's attention subclasses it in its own plugin and names the subclass from
    ``Method.served_attention``; this module asks the class, never the method's name."""

    name = ""
    #: Whether a request may start at a position > 0, its earlier tokens' keys/values read from vLLM's cache
    #: (``Seq.cached``) and replayed through the method's updates: vLLM's prefix cache then shares blocks.
    prefix_cache = False

    @classmethod
    def from_method(cls, method: Any, context: ServeContext) -> "ServedAttention":
        """The served attention of ``method`` (an instance with the served options), in vLLM's worker."""
        raise NotImplementedError(f"{cls.__name__} does not say how it is built from its method")

    @classmethod
    def request_bytes(cls, method: Any, config: dict[str, Any], window: int, max_model_len: int) -> int:
        """An upper bound on the state one request of up to ``max_model_len`` tokens holds in the worker
        (``config``: the model's config.json); ``lcx serve --state-gib`` divides by it."""
        raise NotImplementedError(f"{cls.__name__} does not bound its per-request state")

    @classmethod
    def step_bytes(cls, method: Any, config: dict[str, Any], window: int, max_model_len: int, memory: Any) -> int:
        """An upper bound on what one request's update allocates for a moment in a step besides the state it
        holds (fot: its memory attention); ``lcx serve --state-gib`` keeps room for one.  0: not counted."""
        return 0

    @classmethod
    def memory_entries(cls, method: Any, max_model_len: int, memory: Any) -> int:
        """The most entries per layer and KV head a request's memory may hold (``memory``: the folder of a
        document memory the server loads, or None), checked against ``LCX_MAX_MEMORY_ENTRIES``; 0: none."""
        return 0

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.requests: dict[Any, Request] = {}
        self.step = 0
        self.replayed = False  # whether ``replay`` ran (logged the first time)
        self._inv: dict[int, torch.Tensor] = {}

    def begin_step(self) -> None:
        self.step += 1
        for k in [k for k, r in self.requests.items() if self.step - r.last_step > STALE_STEPS]:
            self.release(k)

    def release(self, key: Any) -> None:
        """The request keyed ``key`` has finished: free its state now."""
        req = self.requests.pop(key, None)
        if req is not None:
            self.end_request(req)

    def start_request(self, req: Request, s: Seq) -> None:
        """A request starts (position 0; again after a preemption): set up ``req.info``.  ``req`` may still
        hold a finished request's info: vLLM reuses a finished request's first block (the state's key)
        before lcx has seen it leave the batch."""

    def end_request(self, req: Request) -> None:
        """A request's state is dropped (finished, or not scheduled for ``STALE_STEPS`` passes)."""

    @staticmethod
    def in_band(module: torch.nn.Module, held: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor | None:
        """Which keys at positions ``held`` the queries at ``q_pos`` (broadcast against each other) see through the
        layer's own sliding window, which every method keeps (Gemma 3's local layers: 512; a key q - k >= window
        positions back is hidden, as transformers masks it); None on a full-attention layer."""
        w = families.layer_window(module, module.config)
        return held > q_pos - w if w else None

    def inv_freq(self, module: torch.nn.Module) -> torch.Tensor:
        """The layer's RoPE frequencies, from the rotary class of its own modeling file."""
        idx = int(module.layer_idx)
        if idx not in self._inv:
            mod = sys.modules[type(module).__module__]
            cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("RotaryEmbedding"))
            inv = families.layer_inv_freq(cls(config=module.config), module.config, idx)
            if inv is None:
                raise LcxError(f"cannot find RoPE frequencies in {cls.__name__} for layer {idx}")
            self._inv[idx] = inv.float()
        return self._inv[idx]

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               seqs: list[Seq]) -> torch.Tensor:
        """query (1, H, N, D), key/value (1, Hkv, N, D) for the tokens of ``seqs`` (in order, possibly followed
        by padding); returns the attention output (N, H * D)."""
        layer_idx = int(module.layer_idx)
        scale = float(getattr(module, "scaling", query.shape[-1] ** -0.5))
        out = query.new_zeros(query.shape[2], query.shape[1], query.shape[3])
        at, batch = 0, []
        for s in seqs:
            req = self.requests.get(s.key)
            if req is not None and req.owner is not s.owner:  # another request under a reused key
                self.release(s.key)
                req = None
            if req is None:
                req = self.requests[s.key] = Request(owner=s.owner)
            st = req.layers.get(layer_idx)
            if s.start == 0 or st is None or st.next != s.start:
                # a new request (its first tokens, or its first uncached ones), or one recomputed after a
                # preemption: start afresh, from the tokens vLLM's cache holds before ``s.start`` if any
                if s.start and (s.cached is None or not self.prefix_cache):
                    raise RuntimeError(f"lcx {self.name}: no state for a request continuing at position {s.start} "
                                       f"(its earlier tokens were never seen; prefix caching must be off)")
                req.layers.pop(layer_idx, None)
                if req.last_step != self.step:  # the first layer of this pass to see it
                    self.start_request(req, s)
                st = req.layers[layer_idx] = Layer(info=req.info)
                if s.start:
                    self.replay(st, module, s, scale)
            req.last_step = self.step
            st.next = s.start + s.length
            sl = slice(at, at + s.length)
            if s.length == 1 and (s.prompt is None or s.start >= s.prompt) and self.batches(st):
                self.complete(st, module)  # a generated token: an update of its own, read with the others below
                self.begin(st, module, s.start, s.start + 1, key[0, :, sl])
                batch.append((st, at, s.start))
            else:
                out[sl] = self._sequence(st, module, query[0, :, sl], key[0, :, sl], value[0, :, sl], s,
                                         scale).transpose(0, 1)
            at += s.length
        if batch:
            self.read_batch(module, query[0], key[0], value[0], batch, scale, out)
        return out.reshape(out.shape[0], -1)

    def replay(self, st: Layer, module, s: Seq, scale: float) -> None:
        """Bring a fresh layer state to position ``s.start``: its tokens' keys/values, computed by an earlier
        request with the same prefix (vLLM's prefix cache), go through the method's updates as if they had
        been scheduled here, without queries (``read`` with none attends to nothing)."""
        k, v = s.cached(module)
        if not self.replayed:
            self.replayed = True
            print(f"lcx: {self.name}: a request starts at position {s.start}, its state rebuilt from the blocks "
                  f"vLLM's prefix cache found (logged once)", file=sys.stderr, flush=True)
        q = k.new_zeros(int(module.config.num_attention_heads), 0, k.shape[2])  # no query: state updates only
        self._sequence(st, module, q, k, v, Seq(s.key, 0, s.start, s.prompt, s.state), scale)

    def batches(self, st: Layer) -> bool:
        """Whether this request's generated token in this layer is read by ``read_batch`` with the other
        requests' (False: by ``read``, one request at a time)."""
        return False

    def read_batch(self, module, query, key, value, batch: list[tuple[Layer, int, int]], scale: float,
                   out: torch.Tensor) -> None:
        """One generated token per request of ``batch`` ((state, its row in the flattened tokens, its
        position); each update already begun): write each one's attention output into ``out[row]`` (H, Dv).
        query (H, N, D), key/value (Hkv, N, D): the whole step's tokens."""
        raise NotImplementedError

    def _sequence(self, st: Layer, module, q, k, v, s: Seq, scale: float) -> torch.Tensor:
        if s.prompt is None and s.length == 1:  # no prompt length: one token is a generated token
            self.complete(st, module)
            self.begin(st, module, s.start, s.start + 1, k)
        outs, pos, i = [], s.start, 0
        while i < s.length:
            if pos >= st.end:  # an update starts here
                self.complete(st, module)
                if s.prompt is not None and pos >= s.prompt:
                    end = pos + 1  # a generated token
                else:
                    end = (pos // self.chunk + 1) * self.chunk
                    end = min(end, s.prompt) if s.prompt is not None else end
                self.begin(st, module, pos, end, k)
            n = min(s.length - i, st.end - pos)
            outs.append(self.read(st, module, q[:, i:i + n], k[:, i:i + n], v[:, i:i + n], pos, scale))
            pos, i = pos + n, i + n
        return torch.cat(outs, dim=1)

    def begin(self, st: Layer, module, start: int, end: int, like: torch.Tensor) -> None:
        st.start, st.end = start, end

    def complete(self, st: Layer, module) -> None:
        pass

    def read(self, st: Layer, module, q, k, v, pos: int, scale: float) -> torch.Tensor:
        """Queries (H, n, D) at [pos, pos + n) of the current update; returns (H, n, Dv)."""
        raise NotImplementedError


def causal_tail(n: int, total: int, device: torch.device) -> torch.Tensor | None:
    """(n, total) bool: the last n of ``total`` keys are the queries themselves, causally; None when
    every key is allowed (one query: a generated token)."""
    if n == 1:
        return None
    allowed = torch.ones(n, total, dtype=torch.bool, device=device)
    allowed[:, total - n:].tril_()  # in place: no (n, n) copies beside it
    return allowed


#: The most bytes of attention mask one SDPA call holds: a long prompt piece is read in blocks of queries under
#: it, so SDPA's copy of the mask, and a per-head mask, do not grow with the square of the piece.
MASK_BLOCK_BYTES = 64 << 20
#: A mask's bytes per query and key: a bool, and SDPA's copy of it in the query's dtype (float32 at most).
MASK_BYTES = 1 + 4


def block_bytes(n: int, row_bytes: int) -> int:
    """An upper bound on one block's bytes, for any piece of at most ``n`` rows of at most ``row_bytes`` each."""
    return min(n * row_bytes, max(MASK_BLOCK_BYTES, row_bytes))


def query_blocks(n: int, row_bytes: int) -> list[slice]:
    """``n`` query rows in blocks of at most ``MASK_BLOCK_BYTES`` at ``row_bytes`` a row (one row at least; one
    empty block for no rows, which a prompt piece cached whole reads)."""
    rows = max(1, MASK_BLOCK_BYTES // max(1, row_bytes))
    return [slice(i, min(n, i + rows)) for i in range(0, max(n, 1), rows)]


#: A piece whose G query heads per KV head make at most this many query rows of it (G x n) is read as those rows
#: (a served prefill of short chunks runs faster so); a longer one through SDPA's own GQA, which reads it faster.
GQA_ROWS = 2048


def sdpa(q, keys, values, allowed, scale):
    """q (H, n, D) against keys/values (Hkv, S, D) under ``allowed`` (n, S) (None: every key), never copying
    the keys per query head, in blocks of queries whose mask stays under ``MASK_BLOCK_BYTES``."""
    query_rows = q.shape[0] // keys.shape[0] * q.shape[1]
    return (rows_sdpa if allowed is None or query_rows <= GQA_ROWS else gqa_sdpa)(q, keys, values, allowed, scale)


def rows_sdpa(q, keys, values, allowed, scale):
    """``sdpa`` with the G query heads of a KV head as G x n query rows of it, under the mask repeated per head."""
    (H, n, D), (Hkv, S) = q.shape, keys.shape[:2]
    G = H // Hkv
    outs = []
    for b in [slice(0, n)] if allowed is None else query_blocks(n, G * S * MASK_BYTES):
        nb = b.stop - b.start
        mask = None if allowed is None else allowed[b].repeat(G, 1)  # row g * nb + i is query i of head g
        out = F.scaled_dot_product_attention(q[:, b].reshape(Hkv, G * nb, D)[None], keys[None], values[None],
                                             attn_mask=mask, scale=scale)[0]
        outs.append(out.reshape(H, nb, out.shape[-1]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def gqa_sdpa(q, keys, values, allowed, scale):
    """``sdpa`` through SDPA's own GQA, under the (n, S) mask once for every query head."""
    n, S = q.shape[1], keys.shape[1]
    if allowed is None:
        return F.scaled_dot_product_attention(q[None], keys[None], values[None], scale=scale, enable_gqa=True)[0]
    outs = [F.scaled_dot_product_attention(q[None, :, b], keys[None], values[None], attn_mask=allowed[b],
                                           scale=scale, enable_gqa=True)[0] for b in query_blocks(n, S * MASK_BYTES)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def sdpa_bytes(heads: int, kv_heads: int, queries: int, keys: int, head_dim: int) -> int:
    """An upper bound on what ``sdpa`` allocates for any piece of at most ``queries`` queries under a mask of
    ``keys`` columns (float32): a block's mask as a bool and in the query's dtype (repeated per query head where
    the piece is read as rows: a shorter piece may hold more than a longer one read by GQA); a piece read as rows,
    its queries copied as rows of their KV heads; the blocks' outputs and their concatenation."""
    G, mask_row = heads // kv_heads, keys * MASK_BYTES
    as_rows = min(queries, max(1, GQA_ROWS // G))  # the longest piece read as rows
    mask = block_bytes(as_rows, G * mask_row)
    if as_rows < queries:
        mask = max(mask, block_bytes(queries, mask_row))
    return mask + heads * (as_rows + 2 * queries) * head_dim * 4


class Window:
    """One layer's local keys or values (Hkv, S, D), appended at the end and dropped from the front in
    amortised O(1): ``torch.cat`` per generated token would copy the whole window at every step.  When it runs out, the live rows move to the front
    of a buffer of ``front`` + live + appended + max(16, live x ``WINDOW_SLACK``) rows (the old one if that
    fits).  ``front`` rows always stay free before the live ones, for ``with_front``."""

    def __init__(self, like: torch.Tensor, front: int = 0) -> None:
        self.front = front
        self.buf = like.new_empty(like.shape[0], front, like.shape[2])
        self.start = self.end = front

    def view(self) -> torch.Tensor:
        return self.buf[:, self.start:self.end]

    def with_front(self, x: torch.Tensor) -> torch.Tensor:
        """``torch.cat([x, self.view()], 1)`` for x of at most ``front`` rows, without copying the live rows:
        x is written into the free rows right before them."""
        r = x.shape[1]
        self.buf[:, self.start - r:self.start] = x
        return self.buf[:, self.start - r:self.end]

    def __len__(self) -> int:
        return self.end - self.start

    def append(self, x: torch.Tensor) -> None:
        n = x.shape[1]
        if self.end + n > self.buf.shape[1]:
            live, size = self.view(), len(self)
            cap = self.front + size + n + max(16, int(size * WINDOW_SLACK))
            buf = self.buf if cap <= self.buf.shape[1] else x.new_empty(x.shape[0], cap, x.shape[2])
            buf[:, self.front:self.front + size] = live.clone() if buf is self.buf else live
            self.buf, self.start, self.end = buf, self.front, self.front + size
        self.buf[:, self.end:self.end + n] = x
        self.end += n

    def drop_front(self, n: int) -> None:
        self.start += n


#: Spare rows of a ``Window`` beyond its live keys, as a share of them.
WINDOW_SLACK = 0.25


def head_dims(config: dict[str, Any]) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a model of ``config`` (config.json as a dict)."""
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    return heads, kv, int(config.get("head_dim") or int(config["hidden_size"]) // heads)


def batched_tokens(max_model_len: int) -> int:
    """vLLM's --max-num-batched-tokens for a served attention: a whole prompt of up to ``max_model_len`` in a step."""
    return max(max_model_len, 2048)


def output_bytes(config: dict[str, Any], tokens: int) -> int:
    """What ``attend`` allocates for a step of ``tokens`` besides the method's reads: each request's update
    outputs, their concatenation and the step's output (float32 at most)."""
    heads, _, head_dim = head_dims(config)
    return 3 * tokens * heads * head_dim * 4


def kv_bytes(config: dict[str, Any]) -> int:
    """One layer's float32 key and value of one token, for a model of ``config`` (config.json as a dict)."""
    _, kv, head_dim = head_dims(config)
    return kv * head_dim * 2 * 4



#: The served memory method (built by ``served()`` from ``LCX_SERVED_MODEL``), or None.
SERVED: ServedAttention | None = None
#: What builds ``SERVED`` (set by ``install``).  vLLM's API server and engine core load lcx's plugin too, and a
#: document memory (or a Ray cluster) is not theirs to load: it is built in the process that runs the model.
_BUILD: Callable[[], ServedAttention] | None = None


def served() -> ServedAttention:
    """``SERVED``, built on first use."""
    global SERVED
    if SERVED is None:
        SERVED = _BUILD()
    return SERVED


#: Persistent-batch row -> prompt length, kept by the ``PromptLengths`` logits processor.
PROMPT_LENGTHS: dict[int, int] = {}
#: Persistent-batch row -> the state key of the request in that row, as of the last forward pass that
#: scheduled it (a finished request may sit unscheduled in its row for a pass or more before vLLM removes it).
ROW_KEYS: dict[int, Any] = {}
#: Persistent-batch row -> (sampling params, the request's live list of output tokens).
ROW_OUTPUTS: dict[int, tuple[Any, list[int]]] = {}
#: Persistent-batch row -> the id of the tensors lcx's request middleware computed for the request, if any.
ROW_STATES: dict[int, str] = {}


def finished(params: Any, output: list[int]) -> bool:
    """Whether a request with these sampling params has finished with this output (length or stop token;
    stop strings are matched outside the worker and are not seen here)."""
    n = len(output)
    if params.max_tokens is not None and n >= params.max_tokens:
        return True
    if not n or n < (params.min_tokens or 0):
        return False
    stops = set(params.all_stop_token_ids or ())
    if not params.ignore_eos and params.eos_token_id is not None:
        stops.add(params.eos_token_id)
    return output[-1] in stops


def release_finished(batch_update) -> None:
    """Free the state of finished requests among those that left the persistent batch.  They left a row
    that is in ``batch_update.removed``, or, when vLLM put a new request straight into it, among the rows
    of ``batch_update.added``, or, when vLLM condensed the batch by moving a request into it, among the
    targets of ``batch_update.moved`` (vLLM pops such rows out of ``removed``).  Rows are as the last
    forward pass saw them, which is how ``ROW_KEYS`` and ``ROW_OUTPUTS`` are indexed; ``ROW_KEYS`` then
    follows the update (rows taken over or emptied are forgotten, moved rows move)."""
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    released = False
    from vllm.v1.sample.logits_processor.interface import MoveDirectionality

    overwritten = [b for _, b, how in batch_update.moved if how == MoveDirectionality.UNIDIRECTIONAL]
    for row in [*batch_update.removed, *(added[0] for added in batch_update.added), *overwritten]:
        key, info = ROW_KEYS.get(row), ROW_OUTPUTS.get(row)
        if key is not None and info is not None and SERVED is not None and finished(*info):
            ROW_KEYS.pop(row)
            SERVED.release(key)
            released = True
    process_dict_updates(ROW_KEYS, batch_update, lambda params, prompt, output: None)
    if released:
        trim_heap()


_last_trim = [0.0]


def trim_heap(min_interval: float = 1.0) -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``), at most once per ``min_interval`` seconds:
    without tcmalloc glibc keeps the pages of a finished request's many tensors (benchmarks/serving-load.md)."""
    from lcx.limits import trim_heap as trim

    now = time.monotonic()
    if now - _last_trim[0] < min_interval:
        return
    _last_trim[0] = now
    trim()


def served_method(spec: dict[str, Any]) -> Any:
    """The method instance of ``spec`` (a served method's name and options)."""
    from lcx.registry import registry

    return registry().get(spec["name"]).from_options(**(spec.get("options") or {}))


def served_class(spec: dict[str, Any]) -> type[ServedAttention]:
    """The ``ServedAttention`` subclass the method of ``spec`` is served with."""
    cls = served_method(spec).served_attention()
    if not (isinstance(cls, type) and issubclass(cls, ServedAttention)):
        raise TypeError(f"method {spec['name']!r}: served_attention() must return a ServedAttention subclass, got {cls!r}")
    return cls


def served_from_env() -> Callable[[], ServedAttention] | None:
    """What builds the served attention ``lcx serve`` named (``LCX_SERVED_MODEL``) with its method's served
    class, or None; the method and its options are checked here, the building (a document memory's load) is
    left to the call."""
    from lcx.integrations.vllm.middleware import MODEL_ENV, prefix_kv

    info = json.loads(os.environ.get(MODEL_ENV) or "{}")
    spec = info.get("attention")
    if not spec or prefix_kv(spec):  # vLLM's own attention reads it (lcx.integrations.vllm.connector)
        return None
    context = ServeContext(window=int(info["window"]), spool=info.get("spool"), memory=info.get("memory"))
    cls, method = served_class(spec), served_method(spec)

    def build() -> ServedAttention:
        return cls.from_method(method, context)

    build.served_name = cls.name  # type: ignore[attr-defined]
    return build


def __getattr__(name: str) -> Any:
    if name == "PromptLengths":  # built on first use: vLLM is imported only in its own processes
        return _prompt_lengths_class()
    raise AttributeError(name)


def _prompt_lengths_class() -> type:
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    class PromptLengths(LogitsProcessor):
        """Tells the served attention where each request's prompt ends (changes no logits)."""

        def __init__(self, vllm_config, device, is_pin_memory) -> None:
            if _BUILD is not None:  # the model runner makes it at start: the served attention is built there
                served()
            PROMPT_LENGTHS.clear()
            ROW_OUTPUTS.clear()
            ROW_STATES.clear()

        def is_argmax_invariant(self) -> bool:
            return True

        def update_state(self, batch_update) -> None:
            if batch_update:
                release_finished(batch_update)
            process_dict_updates(ROW_OUTPUTS, batch_update, lambda params, prompt, output: (params, output))
            process_dict_updates(PROMPT_LENGTHS, batch_update,
                                 lambda params, prompt, output: len(prompt) if prompt is not None else None)
            process_dict_updates(ROW_STATES, batch_update,
                                 lambda params, prompt, output: (getattr(params, "extra_args", None) or {}).get(STATE_ARG))

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            return logits

    globals()["PromptLengths"] = PromptLengths
    return PromptLengths


#: vLLM's ``--logits-processors`` value that ``lcx serve`` passes with an attention method.
PROMPT_LENGTHS_FQCN = f"{__name__}:PromptLengths"


def install() -> None:
    """Wrap vLLM's Transformers-backend attention function (called from the plugin's ``register``)."""
    global _BUILD
    build = served_from_env()
    if build is None:
        return
    _BUILD = build
    import vllm.model_executor.models.transformers  # noqa: F401  (registers "vllm" first: wrap it, not be replaced)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = ALL_ATTENTION_FUNCTIONS["vllm"]
    if getattr(base, "_lcx", False):
        return

    def lcx_attention(module, query, key, value, attention_mask, **kwargs):
        from vllm.forward_context import get_forward_context

        served()
        md = get_forward_context().attn_metadata
        if isinstance(md, dict):
            md = md.get(getattr(module, "attn").layer_name)
        if md is None:  # vLLM's warm-up and profiling passes
            return base(module, query, key, value, attention_mask, **kwargs)
        first_layer = int(module.layer_idx) == 0
        if first_layer:
            SERVED.begin_step()
        lens = md.seq_lens.tolist()
        starts = md.query_start_loc[:len(lens) + 1].tolist()
        if SERVED.prefix_cache:  # what vLLM's own attention would have written: a later request may reuse it
            write_cache(module.attn, key, value, md)
        seqs = []
        for i, total in enumerate(lens):
            n = starts[i + 1] - starts[i]
            if n:
                owner = (ROW_OUTPUTS.get(i) or (None,))[0]  # the request's sampling params: one object per request
                seqs.append(Seq(key=id(owner) if owner is not None else int(md.block_table[i, 0]),
                                start=int(total) - n, length=n, prompt=PROMPT_LENGTHS.get(i),
                                state=ROW_STATES.get(i), owner=owner,
                                cached=CachedPrefix(md, i, int(total) - n) if SERVED.prefix_cache else None))
                if first_layer:  # rows are the same in every layer of a step
                    ROW_KEYS[i] = seqs[-1].key
        return SERVED.attend(module, query, key, value, seqs), None

    lcx_attention._lcx = True  # type: ignore[attr-defined]
    ALL_ATTENTION_FUNCTIONS["vllm"] = lcx_attention
    print(f"lcx: {build.served_name} answers vLLM's attention in process {os.getpid()}", file=sys.stderr, flush=True)
