"""streaming: attention sinks + a recent window (StreamingLLM, Xiao et al. 2023).

The memory is a cache that keeps the first ``sinks`` tokens and the last
``window`` tokens of every layer.  Keys arrive already rotated at their true
positions; the recent block is contiguous with the queries, so only the sink
keys need moving: they are re-rotated to sit right before the recent block
(RoPE rotations compose, R(a) R(b) = R(a + b)), which keeps every query-key
distance inside the trained window.  The attention stage slices the full
logical mask down to the kept keys, so padding still works.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from lcx.adapters import families
from lcx.adapters.rotary import rotate
from lcx.errors import LcxError
from lcx.hookspecs import hookimpl
from lcx.masking import SubsetCacheLayer, visible_mask
from lcx.method import Method, option
from lcx.plan import Plan


class SinkWindowLayer(SubsetCacheLayer):
    """Per-layer cache: ``sinks`` first tokens + ``window`` most recent tokens."""

    def __init__(self, sinks: int, window: int, inv_freq: torch.Tensor) -> None:
        super().__init__()
        self.sinks, self.window, self.inv_freq = sinks, window, inv_freq
        #: After each update: (number of sink keys, absolute position of the first non-sink key returned).
        self.visible: tuple[int, int] = (0, 0)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        empty = key_states[:, :, :0]
        self.sink_k, self.sink_v = empty, value_states[:, :, :0]
        self.keys, self.values = empty, value_states[:, :, :0]
        self.evicted = False  # until the first eviction the sinks stay the front of one buffer: no copy per update
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        if not self.evicted:  # keys are positions [0, S): returned as held, as a plain cache does
            ns = min(self.sinks, self.keys.shape[-2])
            self.visible = (ns, ns)
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            out_k, out_v = self.keys, self.values
            if self.keys.shape[-2] > self.sinks + self.window:  # later tokens see the sinks and the window only
                self.evicted = True
                self.sink_k, self.sink_v = self.keys[:, :, :self.sinks].clone(), self.values[:, :, :self.sinks].clone()
                self.keys, self.values = self.keys[:, :, -self.window:], self.values[:, :, -self.window:]
            return out_k, out_v
        ns = self.sink_k.shape[-2]
        recent_start = self.cumulative_length - key_states.shape[-2] - self.keys.shape[-2]  # the first recent key
        rest_k = torch.cat([self.keys, key_states], dim=-2)  # (B, H, S_rest, D), contiguous from recent_start
        rest_v = torch.cat([self.values, value_states], dim=-2)
        self.visible = (ns, recent_start)
        shift = recent_start - ns
        sink_k = rotate(self.sink_k, shift, self.inv_freq) if shift and ns else self.sink_k
        out_k = torch.cat([sink_k, rest_k], dim=-2)
        out_v = torch.cat([self.sink_v, rest_v], dim=-2)
        self.keys, self.values = rest_k[:, :, -self.window:], rest_v[:, :, -self.window:]
        return out_k, out_v

    def _reset_state(self) -> None:
        self.visible = (0, 0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for name in ("sink_k", "sink_v", "keys", "values"):
            setattr(self, name, getattr(self, name).index_select(0, beam_idx.to(self.device)))


@dataclass
class Streaming(Method):
    name = "streaming"
    description = "attention sinks + recent window with re-rotated keys (StreamingLLM)"
    requires = frozenset({"attention_interface", "rotary"})
    #: vLLM serves it inside its attention (lcx.integrations.vllm.attention), same answers as this path.
    serving = "attention"
    reads_past_window = True

    sinks: int = option(4, "number of initial tokens always kept (attention sinks)")
    window: int = option(0, "recent tokens kept per layer; 0 = model window - sinks - chunk")
    chunk: int = option(512, "prompt tokens ingested per forward pass")

    def __post_init__(self) -> None:
        for k in ("sinks", "window"):
            if getattr(self, k) < 0:
                raise ValueError(f"{k} must be >= 0, got {getattr(self, k)}")
        if self.chunk <= 0:
            raise ValueError(f"chunk must be > 0, got {self.chunk}")

    def served_attention(self) -> type:
        from lcx.plugins.streaming.served import StreamingServed

        return StreamingServed

    def resolved(self, config: dict) -> dict:
        return {"window": self.recent_for(families.json_window(config))}

    def recent(self, run) -> int:
        return self.recent_for(run.window)

    def recent_for(self, window: int) -> int:
        """Recent tokens kept per layer, for a model whose trained window is ``window``."""
        w = self.window or window - self.sinks - self.chunk
        if w <= 0:
            room = window - self.sinks - 1  # the largest chunk that leaves a one-token recent window
            fix = (f"use -o streaming.chunk={min(room, max(1, window // 4))} or less" if room >= 1 else
                   f"lower -o streaming.sinks below {window - 1}")
            raise LcxError(f"streaming: sinks={self.sinks} + chunk={self.chunk} leave no recent window in the model's "
                           f"window ({window}); {fix}, or set the recent window with -o streaming.window=N")
        return w

    def reusable_prefix(self) -> bool:
        return True  # sinks and window live in the cache

    def reach(self, run, tokens: int, new: int, span: tuple[int, int]) -> tuple[bool, str]:
        recent, back = self.recent(run), tokens - span[0]
        if span[1] <= self.sinks or back <= recent:
            return True, f"keeps {self.sinks} sink tokens and the last {recent:,}: the key was among them"
        return False, (f"keeps {self.sinks} sink tokens and the last {recent:,}: the key, {back:,} tokens from the end, "
                       "was evicted before the question (it forgets the middle by design)")

    def forward_shapes(self, run, tokens: int) -> list[tuple[int, int, int]]:
        q = min(tokens, self.chunk)
        return [(1, q, self.cache_tokens(run, tokens))]

    def cache_tokens(self, run, tokens: int) -> int:
        """The sinks and the recent window, plus the chunk being ingested (every token for options that
        leave no recent window: the estimate is not where they are refused)."""
        try:
            recent = self.recent(run)
        except LcxError:
            return tokens
        return min(tokens, self.sinks + recent + self.chunk)

    @hookimpl
    def lcx_plan(self, run, input_ids, attention_mask, max_new_tokens):
        padded = attention_mask is not None and not bool(attention_mask.all())
        kept = self.sinks + self.recent(run) if padded else 0
        if padded and input_ids.shape[1] + max_new_tokens > kept:
            # the sinks are the batch's first positions: padding in a left-padded row, which then evicts with none
            raise LcxError(f"streaming: a left-padded batch of {input_ids.shape[1]} + {max_new_tokens} tokens evicts "
                           f"(it keeps {kept}), and its padded rows would have no attention sinks; give inputs of "
                           f"equal length, or one at a time")
        return Plan.chunked(input_ids, attention_mask, self.chunk)

    @hookimpl
    def lcx_memory(self, run, batch_size):
        recent = self.recent(run)
        # a sliding-window layer's queries see at most band - 1 earlier keys (never the sinks, once past the band)
        return Cache(layers=[
            SinkWindowLayer(self.sinks, min(recent, max(band - 1, 1)) if band else recent,
                            families.rotary_inv_freq(run.model, run.family, i))
            for i, band in enumerate(families.sliding_windows(run.model, run.family))
        ])

    @hookimpl
    def lcx_attention(self, run, module, query, key, value, attention_mask, kwargs):
        cache = run.memory
        layer = cache.layers[module.layer_idx] if isinstance(cache, Cache) else None
        if not isinstance(layer, SinkWindowLayer):
            return None
        ns, recent_start = layer.visible
        if recent_start == ns:  # nothing evicted: keys are positions [0, S), the mask fits as is
            return None
        S, T = key.shape[-2], query.shape[-2]
        runs = [(0, ns), (recent_start, recent_start + S - ns)]
        mask = visible_mask(attention_mask, runs, recent_start + S - ns, T, run.base_impl, query.dtype, query.device)
        return run.base_attention(module, query, key, value, mask, **kwargs)
