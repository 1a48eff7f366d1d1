"""Memory methods inside vLLM's attention: ``streaming`` served with the answers of lcx's own path.

vLLM's Transformers backend (``--model-impl transformers``) runs the model's Hugging Face modeling code
and calls the attention function registered as ``"vllm"`` with every scheduled token of every request
flattened into one sequence (query ``[1, heads, tokens, head_dim]``, keys already rotated at their true
positions).  ``install`` wraps that function: for a served ``streaming`` model it answers from its own
per-request, per-layer state instead of vLLM's paged cache, reproducing lcx's ``SinkWindowLayer``
exactly:

- the prompt is read in updates of ``chunk`` tokens on the grid 0, C, 2C, ... and each generated token
  is an update of its own (what ``lcx generate`` does); vLLM's own prefill chunks may cut an update
  anywhere: the tokens of an update read so far wait in the state until it completes;
- a query of update [a, b) sees the sink keys (the first ``sinks`` tokens, re-rotated to sit right
  before the recent block), the last ``window`` non-sink tokens before a, and the update's tokens up
  to itself; when the update completes, the state keeps the sinks and the last ``window`` tokens.

Per-request state is keyed by the request's first KV block (unique among running requests while
prefix caching is off, which ``lcx serve`` ensures); a request's first step (position 0) starts afresh,
and the state of a request not scheduled for ``STALE_STEPS`` forward passes is dropped.

A step that carries one token of a request is read as a generated token, several as prompt tokens: the
worker does not see where a prompt ends.  So when vLLM's scheduler splits a prompt and leaves exactly
one token for the next step, that token closes the prompt's last update early (it sees the same keys
except the ones the early eviction drops); ``lcx serve`` schedules ``max_model_len`` tokens per step,
so a prompt is split only when concurrent prompts share a step's budget.  A request vLLM preempts and
recomputes is read as a fresh prompt.  vLLM still allocates its paged cache for every token (unused).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from lcx.adapters.rotary import rotate

#: A request's state is dropped when it has not been scheduled for this many forward passes.
STALE_STEPS = 512


@dataclass
class _Layer:
    """One request, one layer: what ``SinkWindowLayer`` holds, plus the update being read."""

    sink_k: torch.Tensor
    sink_v: torch.Tensor
    keys: torch.Tensor  # the recent block: last <= window non-sink tokens before the update
    values: torch.Tensor
    pend_k: torch.Tensor  # tokens of the current update read so far
    pend_v: torch.Tensor
    start: int = 0  # absolute position of the current update's first token
    end: int = 0  # absolute position where the current update ends (exclusive)


@dataclass
class _Request:
    layers: dict[int, _Layer] = field(default_factory=dict)
    last_step: int = 0


@dataclass
class Seq:
    """One request's tokens in a forward pass: its key, the first token's position, how many tokens."""

    key: Any
    start: int
    length: int


class StreamingServed:
    """lcx's streaming (sinks + recent window, re-rotated sinks) over vLLM's flattened token batches."""

    def __init__(self, sinks: int, window: int, chunk: int) -> None:
        self.sinks, self.window, self.chunk = sinks, window, chunk
        self.requests: dict[Any, _Request] = {}
        self.step = 0
        self._inv: dict[int, torch.Tensor] = {}

    def begin_step(self) -> None:
        self.step += 1
        stale = [k for k, r in self.requests.items() if self.step - r.last_step > STALE_STEPS]
        for k in stale:
            del self.requests[k]

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
        at = 0
        for s in seqs:
            req = self.requests.get(s.key)
            if req is None:
                if s.start:
                    raise RuntimeError(f"lcx streaming: no state for a request continuing at position {s.start} "
                                       f"(its earlier tokens were never seen; prefix caching must be off)")
                req = self.requests[s.key] = _Request()
            if s.start == 0:  # a new request (first block reused, or recomputed after preemption): start afresh
                req.layers.pop(layer_idx, None)
            req.last_step = self.step
            sl = slice(at, at + s.length)
            out[sl] = self._sequence(req, layer_idx, module, query[0, :, sl], key[0, :, sl], value[0, :, sl], s,
                                     scale).transpose(0, 1)
            at += s.length
        return out.reshape(out.shape[0], -1)

    def _sequence(self, req: _Request, layer_idx: int, module, q, k, v, s: Seq, scale: float) -> torch.Tensor:
        st = req.layers.get(layer_idx)
        if st is None:
            empty_k, empty_v = k[:, :0], v[:, :0]
            st = req.layers[layer_idx] = _Layer(empty_k, empty_v, empty_k, empty_v, empty_k, empty_v)
        if s.length == 1:  # a generated token: an update of its own (it ends the prompt's last update)
            self._complete(st)
            st.start, st.end = s.start, s.start + 1
        outs, pos, i = [], s.start, 0
        while i < s.length:
            if pos >= st.end:  # a prompt update starts here, on the grid
                self._complete(st)
                st.start, st.end = pos, (pos // self.chunk + 1) * self.chunk
            n = min(s.length - i, st.end - pos)
            outs.append(self._read(st, module, q[:, i:i + n], k[:, i:i + n], v[:, i:i + n], scale))
            pos, i = pos + n, i + n
        return torch.cat(outs, dim=1)

    def _complete(self, st: _Layer) -> None:
        """The update is over: fill the sinks first (only before any eviction), keep the last window."""
        if not st.pend_k.shape[1]:
            return
        rest_k, rest_v = torch.cat([st.keys, st.pend_k], dim=1), torch.cat([st.values, st.pend_v], dim=1)
        ns = st.sink_k.shape[1]
        if ns < self.sinks:
            take = min(self.sinks - ns, rest_k.shape[1])
            st.sink_k, st.sink_v = torch.cat([st.sink_k, rest_k[:, :take]], 1), torch.cat([st.sink_v, rest_v[:, :take]], 1)
            rest_k, rest_v = rest_k[:, take:], rest_v[:, take:]
        st.keys, st.values = rest_k[:, -self.window:], rest_v[:, -self.window:]
        st.pend_k, st.pend_v = st.pend_k[:, :0], st.pend_v[:, :0]

    def _read(self, st: _Layer, module, q, k, v, scale: float) -> torch.Tensor:
        """The next n queries of the current update: sinks + recent + the update's tokens up to each."""
        st.pend_k, st.pend_v = torch.cat([st.pend_k, k], dim=1), torch.cat([st.pend_v, v], dim=1)
        ns, nr, npend = st.sink_k.shape[1], st.keys.shape[1], st.pend_k.shape[1]
        recent_start = st.start - nr
        shift = recent_start - ns
        sink_k = rotate(st.sink_k, shift, self.inv_freq(module)) if shift and ns else st.sink_k
        keys = torch.cat([sink_k, st.keys, st.pend_k], dim=1)
        values = torch.cat([st.sink_v, st.values, st.pend_v], dim=1)
        n = q.shape[1]
        # causal within the update: query j (of n, the last n of the pending tokens) sees pending tokens <= it
        fixed = ns + nr
        allowed = torch.ones(n, keys.shape[1], dtype=torch.bool, device=q.device)
        allowed[:, fixed:] = torch.arange(npend, device=q.device)[None] <= torch.arange(npend - n, npend, device=q.device)[:, None]
        groups = q.shape[0] // keys.shape[0]
        keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
        return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=allowed, scale=scale)[0]


# ---------------------------------------------------------------------- vLLM glue
#: The served memory method (set by ``install`` from ``LCX_SERVED_MODEL``), or None.
SERVED: StreamingServed | None = None


def served_from_env() -> StreamingServed | None:
    from lcx.integrations.vllm_requests import MODEL_ENV
    from lcx.registry import registry

    info = json.loads(os.environ.get(MODEL_ENV) or "{}")
    spec = info.get("attention")
    if not spec:
        return None
    m = registry().get(spec["name"]).from_options(**(spec.get("options") or {}))
    window = m.window or int(info["window"]) - m.sinks - m.chunk
    return StreamingServed(m.sinks, window, m.chunk)


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

        self_attn = getattr(module, "attn")
        md = get_forward_context().attn_metadata
        if isinstance(md, dict):
            md = md.get(self_attn.layer_name)
        if md is None:  # vLLM's warm-up and profiling passes
            return base(module, query, key, value, attention_mask, **kwargs)
        if int(module.layer_idx) == 0:
            SERVED.begin_step()
        lens = md.seq_lens.tolist()
        starts = md.query_start_loc[:len(lens) + 1].tolist()
        seqs = []
        for i, total in enumerate(lens):
            n = starts[i + 1] - starts[i]
            if n:
                seqs.append(Seq(key=int(md.block_table[i, 0]), start=int(total) - n, length=n))
        return SERVED.attend(module, query, key, value, seqs), None

    lcx_attention._lcx = True  # type: ignore[attr-defined]
    ALL_ATTENTION_FUNCTIONS["vllm"] = lcx_attention
    print(f"lcx: streaming answers vLLM's attention in process {os.getpid()} (sinks={SERVED.sinks}, "
          f"window={SERVED.window}, chunk={SERVED.chunk})", file=sys.stderr, flush=True)
