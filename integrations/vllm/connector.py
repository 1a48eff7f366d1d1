"""focusllm's candidates into vLLM's own KV cache: a KV connector, so that vLLM serves focusllm on its native
model code and attention kernel.

lcx's request middleware computes a request's candidates (``FocusLLM.serve_request``; training-free, their
chunk forwards run on vLLM's engine, see below), spools their per-layer keys/values (already rotated at
positions ``0..n-1``) and rewrites the prompt to [``n`` placeholders ; local tokens]
(``lcx.integrations.vllm.middleware``).  The candidates are a fixed prefix
of keys and values, which is what vLLM's KV connectors load: this one tells vLLM's scheduler that the first
``n`` prompt tokens of such a request are already computed, and its worker half writes the spooled keys and
values into the blocks vLLM allocated for them, with the attention backend's own cache-update op, before
the forward that computes the local tokens.  From there on vLLM's attention reads [candidates ; local
tokens ; generated tokens] from its paged cache: the same keys lcx's ``CandidateLayer`` gives its frozen
decoder, so the tokens equal ``lcx generate -o focusllm.refresh=0``'s (tests/serve/test_focusllm.py).

Why this and not lcx's served attention (``lcx.plugins.focusllm.served``, which still serves focusllm with
``topk``): vLLM's native model code decodes these requests about twice as fast as its Transformers backend
under lcx's attention (BENCHMARKS.md, focusllm).

Each request's state id comes from its ``extra_args`` (the middleware's ``vllm_xargs``); the scheduler half
deletes the request's file when vLLM reports it finished (a request recomputed after a preemption loads its
candidates again).  vLLM's prefix cache is on (the chunk forwards below share a document's blocks), and the
middleware gives each placeholder request a ``cache_salt`` of its own: every request's placeholders are the
same token ids, and their blocks hold that request's candidates only (a request resumed after a preemption
may find its own blocks again; it loads its candidates anew over them).

The candidates themselves (training-free: no candidate adapter) are computed by vLLM too: the middleware sends
each chunk's [chunk ; fragment] tokens to the engine as a one-token request whose ``extra_args`` name it
(``CHUNK_ARG``), and this connector saves the keys/values its last prompt position leaves in vLLM's cache,
per layer, to a file the middleware reads (``save_kv_layer``): the candidate ``candidate_kv`` computes, at the
engine's speed (vLLM's prefill is faster than the Hugging Face forward: BENCHMARKS.md).  The slot is read
through the backend's own cache-update op: ``CacheReader`` learns, once per cache shape, where that op puts
each key and value element (the CPU backend stores a block's keys transposed).
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

from lcx.integrations.vllm.paged_cache import CacheReader
from lcx.integrations.vllm.middleware import CHUNK_ARG, MODEL_ENV, STATE_ARG, chunk_file, state_file

_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass
class _Load:
    state: str
    slots: list[int]  # the cache slot of each candidate position 0..n-1


@dataclass
class _Save:
    chunk: str  # the chunk request's name (``CHUNK_ARG``)
    slot: int  # the cache slot of its last prompt position


@dataclass
class CandidateLoads(KVConnectorMetadata):
    """What the worker does in a step: loads, one per request whose prompt starts in it; saves, one per chunk
    request whose last prompt position is computed in it."""

    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)


class LcxCandidates(KVConnectorBase_V1):
    """``--kv-transfer-config '{"kv_connector": "LcxCandidates", "kv_connector_module_path":
    "lcx.integrations.vllm.connector", "kv_role": "kv_both"}'`` (``lcx serve`` passes it for focusllm)."""

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
        self._chunks: dict[str, tuple[str, int, list[int]]] = {}  # chunk request id -> (name, prompt length, blocks)
        self._readers: dict[tuple, CacheReader] = {}  # worker: per cache shape
        self._saved: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # worker: chunk -> layer -> (k, v)
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
        chunk = (getattr(request.sampling_params, "extra_args", None) or {}).get(CHUNK_ARG)
        if chunk is not None:  # a chunk forward: computed by vLLM, its last position saved (``build_connector_meta``)
            chunk_file(self.spool, chunk)  # refuses a malformed name
            if request.request_id not in self._chunks:
                self._chunks[request.request_id] = (chunk, len(request.prompt_token_ids or ()), [])
            return 0, False
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
        if not self._chunks:
            return meta
        steps = [(r.req_id, list(r.block_ids[0]), True, r.num_computed_tokens)
                 for r in scheduler_output.scheduled_new_reqs if r.req_id in self._chunks]
        steps += [(req_id, list(cached.new_block_ids[i][0]) if cached.new_block_ids[i] is not None else [],
                   req_id in cached.resumed_req_ids, cached.num_computed_tokens[i])
                  for i, req_id in enumerate(cached.req_ids) if req_id in self._chunks]
        for req_id, blocks, fresh, computed in steps:  # chunk forwards: save the step that computes the last position
            name, length, known = self._chunks[req_id]
            if fresh and known:
                print(f"lcx: chunk forward {req_id} resumed after a preemption: computed again", file=sys.stderr, flush=True)
            known = blocks if fresh else known + blocks  # a resumed request's blocks are all new
            self._chunks[req_id] = (name, length, known)
            if computed < length <= computed + scheduler_output.num_scheduled_tokens.get(req_id, 0):
                meta.saves.append(_Save(name, self._slots(known, length)[-1]))
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._chunks.pop(request.request_id, None)  # its file is the middleware's to read and delete
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
        meta = self._get_connector_metadata()
        found = _LAYER.search(layer_name)
        if not isinstance(meta, CandidateLoads) or not meta.saves or found is None:
            return
        from vllm.forward_context import get_forward_context

        layer = get_forward_context().no_compile_layers[layer_name]
        key = (tuple(kv_layer.shape[1:]), kv_layer.dtype, type(layer.impl).__name__)
        if key not in self._readers:
            try:
                self._readers[key] = CacheReader(layer, kv_layer, self.block_size)
                print(f"lcx: focusllm's chunk forwards run on vLLM's engine; lcx's KV connector saves their "
                      f"candidates (cache {tuple(kv_layer.shape)}, {type(layer.impl).__name__})", file=sys.stderr, flush=True)
            except Exception as e:  # noqa: BLE001 -- the engine serves on; the middleware computes them itself
                self._readers[key] = None
                print(f"lcx: lcx's KV connector cannot save focusllm's candidates from this cache ({e}); the "
                      f"middleware computes them on lcx's own path", file=sys.stderr, flush=True)
        reader = self._readers[key]
        for save in meta.saves if reader is not None else ():
            self._saved.setdefault(save.chunk, {})[int(found.group(1))] = reader.read(kv_layer, save.slot)

    def wait_for_save(self) -> None:
        """Writes each chunk request's keys/values (saved layer by layer in this step's forward) to its file,
        ``"{layer}.k"``/``"{layer}.v"`` of shape (H_kv, D), atomically: the middleware waits for the request to
        end, then reads it.  A chunk not saved from every layer gets no file (logged): the middleware then
        computes the candidates itself (``middleware.EngineSavedNothing``) and the engine serves on."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, CandidateLoads) or not meta.saves:
            return
        from safetensors.torch import save_file

        for save in meta.saves:
            layers = self._saved.pop(save.chunk, {})
            if not layers or sorted(layers) != list(range(len(layers))):
                print(f"lcx: focusllm chunk {save.chunk} was saved from layers {sorted(layers)[:8]}, not from every "
                      f"attention layer: not written", file=sys.stderr, flush=True)
                continue
            path = chunk_file(self.spool, save.chunk)
            tmp = path.with_name(f".{path.name}.tmp")
            tensors = {f"{i}.{part}": t.float().cpu().contiguous() for i, kv in layers.items()
                       for part, t in zip("kv", kv)}
            save_file(tensors, str(tmp))
            tmp.rename(path)

