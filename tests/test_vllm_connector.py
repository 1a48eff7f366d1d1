"""lcx's KV connector (`lcx.integrations.vllm.connector`), driven the way vLLM's scheduler and worker drive it,
with stand-ins for vLLM's requests, scheduler output and attention layers.  tests/serve/test_focusllm.py
checks it inside a real server (its tokens equal `lcx generate`'s)."""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from lcx.integrations.vllm.middleware import CHUNK_ARG, MODEL_ENV, STATE_ARG

HKV, D, N, LAYERS, BLOCK = 3, 4, 5, 2, 4


@pytest.fixture
def spool(tmp_path, monkeypatch):
    monkeypatch.setenv(MODEL_ENV, json.dumps({"spool": str(tmp_path)}))
    return tmp_path


def _connector(role: str, block: int = BLOCK):
    from lcx.integrations.vllm.connector import KVConnectorRole, LcxCandidates

    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(), cache_config=SimpleNamespace(block_size=block))
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
    from lcx.integrations.vllm.connector import CandidateLoads, _Load

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
    from lcx.integrations.vllm.middleware import prefix_kv

    assert prefix_kv({"name": "focusllm", "options": {"refresh": 0}})
    assert not prefix_kv({"name": "focusllm", "options": {"refresh": 0, "topk": 4}})
    assert not prefix_kv({"name": "fot", "options": {}}) and not prefix_kv(None)


# ---------------------------------------------------------------------- chunk forwards run by the engine
CPU_BLOCK, CPU_D = 32, 64  # the CPU backend's kernels take head dims of 32, 64, ... and blocks of 32k slots


def _cpu_layer(dtype=torch.float32, blocks: int = 8):
    """An attention layer with vLLM's CPU backend's own cache-update op and its cache shape (blocks, KV heads,
    block size, 2 x head dim): keys and values as that backend stores them (keys transposed per block)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, _get_attn_isa

    impl = SimpleNamespace(attn_type="decoder", kv_cache_dtype="auto")
    impl.do_kv_cache_update = lambda *a: CPUAttentionBackendImpl.do_kv_cache_update(impl, *a)
    layer = SimpleNamespace(num_kv_heads=HKV, head_size=CPU_D, isa=_get_attn_isa(dtype, CPU_BLOCK, CPU_D),
                            _k_scale_float=1.0, _v_scale_float=1.0, impl=impl)
    layer.kv_cache = torch.zeros(blocks, HKV, CPU_BLOCK, 2 * CPU_D, dtype=dtype)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_reader_reads_back_what_the_backends_own_op_wrote(dtype):
    from lcx.integrations.vllm.paged_cache import CacheReader

    layer = _cpu_layer(dtype)
    slots = [5, 33, 70, 255]
    k, v = torch.randn(len(slots), HKV, CPU_D).to(dtype), torch.randn(len(slots), HKV, CPU_D).to(dtype)
    layer.impl.do_kv_cache_update(layer, k, v, layer.kv_cache, torch.tensor(slots))
    raw = layer.kv_cache.view(8, HKV, 2 * CPU_BLOCK, CPU_D)[1, :, 1]  # slot 33 read as if stored plainly
    assert not torch.equal(raw, k[1])  # the backend does not store keys plainly: the reader must learn where
    reader = CacheReader(layer, layer.kv_cache, CPU_BLOCK)
    for i, slot in enumerate(slots):
        rk, rv = reader.read(layer.kv_cache, slot)
        assert torch.equal(rk, k[i]) and torch.equal(rv, v[i])
    rk, rv = reader.read_many(layer.kv_cache, torch.tensor(slots[::-1]))  # several at once, in any order
    assert torch.equal(rk, k.flip(0)) and torch.equal(rv, v.flip(0))


def test_served_attention_writes_its_keys_where_a_later_request_with_that_prefix_reads_them():
    """streaming and fot are served with vLLM's prefix cache on: lcx's attention writes each step's keys and
    values into vLLM's paged cache (the backend's own op), and a request that vLLM schedules from a later
    position, its first blocks found in the cache, reads them back (``CachedPrefix``); the block size, which
    the attention metadata does not carry, is the one that maps every scheduled token to its slot."""
    from lcx.integrations.vllm.paged_cache import CachedPrefix, block_size, write_cache

    layer = _cpu_layer()
    keys, values = torch.randn(1, HKV, 40, CPU_D), torch.randn(1, HKV, 40, CPU_D)
    pos = torch.arange(40)
    first = SimpleNamespace(num_actual_tokens=40, seq_lens=torch.tensor([40]), query_start_loc=torch.tensor([0, 40]),
                            block_table=torch.tensor([[3, 5]]), slot_mapping=torch.where(pos < 32, 96 + pos, 160 + pos - 32))
    assert block_size(first) == CPU_BLOCK
    write_cache(layer, keys, values, first)
    # a request whose first block is the one above: 18 new tokens at positions 32..49, in its own block 6
    later = SimpleNamespace(seq_lens=torch.tensor([50]), query_start_loc=torch.tensor([0, 18]),
                            block_table=torch.tensor([[3, 6]]), slot_mapping=192 + torch.arange(18))
    k, v = CachedPrefix(later, 0, 32)(SimpleNamespace(attn=layer))
    assert torch.equal(k, keys[0, :, :32]) and torch.equal(v, values[0, :, :32])
    # block ids that fit two sizes (positions 32..39 in slots 96..103: the start of block 3 of size 32, or the
    # middle of block 1 of size 64): the size the cache's shape suggests decides
    twice = SimpleNamespace(seq_lens=torch.tensor([40]), query_start_loc=torch.tensor([0, 8]),
                            block_table=torch.tensor([[1, 3]]), slot_mapping=96 + torch.arange(8))
    assert block_size(twice, 32) == 32 and block_size(twice, 64) == 64
    with pytest.raises(RuntimeError, match=r"cannot tell vLLM's KV block size .*fits: \[32, 64\]"):
        block_size(twice)
    with pytest.raises(RuntimeError, match="cannot tell vLLM's KV block size"):
        block_size(SimpleNamespace(seq_lens=torch.tensor([50]), query_start_loc=torch.tensor([0, 18]),
                                   block_table=torch.tensor([[3, 6]]), slot_mapping=torch.arange(18)))


def test_a_layout_the_reader_cannot_recover_is_refused():
    from lcx.integrations.vllm.paged_cache import CacheReader

    layer = _cpu_layer()
    layer.impl = SimpleNamespace(do_kv_cache_update=lambda layer, k, v, cache, slots: None)  # writes nothing
    with pytest.raises(RuntimeError, match="cannot read this attention backend's cache layout"):
        CacheReader(layer, layer.kv_cache, CPU_BLOCK)


def _chunk_request(rid: str, name: str, prompt: int):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(prompt)),
                           sampling_params=SimpleNamespace(extra_args={CHUNK_ARG: name}))


def _step(new=(), cached=(), scheduled=None):
    """A scheduler output: new requests (id, blocks, computed) and cached ones (id, new blocks, computed, resumed)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, *_ in cached], new_block_ids=[(b,) for _, b, _, _ in cached],
                                              num_computed_tokens=[c for _, _, c, _ in cached],
                                              resumed_req_ids={r for r, _, _, resumed in cached if resumed}),
        num_scheduled_tokens=scheduled or {})


def test_a_chunk_forward_has_its_last_prompt_position_saved_to_its_file(spool, monkeypatch):
    """vLLM computes a chunk request's 70 prompt tokens over two steps (chunked prefill); its last position
    (69: block 2 of its blocks [3, 1, 6], offset 5, slot 197) is saved in the second, per layer, as the CPU
    backend's op wrote it; a chunk missing a layer, or from a cache the reader cannot read, gets no file."""
    import vllm.forward_context

    from lcx.integrations.vllm.middleware import chunk_file

    name = uuid.uuid4().hex + "-0"
    sched, worker = _connector("SCHEDULER", CPU_BLOCK), _connector("WORKER", CPU_BLOCK)
    assert sched.get_num_new_matched_tokens(_chunk_request("c", name, 70), 0) == (0, False)
    first = sched.build_connector_meta(_step(new=[("c", [3, 1], 0)], scheduled={"c": 40}))
    assert not first.saves and not first.loads
    meta = sched.build_connector_meta(_step(cached=[("c", [6], 40, False)], scheduled={"c": 30}))
    assert [(x.chunk, x.slot) for x in meta.saves] == [(name, 6 * CPU_BLOCK + 5)]
    # a preemption before the last position: the request's blocks are all new when it resumes
    assert sched.build_connector_meta(_step(cached=[("c", [2, 0, 4], 0, True)], scheduled={"c": 70})).saves[0].slot == 4 * CPU_BLOCK + 5

    layers = {f"model.layers.{i}.self_attn.attn": _cpu_layer() for i in range(LAYERS)}
    want = {}
    for i, layer in enumerate(layers.values()):
        k, v = torch.randn(3, HKV, CPU_D), torch.randn(3, HKV, CPU_D)
        layer.impl.do_kv_cache_update(layer, k, v, layer.kv_cache, torch.tensor([6 * CPU_BLOCK + 4, 6 * CPU_BLOCK + 5, 0]))
        want[i] = (k[1], v[1])
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: SimpleNamespace(no_compile_layers=layers))
    worker.bind_connector_metadata(meta)
    for layer_name, layer in layers.items():
        worker.save_kv_layer(layer_name, layer.kv_cache, None)
    worker.wait_for_save()
    from safetensors.torch import load_file

    got = load_file(str(chunk_file(spool, name)))
    assert sorted(got) == [f"{i}.{p}" for i in range(LAYERS) for p in "kv"]
    for i in range(LAYERS):
        assert torch.equal(got[f"{i}.k"], want[i][0]) and torch.equal(got[f"{i}.v"], want[i][1])
    assert not list(spool.glob(".*.tmp"))
    sched.request_finished(_chunk_request("c", name, 70), [6])
    assert not sched._chunks and chunk_file(spool, name).exists()  # the middleware reads and deletes it

    chunk_file(spool, name).unlink()
    worker.bind_connector_metadata(meta)
    worker.save_kv_layer("model.layers.1.self_attn.attn", layers["model.layers.1.self_attn.attn"].kv_cache, None)
    worker.wait_for_save()  # logged, no file: the middleware computes the candidates itself, the engine serves on
    assert not chunk_file(spool, name).exists()
    # a cache layout the reader cannot recover: no file either, and no exception inside the engine's forward
    worker, broken = _connector("WORKER", CPU_BLOCK), _cpu_layer()
    broken.impl = SimpleNamespace(do_kv_cache_update=lambda layer, k, v, cache, slots: None)
    monkeypatch.setattr(vllm.forward_context, "get_forward_context",
                        lambda: SimpleNamespace(no_compile_layers={"model.layers.0.self_attn.attn": broken}))
    worker.bind_connector_metadata(meta)
    worker.save_kv_layer("model.layers.0.self_attn.attn", broken.kv_cache, None)
    worker.wait_for_save()
    assert not chunk_file(spool, name).exists()
    with pytest.raises(RuntimeError, match="malformed chunk request name"):
        sched.get_num_new_matched_tokens(_chunk_request("d", "../x", 70), 0)
