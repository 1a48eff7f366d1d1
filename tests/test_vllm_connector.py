"""lcx's KV connector (`lcx.integrations.vllm_connector`), driven the way vLLM's scheduler and worker drive it,
with stand-ins for vLLM's requests, scheduler output and attention layers.  tests/serve/test_focusllm.py
checks it inside a real server (its tokens equal `lcx generate`'s)."""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from lcx.integrations.vllm_requests import MODEL_ENV, STATE_ARG

HKV, D, N, LAYERS, BLOCK = 3, 4, 5, 2, 4


@pytest.fixture
def spool(tmp_path, monkeypatch):
    monkeypatch.setenv(MODEL_ENV, json.dumps({"spool": str(tmp_path)}))
    return tmp_path


def _connector(role: str):
    from lcx.integrations.vllm_connector import KVConnectorRole, LcxCandidates

    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(), cache_config=SimpleNamespace(block_size=BLOCK))
    return LcxCandidates(config, getattr(KVConnectorRole, role))


def _state(spool) -> tuple[str, dict[str, torch.Tensor]]:
    state = uuid.uuid4().hex
    torch.manual_seed(0)
    cand = {f"{i}.{kv}": torch.randn(HKV, N, D) for i in range(LAYERS) for kv in "kv"}
    save_file(cand, str(spool / f"{state}.safetensors"))
    return state, cand


def _request(rid: str, state: str | None, prompt: int = N + 7):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(prompt)),
                           sampling_params=SimpleNamespace(extra_args={STATE_ARG: state} if state else None))


class _Layer:
    """An attention layer's cache (blocks * block size slots; a key and a value per slot) and the backend's
    cache-update op, as vLLM's CPU backend is called: key/value (tokens, KV heads, head dim), one slot each."""

    def __init__(self, blocks: int = 8) -> None:
        self.kv_cache = torch.zeros(blocks * BLOCK, 2, HKV, D)
        self.impl = SimpleNamespace(do_kv_cache_update=self._update)

    @staticmethod
    def _update(layer, key, value, cache, slots):
        cache[slots, 0], cache[slots, 1] = key, value


def test_the_scheduler_claims_the_candidates_and_the_worker_writes_them_into_their_slots(spool):
    state, cand = _state(spool)
    sched, worker = _connector("SCHEDULER"), _connector("WORKER")
    assert sched.get_num_new_matched_tokens(_request("a", state), 0) == (N, False)
    assert sched.get_num_new_matched_tokens(_request("b", None), 0) == (0, False)  # a short prompt: as it is
    sched.update_state_after_alloc(_request("a", state), None, N)
    new = [SimpleNamespace(req_id="a", block_ids=([6, 1],)), SimpleNamespace(req_id="b", block_ids=([0],))]
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[])
    meta = sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached))
    # positions 0..4 in blocks 6 then 1 of 4 slots each
    assert [(x.state, x.slots) for x in meta.loads] == [(state, [24, 25, 26, 27, 4])]
    assert not sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached)).loads

    layers = {f"model.layers.{i}.self_attn.attn": _Layer() for i in range(LAYERS)}
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(SimpleNamespace(attn_metadata={}, no_compile_layers={**layers, "model.norm": object()}))
    for i in range(LAYERS):
        cache = layers[f"model.layers.{i}.self_attn.attn"].kv_cache
        for p, slot in enumerate(meta.loads[0].slots):
            assert torch.equal(cache[slot, 0], cand[f"{i}.k"][:, p]) and torch.equal(cache[slot, 1], cand[f"{i}.v"][:, p])
        untouched = [s for s in range(cache.shape[0]) if s not in meta.loads[0].slots]
        assert not cache[untouched].any()

    sched.request_finished(_request("a", state), [6, 1])
    assert not (spool / f"{state}.safetensors").exists()  # deleted when vLLM reports the request finished


def test_a_request_resumed_after_a_preemption_loads_its_candidates_again_into_its_new_blocks(spool):
    state, _ = _state(spool)
    sched = _connector("SCHEDULER")
    assert sched.get_num_new_matched_tokens(_request("a", state), 0) == (N, False)
    sched.update_state_after_alloc(_request("a", state), None, N)
    cached = SimpleNamespace(req_ids=["a"], resumed_req_ids={"a"}, new_block_ids=[([3, 5],)])
    meta = sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached))
    assert [x.slots for x in meta.loads] == [[12, 13, 14, 15, 20]]


def test_a_load_that_misses_a_layer_or_its_file_fails_loudly(spool):
    """A layer left with the placeholders' keys would answer wrongly without a word: refused."""
    from lcx.integrations.vllm_connector import CandidateLoads, _Load

    state, _ = _state(spool)
    worker = _connector("WORKER")
    worker.bind_connector_metadata(CandidateLoads([_Load(state, list(range(N)))]))
    with pytest.raises(RuntimeError, match=f"candidates of {LAYERS} layers, written into 1"):
        worker.start_load_kv(SimpleNamespace(attn_metadata={}, no_compile_layers={"model.layers.0.attn": _Layer()}))
    (spool / f"{state}.safetensors").unlink()
    with pytest.raises(RuntimeError, match="are gone"):
        worker.start_load_kv(SimpleNamespace(attn_metadata={}, no_compile_layers={}))
    sched = _connector("SCHEDULER")
    with pytest.raises(RuntimeError, match="are gone"):
        sched.get_num_new_matched_tokens(_request("a", state), 0)
    with pytest.raises(RuntimeError, match="malformed request state id '../x'"):
        sched.get_num_new_matched_tokens(_request("a", "../x"), 0)


def test_without_the_spool_folder_the_connector_refuses_to_start(monkeypatch):
    monkeypatch.delenv(MODEL_ENV, raising=False)
    with pytest.raises(RuntimeError, match="spool folder"):
        _connector("WORKER")


def test_focusllm_is_served_by_the_connector_unless_topk_picks_candidates_per_head():
    from lcx.integrations.vllm_requests import prefix_kv

    assert prefix_kv({"name": "focusllm", "options": {"refresh": 0}})
    assert not prefix_kv({"name": "focusllm", "options": {"refresh": 0, "topk": 4}})
    assert not prefix_kv({"name": "fot", "options": {}}) and not prefix_kv(None)
