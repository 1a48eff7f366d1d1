"""focusllm served inside vLLM's attention, for ``topk`` (without it, lcx's KV connector serves focusllm on vLLM's
own model code, ``serves_prefix_kv``).  lcx's request middleware computed a prompt's candidates on lcx's own path
(``FocusLLM.serve_request``) and rewrote the prompt to [placeholders ; local tokens]; the request's tensors arrive
by id (``Seq.state``) and every layer keeps the candidates' keys/values in the placeholders' stead."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

from lcx.integrations.vllm.attention import (MASK_BYTES, WINDOW_SLACK, ServedAttention, Window, block_bytes,
                                             causal_tail, head_dims, kv_bytes, query_blocks, sdpa,
                                             sdpa_bytes)
from lcx.integrations.vllm.middleware import state_file
from lcx.plugins.focusllm.attention import topk_keep


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

    @classmethod
    def from_method(cls, method, context):
        return cls(context.spool, method.topk)

    @classmethod
    def request_bytes(cls, method, config, window, max_model_len):
        """Every token vLLM reads (the rewritten prompt, within the model's window), and the candidates' float32
        keys/values lcx's middleware computed, held until the request ends: one per placeholder, at most the
        rewritten prompt less its local tokens."""
        n = min(window, max_model_len)
        held = int(n * (1 + WINDOW_SLACK)) + 16 + max(0, n - method.local)
        return int(config["num_hidden_layers"]) * held * kv_bytes(config)

    @classmethod
    def step_bytes(cls, method, config, window, max_model_len, memory):
        """A whole prompt read in one step (vLLM's batch holds up to --max-model-len tokens): its causal mask,
        the candidates' keys/values put in the placeholders' stead (and in float32 for their scores), and what
        ``sdpa`` holds (a piece with no more candidates than ``topk``; its outputs included) or a block of
        ``topk_sdpa``'s queries beside the blocks' outputs and their concatenation."""
        heads, kv, dim = head_dims(config)
        n = min(window, max_model_len)
        candidates = max(0, n - method.local)
        read = sdpa_bytes(heads, kv, n, n, dim)
        if candidates > method.topk:
            read = max(read, block_bytes(n, topk_row_bytes(heads, n, candidates, method.topk, dim))
                       + 2 * heads * n * dim * 4)
        return n * n + read + 7 * kv * n * dim * 4

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
            st.data.update(keys=Window(like), values=Window(like))

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
        allowed = causal_tail(q.shape[1], keys.shape[1], q.device)
        if self.topk and n > self.topk:
            return topk_sdpa(q, keys, values, allowed, n, self.topk, scale)
        return sdpa(q, keys, values, allowed, scale)


def topk_sdpa(q, keys, values, allowed, n, k, scale):
    """``sdpa`` with each query head's candidate columns (keys ``0..n-1``) cut to its ``k`` highest q.k
    scores: the mask differs per head, (H, rows, S) for each block of query rows."""
    (H, nq, D), S = q.shape, keys.shape[1]
    n = min(n, S)  # a prompt piece may end before the last placeholder
    if n <= k:  # every candidate is among its heads' best k
        return sdpa(q, keys, values, allowed, scale)
    return torch.cat([_topk_block(q[:, b], keys, values, None if allowed is None else allowed[b], n, k, scale)
                      for b in query_blocks(nq, topk_row_bytes(H, S, n, k, D))], dim=1)


def _topk_block(q, keys, values, allowed, n, k, scale):
    (H, rows, D), (Hkv, S) = q.shape, keys.shape[:2]
    keep = topk_keep(q.reshape(Hkv, H // Hkv, rows, D), keys[:, :n], k).reshape(H, rows, n)
    base = torch.ones(rows, S, dtype=torch.bool, device=q.device) if allowed is None else allowed
    mask = base.expand(H, rows, S).clone()
    mask[..., :n] &= keep
    del keep
    return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask[None], scale=scale,
                                          enable_gqa=True)[0]


def topk_row_bytes(heads: int, keys: int, candidates: int, k: int, head_dim: int) -> int:
    """The most ``topk_sdpa`` holds at once per query row: each head's query in float32, its float32 candidate
    scores, their top ``k`` (values and indices) and the kept ones; then its mask, as a bool and in the query's
    dtype (float32 at most), beside the row it starts from, and SDPA's softmax statistics."""
    return heads * max(head_dim * 4 + candidates * (4 + 1) + k * (4 + 8), keys * MASK_BYTES + 4) + keys


# ---------------------------------------------------------------------- vLLM glue
