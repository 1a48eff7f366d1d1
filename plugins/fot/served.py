"""fot served inside vLLM's attention (``lcx serve --method fot``): at an update's start every layer evicts what
no longer fits its ``local`` window, memory layers into the request's own kNN memory (keys un-rotated to position
0, as ``FoTLayer`` does) but the prompt's first ``sinks`` tokens, which every layer keeps; a query attends to its
sinks (re-rotated to sit right before the window) and local keys and, in memory layers, to its top-``k`` memory
keys under one softmax (``memory_attention``), with the query re-rotated per the positions mode.  A document memory
(``lcx serve --memory``) is read by every request and written by none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lcx.adapters.rotary import rotate
from lcx.integrations.vllm.attention import WINDOW_SLACK, ServedAttention, Window, head_dims, kv_bytes, sdpa
from lcx.plugins.fot.memory import SEARCH_BATCH, top_inner_products


class HeadsStore:
    """One request's memory in one fot memory layer, every KV head in one pair of buffers: keys at position
    0 (Hkv, N, D) and values (Hkv, N, Dv), searched exactly (a decode step's few queries by one batched matmul).
    It answers what the ``torch`` backend's stores, one per KV head, answer (``memory_attention`` takes either),
    with one append and one search per request and layer instead of one per head: a served decode step evicts
    and reads one token per request and layer, where those calls cost more than their arithmetic.  No
    positions or document ids (a served request reads neither); ``max_entries`` drops the oldest entries,
    as the stores' cap does."""

    def __init__(self, max_entries: int = 0) -> None:
        self.max_entries = max_entries
        self.keys: Window | None = None
        self.values: Window | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else len(self.keys)

    def add(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.keys is None:
            self.keys, self.values = Window(keys[:, :0].float()), Window(values[:, :0])
        self.keys.append(keys.float())
        self.values.append(values)
        over = len(self.keys) - self.max_entries if self.max_entries else 0
        if over > 0:
            self.keys.drop_front(over)
            self.values.drop_front(over)

    def search_heads(self, q: torch.Tensor, k: int, dense: bool,
                     select_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries q (Hkv, Q, D), head h's against head h's keys: float32 inner products (Hkv, Q, W) and values,
        (Hkv, Q, W, Dv) for the top ``k`` (W = min(k, N)), or (Hkv, N, Dv) for every key when ``dense``.
        Up to ``SEARCH_BATCH`` queries in all are searched in one product, more one head at a time.
        ``select_dtype``: the precision the top k's candidates may be picked in (``top_inner_products``)."""
        keys = self.keys.view()
        if dense:
            return torch.bmm(q, keys.transpose(1, 2)), self.values.view().float()
        k = min(k, keys.shape[1])
        if q.shape[0] * q.shape[1] <= SEARCH_BATCH:  # few queries (a decode step): one product for every head
            scores, idx = top_inner_products(q, keys, k, select_dtype)
        else:
            found = [top_inner_products(q[h], keys[h], k, select_dtype) for h in range(q.shape[0])]
            scores, idx = torch.stack([f[0] for f in found]), torch.stack([f[1] for f in found])
        Hkv, Q, W = idx.shape
        # the values' buffer read as rows (Hkv * capacity, Dv): one index_select copies whole rows, about twice
        # as fast as a gather whose index is expanded over Dv (bench/served_attention.py's decode step)
        buf = self.values.buf
        cap = buf.shape[1]
        rows = idx + (torch.arange(0, Hkv * cap, cap, device=q.device) + self.values.start)[:, None, None]
        return scores, buf.view(Hkv * cap, -1).index_select(0, rows.view(-1)).view(Hkv, Q, W, -1).float()


class _Rings:
    """One layer's local windows of every served fot request in one pool: keys (slots, Hkv, W, D), values
    (slots, Hkv, W, Dv), and the position each row holds (slots, W; -1: none).  A request owns a slot (the
    same in every layer); its token at position p sits in row p mod W, W being the most a window ever holds
    (max(local, chunk)).  A window's tokens are consecutive positions, so they never share a row and nothing
    moves as the window slides; the rows are out of order, which attention does not see (its mask comes from
    the positions).  A decode step reads every request's window in one batched op over a range of slots.
    ``front`` rows before the ring hold a request's attention sinks (``put_front``), so that reading them
    beside the window copies nothing."""

    def __init__(self, width: int, front: int = 0) -> None:
        self.width, self.front = width, front
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
            cols = self.front + self.width
            grown = [k.new_zeros(n, k.shape[0], cols, k.shape[-1]), v.new_zeros(n, v.shape[0], cols, v.shape[-1]),
                     torch.full((n, cols), -1, dtype=torch.long, device=k.device)]
            if have:
                for new, old in zip(grown, (self.k, self.v, self.pos)):
                    new[:have] = old
            self.k, self.v, self.pos = grown
        self.pos[slot] = -1

    def _spans(self, start: int, n: int) -> list[tuple[int, int, int]]:
        """Positions [start, start + n) as (first row, row end, offset in the n) pieces: at most two."""
        r, f = start % self.width, self.front
        if r + n <= self.width:
            return [(f + r, f + r + n, 0)]
        return [(f + r, f + self.width, 0), (f, f + r + n - self.width, self.width - r)]

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

    def put_front(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The slot's sinks (Hkv, ns, D), at positions 0..ns-1, into its front rows."""
        ns = k.shape[1]
        self.k[slot, :, :ns], self.v[slot, :, :ns] = k, v
        self.pos[slot, :ns] = torch.arange(ns, device=self.pos.device)

    def rows(self, used: int) -> int:
        """How many rows hold anything once positions 0..used-1 were written: the front and, until the ring
        wraps, only its first ``used`` rows (a prompt's first windows: up to half of its local attention's work)."""
        return self.front + min(used, self.width)


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

    @classmethod
    def from_method(cls, method, context):
        shared = None
        if context.memory:
            from lcx.plugins.fot.memory import load_memory

            shared = load_memory(context.memory, method.store_config())[0]
        method.fit_window(context.window)
        return cls(method, shared)

    @classmethod
    def request_bytes(cls, method, config, window, max_model_len):
        """A slot of each layer's ``_Rings`` (pools grow by a quarter: up to that much more per request), and in
        each memory layer its own memory, at most every token of the request: a ``HeadsStore``'s buffer with its
        spare rows (torch), or per head a store's (doubling)."""
        layers = int(config["num_hidden_layers"])
        method.fit_window(window)
        ring = int(max(method.local, method.chunk or method.local) * (1 + WINDOW_SLACK)) + method.sinks
        entries = max_model_len
        torch_own = method.store_config().in_process().kind == "torch"  # a request's own memory (begin)
        memory = entries + max(16, int(entries * WINDOW_SLACK)) if torch_own else 2 * entries
        memory_layers = len(method.layers_of(layers, config.get("layer_types")))
        return (layers * ring + memory_layers * memory) * kv_bytes(config)

    @classmethod
    def step_bytes(cls, method, config, window, max_model_len, memory):
        """A memory layer's attention for one update (at most a chunk of queries over the sinks, the local
        window and the update; ``attention_bytes``), its memory every entry a request may read."""
        method.fit_window(window)
        q = method.chunk or method.local
        return method.attention_bytes(*head_dims(config), q, method.sinks + method.local + q,
                                      cls.memory_entries(method, max_model_len, memory))

    @classmethod
    def memory_entries(cls, method, max_model_len, memory):
        """A request's own memory (up to every token it reads) on top of the document memory's entries."""
        if memory is None:
            return max_model_len
        from lcx.io import read_json_file
        from lcx.plugins.fot.memory import MEMORY_META

        documents = read_json_file(Path(memory) / MEMORY_META, "rebuild the memory").get("documents") or []
        return sum(int(d.get("tokens", 0)) for d in documents) + max_model_len

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
            rings = self.rings.setdefault(layer, _Rings(max(self.m.local, self.chunk), self.m.sinks))
            rings.ensure(st.info["slot"], like, like)
            d.update(rings=rings, slot=st.info["slot"], count=0, local_start=0, memory=None, sink_k=like[:, :0],
                     sink_v=like[:, :0])
            if self.memory_layers is None:
                self.memory_layers = set(self.m.layers_of(int(module.config.num_hidden_layers),
                                                          getattr(module.config, "layer_types", None)))
            if layer in self.memory_layers:
                from lcx.plugins.fot.memory import UnionStore, make_store

                config = self.m.store_config().in_process()  # a request's own memory: here, even by a Ray one
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
            keep = max(0, min(overflow, self.m.sinks - d["local_start"]))  # the prompt's first tokens stay
            if keep:
                d["sink_k"] = torch.cat([d["sink_k"], keys[:, :keep]], 1)
                d["sink_v"] = torch.cat([d["sink_v"], values[:, :keep]], 1)
            if d["memory"] is not None and overflow > keep:
                from lcx.plugins.fot.cache import add_to_memory

                pos = torch.arange(d["local_start"] + keep, d["local_start"] + overflow)
                add_to_memory(d["memory"], 0, keys[:, keep:], values[:, keep:], pos, self.inv_freq(module), 0)
            d["count"] -= overflow
            d["local_start"] += overflow
            if d["sink_k"].shape[1]:  # the sinks follow the window: re-rotated into the ring's front rows
                d["rings"].put_front(d["slot"], *self._sinks(d, module))

    def _sinks(self, d: dict, module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's sink keys re-rotated to sit right before its local window (as ``FoTLayer`` returns
        them), and their values."""
        ns, start = d["sink_k"].shape[1], d["local_start"]
        keys = rotate(d["sink_k"], start - ns, self.inv_freq(module)) if start > ns else d["sink_k"]
        return keys, d["sink_v"]

    def _shift(self, positions: torch.Tensor, local_start: torch.Tensor) -> torch.Tensor:
        """(R, n) float64 rotation of queries at ``positions`` (R, n) to where memory sits, for windows starting
        at ``local_start`` (R, 1)."""
        return self.m.query_shift(positions, local_start).to(torch.float64)

    def _gate_keys(self, held: torch.Tensor, sinks) -> torch.Tensor | None:
        """(R, W) bool: the window keys (positions ``held``) a gate measures against, past the sinks each row
        holds (``sinks()``: (R,) counts) where the gate leaves sinks out (``FoTLayer.kept`` on lcx's path); None:
        every key."""
        if self.m.gate_sinks:
            return None
        return held >= torch.as_tensor(sinks(), device=held.device)[:, None]

    def read(self, st, module, q, k, v, pos, scale):
        from lcx.plugins.fot.attention import memory_attention, row_entries

        d = st.data
        rings, slot, n = d["rings"], d["slot"], k.shape[1]
        rings.write(slot, pos, k, v)
        d["count"] += n
        if not q.shape[1]:  # ``replay``: the state only
            return q.new_zeros(q.shape[0], 0, v.shape[-1])
        # sinks are held at their own positions: causal and in a sliding layer's band as on lcx's path
        used = rings.rows(pos + n)
        keys, values, held = rings.k[slot, :, :used], rings.v[slot, :, :used], rings.pos[slot, :used]
        q_index = torch.arange(pos, pos + n, device=q.device)
        allowed = (held >= 0) & (held[None, :] <= q_index[:, None])  # (n, W): the window, causally
        near = self.in_band(module, held[None, :], q_index[:, None])
        if near is not None:
            allowed &= near
        memory = d["memory"]
        if memory is None or not row_entries(memory, 0, k.shape[0]):
            return sdpa(q, keys, values, allowed, scale)
        mask = torch.zeros(allowed.shape, device=q.device).masked_fill_(~allowed, float("-inf"))[None, None]
        shift = self._shift(q_index[None], torch.tensor([[d["local_start"]]], device=q.device))
        out = memory_attention(q[None], keys[None], values[None], mask, memory, shift, self.inv_freq(module), scale,
                               self.m.k, self.m.dense, self.m.block, self.m.gate_logit,
                               self.m.head_mask(module.config, int(module.layer_idx), q.device),
                               self._gate_keys(held, lambda: [d["sink_k"].shape[1]]))
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
        col = rings.front + pos % rings.width
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
        used = rings.rows(max(p for _, _, p in batch) + 1)  # sinks included; empty rows are held at -1: hidden
        keys, values, held = keys[:, :, :used], values[:, :, :used], held[:, :used]
        R, (H, _, D), Hkv = keys.shape[0], query.shape, keys.shape[1]
        G = H // Hkv
        q = query.new_zeros(R, H, D)
        q[sel] = query[:, rows].transpose(0, 1)
        q = q.view(R, Hkv, G, D)
        at = pos.new_zeros(R).index_copy_(0, sel, pos)[:, None]
        allowed = (held >= 0) & (held <= at)  # (R, W): causal
        near = self.in_band(module, held, at)
        if near is not None:
            allowed &= near
        allowed[sel.new_ones(R, dtype=torch.bool).index_fill_(0, sel, False)] = True  # riders: any keys, no NaN
        memories = [d["memory"] for d in states]
        sizes = [row_entries(m, 0, Hkv) if m is not None else 0 for m in memories]
        found = []  # per request of the batch: its memory's top-k scores and values, None when it is empty
        if any(sizes):
            local_start = torch.tensor([[d["local_start"]] for d in states], device=dev)
            q_rel = rotate(q[sel].float(), self._shift(pos[:, None], local_start)[..., None], self.inv_freq(module))
            found = [row_search(m, 0, q_rel[i], self.m.k, False, query.dtype) if n else None
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
            heads = self.m.head_mask(module.config, int(module.layer_idx), dev)
            if heads is not None:  # the other heads read their local keys only
                mem.masked_fill_(~heads.view(Hkv, G)[None, ..., None], float("-inf"))
            kl, vl = keys.float(), values.float()
            local = torch.matmul(q.float(), kl.transpose(-1, -2)).mul_(scale)
            local.masked_fill_(~allowed[:, None, None, :], float("-inf"))
            ref = self._gate_keys(held, lambda: pos.new_zeros(R).index_copy_(
                0, sel, torch.tensor([d["sink_k"].shape[1] for d in states], device=dev)))
            o = joint_softmax(local, vl, mem * scale, mv, False, self.m.gate_logit,
                              None if ref is None else ref[:, None, None], inplace=True)
        out[rows] = o[sel].reshape(len(batch), H, -1).to(out.dtype)
