"""band inside vLLM's attention: each request keeps its last ``width`` keys and values per layer."""

from __future__ import annotations

import torch

from lcx.integrations.vllm.attention import WINDOW_SLACK, ServedAttention, Window, kv_bytes, sdpa
from lcx_band_method import band


class BandServed(ServedAttention):
    name = "band"

    def __init__(self, width: int) -> None:
        super().__init__(1 << 40)  # no chunk grid: any piece of a prompt is read as it comes
        self.width = width

    @classmethod
    def from_method(cls, method, context):
        return cls(method.width)

    @classmethod
    def request_bytes(cls, method, config, window, max_model_len):
        """The kept keys plus one prefill piece (at most the whole prompt), with the buffer's spare rows."""
        return int(config["num_hidden_layers"]) * (int((method.width + max_model_len) * (1 + WINDOW_SLACK)) + 16) \
            * kv_bytes(config)

    def begin(self, st, module, start, end, like):
        super().begin(st, module, start, end, like)
        if not st.data:
            st.data.update(keys=Window(like), values=Window(like))

    def read(self, st, module, q, k, v, pos, scale):
        keys, values = st.data["keys"], st.data["values"]
        keys.append(k)
        values.append(v)
        n, held = k.shape[1], len(keys)
        allowed = band(torch.arange(pos, pos + n, device=q.device), torch.arange(pos + n - held, pos + n, device=q.device),
                       self.width)
        out = sdpa(q, keys.view(), values.view(), allowed, scale)
        over = len(keys) - self.width  # a later query reads the last `width` keys at most
        if over > 0:
            keys.drop_front(over)
            values.drop_front(over)
        return out
