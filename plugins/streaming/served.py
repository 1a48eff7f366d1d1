"""streaming served inside vLLM's attention (``lcx serve --method streaming``): a query sees the sink keys
(re-rotated to sit right before the recent block), the last ``window`` non-sink tokens before its update, and its
update's tokens up to itself; at the update's end the state keeps the sinks and the last ``window`` tokens, as
``SinkWindowLayer`` does on lcx's own path."""

from __future__ import annotations

import torch

from lcx.adapters import families
from lcx.adapters.rotary import rotate
from lcx.integrations.vllm.attention import (WINDOW_SLACK, ServedAttention, Window, causal_tail, head_dims, kv_bytes,
                                             sdpa, sdpa_bytes)


class StreamingServed(ServedAttention):
    """lcx's streaming: sinks + recent window, sinks re-rotated (``SinkWindowLayer``).  A layer's recent
    keys and the current update's ("pending") share one ``Window``, with room before them for the
    re-rotated sinks: a read copies the sinks and the new keys, never the window."""

    name = "streaming"
    prefix_cache = True

    def __init__(self, sinks: int, window: int, chunk: int) -> None:
        super().__init__(chunk)
        self.sinks, self.window = sinks, window

    @classmethod
    def from_method(cls, method, context):
        return cls(method.sinks, method.recent_for(context.window), method.chunk)

    @classmethod
    def request_bytes(cls, method, config, window, max_model_len):
        """Sinks + the recent window + one update per layer, in ``Window`` buffers with their spare rows."""
        recent = method.recent_for(window) + method.chunk
        return int(config["num_hidden_layers"]) * (2 * method.sinks + int(recent * (1 + WINDOW_SLACK)) + 16) \
            * kv_bytes(config)

    @classmethod
    def step_bytes(cls, method, config, window, max_model_len, memory):
        """One update's read (a chunk of queries over the sinks, the recent window and the update): its causal
        and band masks, the re-rotated sinks, ``sdpa``'s and the update's output."""
        heads, kv, dim = head_dims(config)
        n = method.chunk
        keys = method.sinks + method.recent_for(window) + n
        return 4 * n * keys + 16 * keys + 3 * kv * method.sinks * dim * 4 + sdpa_bytes(heads, kv, n, keys, dim) \
            + heads * n * dim * 4

    def begin(self, st, module, start, end, like):
        super().begin(st, module, start, end, like)
        if not st.data:
            st.data.update(sink_k=like[:, :0], sink_v=like[:, :0], keys=Window(like, self.sinks),
                           values=Window(like, self.sinks), pending=0)

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
        allowed = causal_tail(q.shape[1], keys.shape[1], q.device)
        if families.layer_window(module, module.config):  # the layer's band over the true positions, sinks' included
            dev = q.device
            held = torch.cat([torch.arange(ns, device=dev),
                              torch.arange(st.start - nr, st.start - nr + keys.shape[1] - ns, device=dev)])
            near = self.in_band(module, held[None, :], torch.arange(pos, pos + q.shape[1], device=dev)[:, None])
            allowed = near if allowed is None else allowed & near
        return sdpa(q, keys, values, allowed, scale)
