"""focusllm's candidates into vLLM's own KV cache: a KV connector, so that vLLM serves focusllm on its native
model code and attention kernel.

lcx's request middleware computes a request's candidates on lcx's own path (``FocusLLM.serve_request``),
spools their per-layer keys/values (already rotated at positions ``0..n-1``) and rewrites the prompt to
[``n`` placeholders ; local tokens] (``lcx.integrations.vllm_requests``).  The candidates are a fixed prefix
of keys and values, which is what vLLM's KV connectors load: this one tells vLLM's scheduler that the first
``n`` prompt tokens of such a request are already computed, and its worker half writes the spooled keys and
values into the blocks vLLM allocated for them, with the attention backend's own cache-update op, before
the forward that computes the local tokens.  From there on vLLM's attention reads [candidates ; local
tokens ; generated tokens] from its paged cache: the same keys lcx's ``CandidateLayer`` gives its frozen
decoder, so the tokens equal ``lcx generate -o focusllm.refresh=0``'s (tests/serve/test_focusllm.py).

Why this and not lcx's served attention (``vllm_attention.FocusServed``, which still serves focusllm with
``topk``): measured on 2 cores (BENCHMARKS.md, focusllm), a decode step of 8 such requests takes ~57 ms on
vLLM's native Llama against 114-166 ms on its Transformers backend under lcx's attention; 8 requests of 4K
tokens with 1,024 new tokens each took 139.8 s against 246.0 s.

Each request's state id comes from its ``extra_args`` (the middleware's ``vllm_xargs``); the scheduler half
deletes the request's file when vLLM reports it finished (a request recomputed after a preemption loads its
candidates again).  Prefix caching stays off: every request's placeholders are the same token ids.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from lcx.integrations.vllm_requests import MODEL_ENV, STATE_ARG, state_file

_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass
class _Load:
    state: str
    slots: list[int]  # the cache slot of each candidate position 0..n-1


@dataclass
class CandidateLoads(KVConnectorMetadata):
    """What the worker loads in a step: one entry per request whose prompt starts in it."""

    loads: list[_Load] = field(default_factory=list)


class LcxCandidates(KVConnectorBase_V1):
    """``--kv-transfer-config '{"kv_connector": "LcxCandidates", "kv_connector_module_path":
    "lcx.integrations.vllm_connector", "kv_role": "kv_both"}'`` (``lcx serve`` passes it for focusllm)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        spool = json.loads(os.environ.get(MODEL_ENV) or "{}").get("spool")
        if not spool:
            raise RuntimeError(f"lcx's KV connector needs the server's spool folder ({MODEL_ENV}); start the "
                               f"server with `lcx serve`")
        self.spool = Path(spool)
        self.block_size = int(vllm_config.cache_config.block_size)
        self._known: dict[str, tuple[str, int]] = {}  # request id -> (state, n), from its first query to its end
        self._pending: set[str] = set()  # request ids allocated, not yet loaded
        if role == KVConnectorRole.WORKER:
            print(f"lcx: focusllm's candidates reach vLLM's KV cache through lcx's KV connector, process "
                  f"{os.getpid()}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ scheduler side
    @staticmethod
    def _state(request: Any) -> str | None:
        return (getattr(request.sampling_params, "extra_args", None) or {}).get(STATE_ARG)

    def _candidates(self, request: Any) -> tuple[str, int] | None:
        """The request's state id and number of candidates (read from its file's header once: vLLM asks again
        at every step a request waits for blocks); None for a prompt read as it is."""
        rid, state = request.request_id, self._state(request)
        if state is None:  # a prompt of at most `local` tokens: computed as it is
            return None
        path = state_file(self.spool, state)
        if not path.exists():
            raise RuntimeError(f"lcx focusllm: the candidates of request {rid} ({path}) are gone")
        if rid not in self._known:
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                n = int(f.get_slice("0.k").get_shape()[1])  # (Hkv, n, D)
            if n >= len(request.prompt_token_ids or ()):
                raise RuntimeError(f"lcx focusllm: request {rid} has {n} candidates and no local token")
            self._known[rid] = (state, n)
        return self._known[rid]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        found = self._candidates(request)
        if found is None:
            return 0, False
        self._pending.add(request.request_id)
        return max(0, found[1] - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            self._pending.discard(request.request_id)

    def _slots(self, block_ids: list[int], n: int) -> list[int]:
        return [block_ids[p // self.block_size] * self.block_size + p % self.block_size for p in range(n)]

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = CandidateLoads()
        for req in scheduler_output.scheduled_new_reqs:
            if req.req_id in self._pending:
                self._pending.discard(req.req_id)
                state, n = self._known[req.req_id]
                meta.loads.append(_Load(state, self._slots(list(req.block_ids[0]), n)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):  # resumed after a preemption: its blocks are all new
            if req_id in self._pending and req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                self._pending.discard(req_id)
                state, n = self._known[req_id]
                meta.loads.append(_Load(state, self._slots(list(cached.new_block_ids[i][0]), n)))
                print(f"lcx: request {req_id} resumed after a preemption: its {n} candidates are loaded again",
                      file=sys.stderr, flush=True)
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.discard(request.request_id)
        self._known.pop(request.request_id, None)
        state = self._state(request)
        if state is not None:
            state_file(self.spool, state).unlink(missing_ok=True)
        return False, None

    # ------------------------------------------------------------------ worker side
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, CandidateLoads) or not meta.loads or forward_context.attn_metadata is None:
            return
        from safetensors.torch import load_file

        for load in meta.loads:
            path = state_file(self.spool, load.state)
            if not path.exists():
                raise RuntimeError(f"lcx focusllm: the candidates of this request ({path}) are gone")
            cand, loaded = load_file(str(path)), 0
            for name, layer in forward_context.no_compile_layers.items():
                cache = getattr(layer, "kv_cache", None)
                found = _LAYER.search(name)
                if cache is None or not isinstance(cache, torch.Tensor) or not cache.numel() or found is None:
                    continue
                i = int(found.group(1))
                slots = torch.tensor(load.slots, dtype=torch.long, device=cache.device)
                k = cand[f"{i}.k"].transpose(0, 1).to(cache.device, cache.dtype).contiguous()  # (n, Hkv, D)
                v = cand[f"{i}.v"].transpose(0, 1).to(cache.device, cache.dtype).contiguous()
                layer.impl.do_kv_cache_update(layer, k, v, cache, slots)
                loaded += 1
            if loaded != len(cand) // 2:  # a layer left out would read placeholders' keys: wrong answers, no error
                raise RuntimeError(f"lcx focusllm: candidates of {len(cand) // 2} layers, written into {loaded} "
                                   f"of vLLM's attention layers")

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

