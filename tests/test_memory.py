"""Memory stores: every backend agrees with exact torch search; caps evict oldest; save/load is exact."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch.overrides import TorchFunctionMode

from lcx.errors import LcxError
from lcx.plugins.fot.memory import faiss_gpu_available, half_pays, load_memory, make_store, recall_at_k, save_memory


def _data(n=600, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randn(n, 16, generator=g), torch.randn(20, d, generator=g)


def test_faiss_exact_equals_torch_exact():
    keys, values, q = _data()
    stores = [make_store(kind=k) for k in ("torch", "faiss-flat")]
    for s in stores:
        s.add(keys[:300], values[:300], torch.arange(300), doc_id=0)
        s.add(keys[300:], values[300:], torch.arange(300, 600), doc_id=1)
    (s1, i1), (s2, i2) = (s.search(q, 10) for s in stores)
    assert torch.equal(i1, i2)
    torch.testing.assert_close(s1, s2, atol=1e-4, rtol=1e-5)


@pytest.fixture
def half_is_fast(monkeypatch):
    """The half candidate step as where bf16 is native (a bf16 product runs on any CPU, only slower)."""
    import lcx.plugins.fot.memory as memory

    monkeypatch.setattr(memory, "_fast_half", lambda dtype, device: dtype in (torch.bfloat16, torch.float16))


def test_a_half_precision_models_search_picks_candidates_in_its_dtype_and_answers_float32_exact_scores(half_is_fast):
    dtype = torch.bfloat16
    # keys a half-precision model makes (its dtype's values), queries re-rotated in float32, as fot searches them
    keys, values, q = _data(8192, 64)  # a search the half step pays for (half_pays)
    keys, q = keys.to(dtype).float(), torch.randn(300, 64, generator=torch.Generator().manual_seed(1))
    store = make_store(kind="torch")
    store.add(keys, torch.zeros(8192, 4), torch.arange(8192))
    exact, half = store.search(q, 32), store.search(q, 32, dtype)
    assert torch.equal(half[1].sort(-1).values, exact[1].sort(-1).values)  # the same 32 entries per query
    torch.testing.assert_close(half[0], exact[0], atol=1e-5, rtol=1e-6)  # rescored in float32, best first
    only_half = (q.to(dtype) @ keys.to(dtype).T).float().topk(32, dim=-1).indices
    assert not torch.equal(only_half.sort(-1).values, exact[1].sort(-1).values)  # rescoring is what makes it exact


class _Products(TorchFunctionMode):
    """The dtypes of the matrix products run inside it."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.bmm):
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def test_the_half_candidate_product_runs_where_it_pays_and_only_there(half_is_fast):
    """The exact answer hides which path ran (the test above): the products' dtypes show it.  Small searches
    stay float32, where converting the keys costs more than the half product saves."""
    for queries, keys, pays in ((256, 8192, True), (4, 8192, True), (700, 3072, True), (255, 8191, False),
                                (3, 16384, False), (4000, 3071, False)):
        assert half_pays(queries, keys) == pays
        store = make_store(kind="torch")
        store.add(torch.randn(keys, 64), torch.zeros(keys, 4), torch.arange(keys))
        q = torch.randn(queries, 64)
        for dtype in (torch.bfloat16, torch.float32, None):
            with _Products() as seen:
                store.search(q, 32, dtype)
            assert (torch.bfloat16 in seen.dtypes) == (pays and dtype == torch.bfloat16), (queries, keys, dtype)


@pytest.mark.parametrize("kind,extra", [("faiss-hnsw", {}), ("faiss-ivf", {"nlist": 16, "nprobe": 16})])
def test_approximate_backends_have_high_recall(kind, extra):
    keys, values, q = _data(2000)
    exact, approx = make_store(kind="torch"), make_store(kind=kind, **extra)
    for s in (exact, approx):
        s.add(keys, values, torch.arange(2000))
    _, ei = exact.search(q, 10)
    _, ai = approx.search(q, 10)
    assert recall_at_k(ei, ai) >= 0.95  # nprobe == nlist makes IVF exhaustive; HNSW at ef 128 is near-exact


def test_ivf_probing_every_list_is_exact_inner_product_search_also_for_keys_added_after_training():
    """faiss-ivf searches extended keys by L2 (lcx.plugins.fot.memory.FaissStore): probing every list must give exact
    inner-product results and scores, including for keys added after training with larger norms."""
    keys, values, q = _data(1200)
    keys[600:] *= 1.8  # later keys: norms beyond the training ones (within the R margin of 2)
    t, s = make_store(kind="torch"), make_store(kind="faiss-ivf", nlist=16, nprobe=16, ivf_train=600)
    for x in (t, s):
        x.add(keys[:600], values[:600], torch.arange(600))
        x.add(keys[600:], values[600:], torch.arange(600, 1200))
    assert s.index is not None and s.index.is_trained
    (ts, ti), (ss, si) = t.search(q, 10), s.search(q, 10)
    assert torch.equal(ti, si)
    torch.testing.assert_close(ts, ss)


def test_ivf_before_training_falls_back_to_exact():
    keys, values, q = _data(50)
    s, t = make_store(kind="faiss-ivf", nlist=64), make_store(kind="torch")
    for x in (s, t):
        x.add(keys, values, torch.arange(50))
    assert torch.equal(s.search(q, 5)[1], t.search(q, 5)[1])


def test_cap_evicts_oldest_and_clear_by_document():
    keys, values, _ = _data(100)
    s = make_store(kind="faiss-flat", max_entries=60)
    s.add(keys[:50], values[:50], torch.arange(50), doc_id=0)
    s.add(keys[50:], values[50:], torch.arange(50, 100), doc_id=1)
    assert len(s) == 60 and s.evicted == 40 and s.positions[0].item() == 40
    _, idx = s.search(keys[99:100], 1)
    assert s.positions[idx[0, 0]].item() == 99  # indices still line up with metadata after eviction
    s.clear(doc_id=0)
    assert len(s) == 50 and set(s.doc_ids.tolist()) == {1}


def test_save_load_roundtrip_and_integrity(tmp_path):
    keys, values, q = _data(200)
    stores = {(l, h): make_store(kind="faiss-flat") for l in (3, 7) for h in (0, 1)}
    for i, s in enumerate(stores.values()):
        s.add(keys + i, values, torch.arange(200), doc_id=i)
    save_memory(stores, tmp_path / "mem", {"model": {"model_type": "llama"}})
    loaded, meta = load_memory(tmp_path / "mem")
    assert meta["model"]["model_type"] == "llama" and set(loaded) == set(stores)
    for key, s in stores.items():
        assert torch.equal(loaded[key].keys, s.keys) and torch.equal(loaded[key].doc_ids, s.doc_ids)
        assert torch.equal(loaded[key].search(q, 5)[1], s.search(q, 5)[1])
    f = tmp_path / "mem" / "memory.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(LcxError, match="corrupted or truncated"):
        load_memory(tmp_path / "mem")
    with pytest.raises(LcxError, match="not an lcx memory folder"):
        load_memory(tmp_path)


@pytest.mark.parametrize("edit, problem", [
    (lambda m: {k: v for k, v in m.items() if k != "stores"}, "'stores' must be a non-empty list"),
    (lambda m: {**m, "stores": ["3.0", "x"]}, "store name 'x' is not \"layer.head\""),
    (lambda m: {**m, "model": None}, "'model' must be an object"),
    (lambda m: [m], "it is not a JSON object"),
])
def test_an_edited_memory_json_is_one_clear_error(tmp_path, edit, problem):
    """The checksum covers the tensors only: memory.json of another shape is refused naming the file, not read
    into a KeyError or ValueError."""
    keys, values, _ = _data(20)
    store = make_store(kind="torch")
    store.add(keys, values, torch.arange(20), doc_id=0)
    save_memory({(3, 0): store}, tmp_path / "mem", {"model": {"model_type": "llama"}})
    meta_path = tmp_path / "mem" / "memory.json"
    meta_path.write_text(json.dumps(edit(json.loads(meta_path.read_text()))))
    with pytest.raises(LcxError, match=f"memory file .*memory.json' is damaged: {re.escape(problem)}"):
        load_memory(tmp_path / "mem")


def test_bad_arguments():
    with pytest.raises(LcxError, match="unknown memory backend"):
        make_store(kind="annoy")
    s = make_store(kind="torch")
    with pytest.raises(LcxError, match="k must be > 0"):
        s.search(torch.randn(1, 4), 0)
    assert s.search(torch.randn(2, 4), 3)[1].shape == (2, 0)  # empty memory: nothing to return
    if not faiss_gpu_available():
        with pytest.raises(LcxError, match="faiss built with CUDA|sees no GPU"):
            make_store(kind="faiss-gpu").add(torch.randn(3, 4), torch.randn(3, 4), torch.arange(3))


def test_faiss_gpu_without_cuda_says_which_install_step_is_missing(monkeypatch):
    """faiss-cpu and faiss-gpu both install the module 'faiss': the error names the step a user missed."""
    from importlib import metadata
    from types import SimpleNamespace

    from lcx.plugins.fot.memory import _faiss_gpu_missing

    def version(installed):
        def v(name):
            if name not in installed:
                raise metadata.PackageNotFoundError(name)
            return installed[name]
        return v

    cpu_build = SimpleNamespace()
    monkeypatch.setattr(metadata, "version", version({"faiss-cpu": "1.15.1"}))
    missing = _faiss_gpu_missing(cpu_build)
    assert "needs faiss built with CUDA (pip install 'lcx[gpu]', then pip uninstall -y faiss-cpu" in missing
    monkeypatch.setattr(metadata, "version", version({"faiss-cpu": "1.15.1", "faiss-gpu": "1.15.1"}))
    assert "faiss-gpu 1.15.1 is installed but faiss-cpu's module is the one imported" in _faiss_gpu_missing(cpu_build)
    assert "sees no GPU" in _faiss_gpu_missing(SimpleNamespace(StandardGpuResources=object))


@pytest.mark.skipif(not faiss_gpu_available(), reason="needs faiss built with CUDA and a GPU (pip install 'lcx[gpu]')")
def test_faiss_gpu_equals_torch_exact_through_adds_evictions_copies_and_save_load(tmp_path):
    """faiss-gpu (IndexFlatIP on the GPU) is exact search: the entries torch finds, with its scores, after
    many adds past the cap (removal from the GPU index in place), in a deep copy, and after save/load."""
    import copy

    keys, values, q = _data(1000)
    g, t = make_store(kind="faiss-gpu", max_entries=300), make_store(kind="torch", max_entries=300)
    for i in range(0, 1000, 50):
        for x in (g, t):
            x.add(keys[i:i + 50], values[i:i + 50], torch.arange(i, i + 50), doc_id=i // 500)
    assert len(g) == 300 and g.evicted == 700 and g.index.ntotal == 300

    def same(a, b):
        (sa, ia), (sb, ib) = a.search(q, 8), b.search(q, 8)
        assert torch.equal(a.positions[ia], b.positions[ib])
        torch.testing.assert_close(sa, sb, atol=1e-4, rtol=1e-5)

    same(g, t)
    c = copy.deepcopy(g)
    c.add(keys[:10] * 5, values[:10], torch.arange(1000, 1010))  # the copy has its own GPU index
    same(g, t)
    assert c.search(keys[:1] * 5, 1)[1].item() == len(c) - 10 and c.index is not g.index
    save_memory({(0, 0): g}, tmp_path / "mem", {"model": {"model_type": "llama"}})
    loaded, _ = load_memory(tmp_path / "mem")
    assert loaded[(0, 0)].config.kind == "faiss-gpu"
    same(loaded[(0, 0)], t)
    g.clear(doc_id=1)
    t.clear(doc_id=1)
    same(g, t)


@pytest.mark.parametrize("kind,extra", [("faiss-flat", {}), ("faiss-ivf", {"nlist": 8, "nprobe": 8, "ivf_train": 64}),
                                        ("faiss-hnsw", {})])
def test_capped_index_evicts_in_place_and_stays_exact_against_torch(kind, extra):
    """Many adds past the cap: the index drops the oldest without a rebuild (flat, IVF) and every
    search result still names the right entry (same results as exact torch over the kept entries)."""
    keys, values, q = _data(1000)
    s, t = make_store(kind=kind, max_entries=300, **extra), make_store(kind="torch", max_entries=300)
    index_before = None
    for i in range(0, 1000, 50):
        for x in (s, t):
            x.add(keys[i:i + 50], values[i:i + 50], torch.arange(i, i + 50))
        if i == 500:
            index_before = s.index
    assert len(s) == 300 and s.evicted == 700 and s.positions[0].item() == 700
    if kind != "faiss-hnsw":
        assert s.index is index_before  # removed from in place, not rebuilt
    (_, si), (_, ti) = s.search(q, 5), t.search(q, 5)
    assert torch.equal(s.positions[si], t.positions[ti]) if kind != "faiss-hnsw" else recall_at_k(ti, si) >= 0.9
    assert si.max() < 300 and si.min() >= 0


def test_a_union_store_reads_as_the_shared_store_with_the_own_entries_appended():
    """What a served request sees of a document memory: search and values equal one store holding both."""
    from lcx.plugins.fot.memory import UnionStore

    g = torch.Generator().manual_seed(0)
    shared, own, both = make_store(kind="torch"), make_store(kind="torch"), make_store(kind="torch")
    a, va = torch.randn(50, 16, generator=g), torch.randn(50, 8, generator=g)
    b, vb = torch.randn(30, 16, generator=g), torch.randn(30, 8, generator=g)
    shared.add(a, va, torch.arange(50))
    both.add(a, va, torch.arange(50))
    union = UnionStore(shared, own)
    q = torch.randn(7, 16, generator=g)
    for keys, values in ((None, None), (b, vb)):
        if keys is not None:
            union.add(keys, values, torch.arange(50, 80))
            both.add(keys, values, torch.arange(50, 80))
        s1, i1 = union.search(q, 12)
        s2, i2 = both.search(q, 12)
        torch.testing.assert_close(s1, s2)
        assert torch.equal(i1, i2) and torch.equal(union.values[i1], both.values[i2])
        assert len(union) == len(both) and torch.equal(union.keys, both.keys)
        torch.testing.assert_close(union.values.float(), both.values.float())
    assert len(shared) == 50 and len(own) == 30  # writes went to the request's own store


def test_search_bytes_counts_the_exact_searches_only():
    """What a search allocates beside the store: scores over every entry for the torch backend, and for
    faiss-ivf until its lists are trained (in each of a Ray memory's shards); a FAISS index's own search none."""
    from lcx.plugins.fot.memory import StoreConfig, search_bytes

    per_entry = 4 * 100 + 16 * torch.get_num_threads()  # float32 scores of 100 queries, each thread's topk buffer
    assert search_bytes(StoreConfig(kind="torch"), 100, 10_000, 64) == per_entry * 10_000
    assert search_bytes(StoreConfig(kind="faiss-flat"), 100, 10_000, 64) == 0
    ivf = StoreConfig(kind="faiss-ivf", nlist=256, ivf_train=1_000)
    assert search_bytes(ivf, 100, 500, 64) == per_entry * 500
    assert search_bytes(ivf, 100, 10**6, 64) == per_entry * 1_000
    ray = StoreConfig(kind="ray", shards=2, shard_kind="faiss-ivf", ivf_train=1_000)
    assert search_bytes(ray, 100, 10**6, 64) == per_entry * 2_000
    # few queries of wide keys: the half candidate step's bf16 keys outweigh float32 scores
    assert search_bytes(StoreConfig(kind="torch"), 4, 10_000, 256) == (2 * 4 + 2 * 256 + 16 * torch.get_num_threads()) * 10_000
