"""fot's memory sharded over Ray actors (lcx.plugins.fot.ray_memory): 1, 2 and 4 shards give one process's exact
top-k, through adds, the cap's evictions, copies and save/load; a sharded memory read with another shard count
is refused; a dead shard is an error naming it; an unreachable cluster is an error within the timeout; and
`lcx generate --memory` answers token for token as with one process's memory.

The tests that start Ray share one local Ray (2 CPUs) for the module; those are marked slow."""

from __future__ import annotations

import copy
import json
import re
import socket
import sys
import threading
import time

import pytest
import torch

from lcx.errors import LcxError
from lcx.plugins.fot.memory import StoreConfig, UnionStore, check_memory_files, load_memory, make_store, save_memory


def _data(n=600, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randn(n, 16, generator=g), torch.randn(20, d, generator=g)


def _same(ray_store, store, q, k=10):
    """The same entries (indices, values, scores) for the queries, and the same memory read whole."""
    (rs, ri), (ts, ti) = ray_store.search(q, k), store.search(q, k)
    assert torch.equal(ri, ti)
    torch.testing.assert_close(rs, ts, atol=1e-4, rtol=1e-5)
    assert torch.equal(ray_store.values[ri], store.values[ti])
    assert len(ray_store) == len(store) and torch.equal(ray_store.keys, store.keys)
    assert torch.equal(ray_store.positions, store.positions) and torch.equal(ray_store.doc_ids, store.doc_ids)


@pytest.mark.slow
@pytest.mark.parametrize("shards", [1, 2, 4])
def test_ray_memory_returns_the_one_process_exact_top_k(local_ray, shards):
    from lcx.plugins.fot import ray_memory

    ray_memory._probe(local_ray.get_runtime_context().gcs_address)  # a real cluster passes the address check
    keys, values, q = _data()
    exact, sharded = make_store(kind="torch"), make_store(kind="ray", shards=shards)
    for s in (exact, sharded):  # 250: adds that do not start at shard 0
        s.add(keys[:250], values[:250], torch.arange(250), doc_id=0)
        s.add(keys[250:], values[250:], torch.arange(250, 600), doc_id=1)
    _same(sharded, exact, q)
    # values read by index, not all among the last search's: fetched from their shards
    idx = torch.tensor([[0, 599, 301], [int(exact.search(q[:1], 1)[1]), 5, 0]])
    assert torch.equal(sharded.values[idx], exact.values[idx])
    sharded._found = None
    assert torch.equal(sharded.values[idx.flip(1)], exact.values[idx.flip(1)])
    torch.testing.assert_close(sharded.values.float(), exact.values.float())


@pytest.mark.slow
def test_a_capped_ray_memory_evicts_the_oldest_as_one_process_does_and_copies_and_forgets_documents(local_ray):
    keys, values, q = _data(1000)
    t, r = make_store(kind="torch", max_entries=300), make_store(kind="ray", shards=2, max_entries=300)
    for i in range(0, 1000, 70):  # 70 per add, 300 kept: the oldest kept entry moves between shards
        j = min(i + 70, 1000)
        for x in (t, r):
            x.add(keys[i:j], values[i:j], torch.arange(i, j), doc_id=i // 70 % 3)
    assert r.evicted == t.evicted == 700
    _same(r, t, q)
    c = copy.deepcopy(r)  # a copy has its own entries (prefix reuse copies a cache)
    c.add(keys[:10] * 5, values[:10], torch.arange(1000, 1010))
    _same(r, t, q)
    assert c.search(keys[:1] * 5, 1)[1].item() == len(c) - 10
    r.clear(doc_id=1)
    t.clear(doc_id=1)
    _same(r, t, q)


@pytest.mark.slow
def test_a_union_of_a_ray_memory_and_a_request_s_own_store_reads_as_one_store(local_ray):
    """What a served request sees of a Ray document memory (lcx serve --memory): as one store holding both."""
    keys, values, q = _data(80)
    shared, both = make_store(kind="ray", shards=2), make_store(kind="torch")
    shared.add(keys[:50], values[:50], torch.arange(50))
    union = UnionStore(shared, make_store(kind="torch"))
    union.add(keys[50:], values[50:], torch.arange(50, 80))
    both.add(keys, values, torch.arange(80))
    (us, ui), (bs, bi) = union.search(q, 12), both.search(q, 12)
    torch.testing.assert_close(us, bs)
    assert torch.equal(ui, bi) and torch.equal(union.values[ui], both.values[bi])
    torch.testing.assert_close(union.values.float(), both.values.float())


@pytest.mark.slow
def test_more_shards_than_entries_leaves_shards_empty_and_search_exact(local_ray, tmp_path):
    keys, values, q = _data(3)
    t, r = make_store(kind="torch"), make_store(kind="ray", shards=4)
    for x in (t, r):
        x.add(keys, values, torch.arange(3))
    assert r.search(q, 10)[1].shape == (20, 3)
    _same(r, t, q)
    save_memory({(0, 0): r}, tmp_path / "mem", {"model": {"model_type": "llama"}})  # shard 3 writes no tensors
    loaded, _ = load_memory(tmp_path / "mem")
    _same(loaded[(0, 0)], t, q)


@pytest.mark.slow
def test_a_ray_memory_saves_and_loads_per_shard_and_refuses_another_shard_count(local_ray, tmp_path):
    keys, values, q = _data(200)
    stores = {(l, h): make_store(kind="ray", shards=2, max_entries=151) for l in (3, 7) for h in (0, 1)}
    local = {key: make_store(kind="torch", max_entries=151) for key in stores}
    for i, key in enumerate(stores):
        for s in (stores[key], local[key]):  # the cap drops 49: the deal starts on shard 1
            s.add(keys + i, values, torch.arange(200), doc_id=i)
    save_memory(stores, tmp_path / "mem", {"model": {"model_type": "llama"}})
    assert sorted(p.name for p in (tmp_path / "mem").iterdir()) == [
        "memory-shard-0-of-2.safetensors", "memory-shard-1-of-2.safetensors", "memory.json"]
    meta = json.loads((tmp_path / "mem" / "memory.json").read_text())
    assert meta["store_config"]["kind"] == "ray" and meta["store_config"]["ray_address"] == ""
    loaded, _ = load_memory(tmp_path / "mem")  # as saved: Ray, 2 shards
    for key in stores:
        _same(loaded[key], local[key], q)
    with pytest.raises(LcxError, match=r"sharded over 2 Ray actors, and -o fot.shards=4 asks for 4; read it with "
                                       r"-o fot.shards=2"):
        load_memory(tmp_path / "mem", StoreConfig(kind="ray", shards=4))
    with pytest.raises(LcxError, match=r"sharded over 2 Ray actors; read it with -o fot.backend=ray -o fot.shards=2"):
        load_memory(tmp_path / "mem", StoreConfig(kind="faiss-flat"))
    # lcx serve's check, before vLLM starts (its worker is where the memory is loaded)
    from lcx.plugins.fot.method import FoT

    for options, problem in (({}, "read it with -o fot.backend=ray -o fot.shards=2"),
                             ({"backend": "ray", "shards": 3}, "-o fot.shards=3 asks for 3")):
        with pytest.raises(LcxError, match=re.escape(problem)):
            FoT.from_options(**options).check_memory(tmp_path / "mem", {"model_type": "llama"})
    assert FoT.from_options(backend="ray", shards=2).check_memory(tmp_path / "mem", {"model_type": "llama"})["shards"]
    # a one-process memory is dealt over any number of shards
    save_memory(local, tmp_path / "one", {"model": {"model_type": "llama"}})
    dealt, _ = load_memory(tmp_path / "one", StoreConfig(kind="ray", shards=4))
    for key in stores:
        _same(dealt[key], local[key], q)
    # each shard checks its own file; a server's check (check_memory_files) checks them all
    f = tmp_path / "mem" / "memory-shard-1-of-2.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    for read in (lambda: load_memory(tmp_path / "mem"), lambda: check_memory_files(tmp_path / "mem")):
        with pytest.raises(LcxError, match=r"memory-shard-1-of-2.safetensors' is corrupted or truncated"):
            read()
    f.unlink()
    with pytest.raises(LcxError, match=r"memory-shard-1-of-2.safetensors' is missing"):
        load_memory(tmp_path / "mem")


@pytest.mark.slow
def test_a_dead_shard_is_an_error_naming_it_not_a_wrong_answer(local_ray):
    from lcx.plugins.fot import ray_memory

    keys, values, q = _data(100)
    s = make_store(kind="ray", shards=2, shard_kind="torch")  # actors of its own: one is killed
    s.add(keys, values, torch.arange(100))
    s.search(q, 5)
    dead = s.shards.actors[1]
    local_ray.kill(dead)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # ray.kill returns at once; the actor dies soon after
        try:
            local_ray.get(dead.ready.remote(), timeout=5)
        except (local_ray.exceptions.RayActorError, local_ray.exceptions.ActorUnavailableError):
            break
        time.sleep(0.2)
    with pytest.raises(LcxError, match=r"memory shard 1 of 2 \(Ray actor [0-9a-f]+\) died while searching; its "
                                       r"entries are lost"):
        s.search(q, 5)
    with pytest.raises(LcxError, match=r"memory shard 1 of 2 .* died while adding entries"):
        s.add(keys[:4], values[:4], torch.arange(4))
    assert all(g is not s.shards for g in ray_memory._groups.values())  # new stores start new actors


def _listener(reply: bytes | None):
    """A local TCP server that accepts connections and then says ``reply`` (None: nothing, ever)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held = []

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            held.append(conn)
            if reply is not None:
                conn.recv(1024)
                conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_an_unreachable_ray_address_is_an_error_within_the_timeout(monkeypatch):
    """Nothing listening, a host that never answers, a service that accepts and stays silent (Ray itself would
    retry that for many minutes) or answers otherwise than a gRPC server: each an error within the timeout."""
    ray = pytest.importorskip("ray")
    from lcx.plugins.fot import ray_memory

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # a process that has not joined a Ray yet
    monkeypatch.setattr(ray_memory, "CONNECT_TIMEOUT_S", 2)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: nothing listens there
    silent, http1 = _listener(None), _listener(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    try:
        addresses = [f"127.0.0.1:{port}", "192.0.2.1:6379",  # TEST-NET-1 (RFC 5737): nobody answers
                     f"127.0.0.1:{silent.getsockname()[1]}", f"127.0.0.1:{http1.getsockname()[1]}"]
        for address in addresses:
            t0 = time.monotonic()
            with pytest.raises(LcxError, match=rf"no Ray cluster answers at '{re.escape(address)}' .*waited at most 2 s"):
                ray_memory.connect(address)
            assert time.monotonic() - t0 < 2 + 3
    finally:
        silent.close()
        http1.close()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(LcxError, match="no Ray cluster answers"):
        ray_memory.connect("")
    with pytest.raises(LcxError, match="is not host:port"):
        ray_memory.connect("nowhere")


@pytest.mark.parametrize("options, problem", [
    ({"backend": "ray", "shards": "0"}, "shards must be >= 1 (one Ray actor each), got 0"),
    ({"backend": "ray", "shards": "-2"}, "shards must be >= 1 (one Ray actor each), got -2"),
    ({"shards": "4"}, "shards is an option of backend=ray"),
    ({"ray_address": "10.0.0.1:6379"}, "ray_address is an option of backend=ray"),
    ({"backend": "ray", "shard_backend": "faiss-gpu"}, "shards hold a torch, faiss-flat, faiss-ivf, faiss-hnsw store"),
    ({"backend": "ray", "ray_address": "localhost6379"}, "Ray address 'localhost6379' is not host:port"),
    ({"backend": "ray", "ray_address": "ray://head:99999"}, "Ray address 'ray://head:99999' is not host:port"),
])
def test_bad_ray_options_are_refused(options, problem):
    from lcx.plugins.fot import FoT

    with pytest.raises(LcxError, match=re.escape(problem)):
        FoT.from_options(**options)


def test_a_ray_store_of_no_shards_is_refused():
    with pytest.raises(LcxError, match="a Ray memory needs shards >= 1 .one actor each., got 0"):
        make_store(kind="ray", shards=0)


def test_backend_ray_without_ray_installed_names_the_extra(monkeypatch):
    from lcx.plugins.fot import FoT

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, as where it is not installed
    with pytest.raises(LcxError, match=r"memory backend 'ray' needs Ray: pip install 'lcx\[dist\]'"):
        FoT.from_options(backend="ray")
    assert len(make_store(kind="faiss-flat")) == 0  # the one-process backends do not need it


@pytest.mark.slow
def test_generate_with_a_ray_memory_answers_token_for_token_as_with_one_process(local_ray, tmp_path):
    """`lcx memory build` and `lcx generate --memory` through a Ray memory: a memory built on Ray holds what one
    process builds, and the answer is the one-process answer, token for token (the prompt's own windows join
    the Ray memory as it is read)."""
    from click.testing import CliRunner

    from lcx.cli import main
    from tests.helpers import make_tiny_model_dir

    m = make_tiny_model_dir(tmp_path / "m", max_position_embeddings=512)
    (tmp_path / "a.txt").write_text("alpha document. " * 20)
    (tmp_path / "b.txt").write_text("beta document here. " * 20)
    local, dist = ["-o", "local=64", "-o", "backend=faiss-flat"], ["-o", "local=64", "-o", "backend=ray", "-o", "shards=2"]

    def run(*args):
        r = CliRunner().invoke(main, [*args])
        assert r.exit_code == 0, r.output
        return r.stdout

    for out, opts in (("mem", local), ("mem-ray", dist)):
        run("memory", "build", "-m", str(m), *opts, "--out", str(tmp_path / out), str(tmp_path / "a.txt"),
            str(tmp_path / "b.txt"))
    assert (tmp_path / "mem-ray" / "memory-shard-1-of-2.safetensors").exists()
    one, _ = load_memory(tmp_path / "mem")
    sharded, _ = load_memory(tmp_path / "mem-ray")
    assert set(one) == set(sharded)
    for key in one:
        assert torch.equal(one[key].keys, sharded[key].keys) and torch.equal(one[key].values.float(), sharded[key].values.float())
    prompt = "which document is this one, alpha or beta? " * 4  # longer than local: its windows join the memory
    gen = ["generate", "-m", str(m), "--method", "fot", "-p", prompt, "-n", "12", "--json"]
    answers = [json.loads(run(*gen, *opts, "--memory", str(tmp_path / mem)))
               for opts, mem in ((local, "mem"), (dist, "mem"), (dist, "mem-ray"))]
    assert answers[0]["new_tokens"] > 0
    assert [(a["text"], a["new_tokens"]) for a in answers[1:]] == [(answers[0]["text"], answers[0]["new_tokens"])] * 2
