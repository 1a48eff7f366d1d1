"""fot: memory attention invariants on tiny models."""

from __future__ import annotations

import pytest
import torch

import lcx
from lcx.generation import tail_logits
from lcx.plugins.fot.memory import save_memory
from lcx.plugins.fot.method import FoT
from tests.conftest import tiny_model

N = 200  # tokens: longer than the tiny window (128) and many local windows of 32


def _ids(n=N, seed=0):
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


# FoT's own settings (memory keys at the local window's start, no sinks, every top-k key read): the invariants
# below are stated for them; tests of lcx's other settings name theirs
PAPER = {"sinks": 0, "positions": "first", "gate": "off"}


def _logits(model, ids, n=40, **opts):
    with lcx.attach(model, ["fot"], **{**PAPER, **opts}) as run:
        out = tail_logits(run, ids, n)
        stores = run.memory.lcx_stores
    return out, stores


def test_dense_equals_knn_with_k_at_least_memory_size():
    model = tiny_model("llama")
    dense, stores = _logits(model, _ids(), local=32, memory_layers="0,1", dense=True)
    knn, _ = _logits(model, _ids(), local=32, memory_layers="0,1", k=10_000)
    assert max(len(s) for s in stores[0].values()) > 100  # memory really was used
    torch.testing.assert_close(dense, knn, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["faiss-flat", "faiss-hnsw"])
def test_faiss_backends_equal_torch_exact(backend):
    model = tiny_model("qwen2")
    ref, _ = _logits(model, _ids(), local=32, k=4)
    got, _ = _logits(model, _ids(), local=32, k=4, backend=backend)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_knn_differs_from_dense_when_k_is_small():
    model = tiny_model("llama")
    dense, _ = _logits(model, _ids(), local=32, memory_layers="all", dense=True)
    knn, _ = _logits(model, _ids(), local=32, memory_layers="all", k=2)
    assert not torch.allclose(dense, knn, atol=1e-4)


def test_first_positions_are_the_local_window_start_explicitly():
    """One layer: K/V depend only on token and position, so FoT's output for the second window equals
    the base model run on [window 1 ; window 2] where every window-1 token sits at window 2's first
    position (memory keys "as if at position 0 of the local window") and is visible to all of window 2."""
    model = tiny_model("llama", num_hidden_layers=1, attn_implementation="eager")
    local = 24
    ids = _ids(2 * local)
    fot, _ = _logits(model, ids, n=local - 1, local=local, memory_layers="0", dense=True)

    pos = torch.tensor([[local] * local + list(range(local, 2 * local))])
    mask = torch.tril(torch.ones(2 * local, 2 * local, dtype=torch.bool))
    mask[local:, :local] = True  # window 2 sees all of memory
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():  # a 4D mask is used as given: eager adds it to the scores
        ref = model(ids, position_ids=pos, attention_mask=additive).logits[0, local:-1]
    torch.testing.assert_close(fot, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dense", [False, True], ids=["knn", "dense"])
def test_memory_attention_equals_an_explicit_softmax_per_query_head(dense):
    """GQA, query blocks, batch rows, and KV heads whose stores hold the same number of entries or not (fewer
    than k, none at all: the heads are computed together, padded): each query head's output is one softmax
    over its local keys (under the mask) and its KV head's top-k memory keys (dense: all of them)."""
    from lcx.plugins.fot.memory import make_store
    from lcx.plugins.fot.attention import memory_attention

    g = torch.Generator().manual_seed(0)
    B, Hkv, G, T, S, D, k, scale = 2, 2, 3, 5, 7, 8, 3, 0.5
    q = torch.randn(B, Hkv * G, T, D, generator=g)
    kl, vl = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    allowed = torch.ones(T, S, dtype=torch.bool)
    allowed[:, S - T:] = torch.ones(T, T, dtype=torch.bool).tril()
    mask = torch.zeros(T, S).masked_fill(~allowed, float("-inf"))[None, None]
    for sizes in ([6, 6], [4, 9], [2, 9], [0, 5]):
        memory = {}
        for b in range(B):
            for h in range(Hkv):
                memory[(b, h)] = make_store()
                n = sizes[h]
                if n:
                    memory[(b, h)].add(torch.randn(n, D, generator=g), torch.randn(n, D, generator=g), torch.arange(n))
        out = memory_attention(q, kl, vl, mask, memory, torch.zeros(B, T), None, scale, k, dense, block=2)
        for b in range(B):
            for h in range(Hkv):
                st = memory[(b, h)]
                for j in range(h * G, (h + 1) * G):
                    for t in range(T):
                        x = q[b, j, t]
                        local = kl[b, h] @ x * scale + mask[0, 0, t]
                        if not len(st):
                            p, mv = local.softmax(0), torch.zeros(0, D)
                        else:
                            mem = (st.keys @ x * scale).topk(len(st) if dense else min(k, len(st)))
                            p, mv = torch.cat([local, mem.values]).softmax(0), st.values[mem.indices]
                        want = p[:S] @ vl[b, h] + p[S:] @ mv
                        torch.testing.assert_close(out[b, t, j], want, atol=1e-5, rtol=1e-5, msg=str((sizes, b, j, t)))


def test_a_gate_reads_only_the_memory_keys_near_the_best_local_score():
    """gate=G: each query reads the memory keys whose scaled score is at least its best local score + G, under
    the same one softmax; a gate no key passes reads the local keys alone, one every key passes is no gate."""
    from lcx.plugins.fot.attention import joint_softmax

    g = torch.Generator().manual_seed(1)
    local, lv = torch.randn(3, 4, 6, generator=g), torch.randn(3, 6, 5, generator=g)
    mem, mv = torch.randn(3, 4, 7, generator=g), torch.randn(3, 4, 7, 5, generator=g)
    local[0, 0, 5] = float("-inf")  # a masked local key does not count as the best
    for gate in (-0.5, 0.0, 0.3):
        keep = mem >= local.amax(-1, keepdim=True) + gate
        assert 0 < keep.sum() < keep.numel()
        p = torch.cat([local, mem.masked_fill(~keep, float("-inf"))], -1).softmax(-1)
        want = p[..., :6] @ lv + (p[..., 6:, None] * mv).sum(-2)
        torch.testing.assert_close(joint_softmax(local, lv, mem, mv, False, gate), want)
    torch.testing.assert_close(joint_softmax(local, lv, mem, mv, False, 1e4), local.softmax(-1) @ lv)
    torch.testing.assert_close(joint_softmax(local, lv, mem, mv, False, -1e4), joint_softmax(local, lv, mem, mv, False))


@pytest.mark.parametrize("dense", [False, True])
def test_joint_softmax_is_one_softmax_over_both_parts_and_spends_local_only_when_told(dense):
    """The joint weights equal torch's softmax over the joined scores: large scores (no overflow), a masked local
    key, memory far above the local scores in one row and far below in another, a row with no memory key
    readable, no memory columns at all, and a gate; ``local`` is left as given unless ``inplace``."""
    from lcx.plugins.fot.attention import joint_softmax

    g = torch.Generator().manual_seed(3)
    local, lv = torch.randn(2, 4, 6, generator=g) * 30 + 500, torch.randn(2, 6, 5, generator=g)
    mem = torch.randn(2, 4, 7, generator=g) * 30 + 500
    mv = torch.randn(2, 7, 5, generator=g) if dense else torch.randn(2, 4, 7, 5, generator=g)
    local[:, :, 2] = float("-inf")
    mem[0, 1] += 200.0  # memory dominates: a max over the local scores alone overflows here
    mem[0, 2] -= 200.0  # the local keys dominate: one over memory alone overflows here
    mem[1, 3] = float("-inf")  # no memory key readable (a head left out)

    def want(local, mem, mv):
        p = torch.cat([local, mem], -1).softmax(-1)
        S = local.shape[-1]
        return p[..., :S] @ lv + (p[..., S:] @ mv if dense else (p[..., S:, None] * mv).sum(-2))

    given, spent = local.clone(), local.clone()
    torch.testing.assert_close(joint_softmax(local, lv, mem, mv, dense), want(local, mem, mv))
    assert torch.equal(local, given)
    torch.testing.assert_close(joint_softmax(spent, lv, mem, mv, dense, inplace=True), want(local, mem, mv))
    assert not torch.equal(spent, given)  # the copy it saves
    gated = mem.masked_fill(mem < local.amax(-1, keepdim=True), float("-inf"))
    assert 0 < gated.isfinite().sum() < mem.isfinite().sum()
    torch.testing.assert_close(joint_softmax(local.clone(), lv, mem, mv, dense, 0.0, inplace=True),
                               want(local, gated, mv))
    torch.testing.assert_close(joint_softmax(local, lv, mem[..., :0], mv[..., :0, :], dense), local.softmax(-1) @ lv)


def test_memory_attention_takes_gradients():
    """The joint softmax spends the local scores in place only where no gradient needs them."""
    from lcx.plugins.fot.attention import memory_attention
    from lcx.plugins.fot.memory import make_store

    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 3, 4, generator=g, requires_grad=True)
    k, v = torch.randn(1, 1, 5, 4, generator=g), torch.randn(1, 1, 5, 4, generator=g)
    store = make_store()
    store.add(torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g), torch.arange(6))
    out = memory_attention(q, k, v, torch.zeros(1, 1, 3, 5), {(0, 0): store}, torch.zeros(1, 3), None,
                           scaling=0.5, k=2, dense=False, block=2)
    out.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


def test_a_gate_past_the_sinks_measures_against_the_marked_local_keys_only():
    """gate_keys: the best local score a gate measures against is the best among the marked keys (the window's
    own, the sinks left out); every local key still takes part in the softmax."""
    from lcx.plugins.fot.attention import joint_softmax

    g = torch.Generator().manual_seed(2)
    local, lv = torch.randn(2, 4, 6, generator=g), torch.randn(2, 6, 5, generator=g)
    mem, mv = torch.randn(2, 4, 7, generator=g), torch.randn(2, 4, 7, 5, generator=g)
    local[..., 0] += 5.0  # a sink every query's best key
    marked = torch.arange(6) >= 1
    keep = mem >= local[..., 1:].amax(-1, keepdim=True)
    assert keep.any() and not (mem >= local.amax(-1, keepdim=True)).any()
    p = torch.cat([local, mem.masked_fill(~keep, float("-inf"))], -1).softmax(-1)
    want = p[..., :6] @ lv + (p[..., 6:, None] * mv).sum(-2)
    torch.testing.assert_close(joint_softmax(local, lv, mem, mv, False, 0.0, marked), want)
    torch.testing.assert_close(joint_softmax(local, lv, mem, mv, False, 0.0, torch.ones(6, dtype=torch.bool)),
                               joint_softmax(local, lv, mem, mv, False, 0.0))


def test_gate_sinks_false_reads_memory_a_sink_would_have_gated_out(monkeypatch):
    """With sinks held, gate_sinks=false measures the gate against the window's own keys: memory attention is
    handed exactly the held sinks as the keys to leave out, and on a model the output differs from the gate
    against every key."""
    import lcx.plugins.fot.method as fot_method

    model, ids = tiny_model("llama"), _ids()
    opts = dict(local=32, chunk=8, memory_layers="all", gate=0.0, sinks=4)
    with_sinks = _logits(model, ids, **opts)[0]
    handed, attention = [], fot_method.memory_attention

    def recording(*args, **kwargs):
        handed.append(args[-1])
        return attention(*args, **kwargs)

    monkeypatch.setattr(fot_method, "memory_attention", recording)
    past = _logits(model, ids, gate_sinks=False, **opts)[0]
    assert not torch.allclose(past, with_sinks)
    marks = [m for m in handed if m is not None]
    assert marks and all(m.shape[0] == 1 and m[0, :4].logical_not().all() and m[0, 4:].all() for m in marks)
    assert all(m.shape[-1] > 4 for m in marks)  # a window beside the 4 sinks
    with pytest.raises(lcx.LcxError, match="gate_sinks=false says what a gate measures against, and gate is off"):
        lcx.attach(model, ["fot"], gate="off", gate_sinks=False)


def test_gate_on_a_model_changes_what_memory_adds_and_is_checked():
    model, ids = tiny_model("llama"), _ids()
    base = _logits(model, ids, local=32)[0]
    torch.testing.assert_close(_logits(model, ids, local=32, gate=-1e4)[0], base)
    shut = _logits(model, ids, local=32, gate=1e4)[0]
    assert not torch.allclose(shut, base)
    half = _logits(model, ids, local=32, gate="0")[0]
    assert not torch.allclose(half, base) and not torch.allclose(half, shut)
    with pytest.raises(lcx.LcxError, match="gate must be a number .*, off or auto, got 'some'"):
        lcx.attach(model, ["fot"], gate="some")


def test_memory_heads_left_out_attend_to_their_local_keys_only():
    """memory_heads: a query head left out reads its local keys alone (what it computes with an empty memory),
    the heads kept read memory as with every head (the mask is per query head, inside a KV head's group)."""
    from lcx.plugins.fot.attention import memory_attention
    from lcx.plugins.fot.memory import StoreConfig, make_store

    g = torch.Generator().manual_seed(3)
    B, H, Hkv, T, S, D, M = 1, 4, 2, 5, 6, 8, 9
    q, k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    memory = {}
    for h in range(Hkv):
        memory[(0, h)] = store = make_store(StoreConfig(kind="torch"))
        store.add(torch.randn(M, D, generator=g), torch.randn(M, D, generator=g), torch.arange(M), 0)
    empty = {(0, h): make_store(StoreConfig(kind="torch")) for h in range(Hkv)}
    mask, shift = torch.zeros(1, 1, T, S), torch.zeros(B, T, dtype=torch.float64)

    def attend(mem, heads=None):  # no rotation, scale 1/sqrt(D), top-4, blocks of 2 queries
        return memory_attention(q, k, v, mask, mem, shift, None, D ** -0.5, 4, False, 2, None, heads)

    every, local = attend(memory), attend(empty)
    heads = torch.tensor([True, False, True, False])  # the first head of each KV head's group (h * G + g)
    got = attend(memory, heads)
    assert not torch.allclose(every, local)
    torch.testing.assert_close(got[:, :, heads], every[:, :, heads])
    torch.testing.assert_close(got[:, :, ~heads], local[:, :, ~heads])


def test_memory_heads_on_a_model_and_its_checks():
    model, ids = tiny_model("llama"), _ids()  # 2 layers, 2 query heads
    base = _logits(model, ids, local=32, memory_layers="all")[0]
    torch.testing.assert_close(_logits(model, ids, local=32, memory_layers="all", memory_heads="0:0,0:1,1:0,1:1")[0], base)
    some = _logits(model, ids, local=32, memory_layers="all", memory_heads="1:1")[0]
    shut = _logits(model, ids, local=32, memory_layers="all", gate=1e9)[0]  # no head reads memory
    assert not torch.allclose(some, base) and not torch.allclose(some, shut)
    for spec, match in [("7", "LAYER:HEAD pairs like 7:6,14:1; got '7'"), ("1:x", "got '1:x'")]:
        with pytest.raises(lcx.LcxError, match=match):
            lcx.attach(model, ["fot"], memory_heads=spec)
    with pytest.raises(lcx.LcxError, match=r"head 1:2 out of range: the model has 2 query heads per layer \(0..1\)"):
        lcx.attach(model, ["fot"], memory_layers="all", memory_heads="1:2").__enter__()
    with pytest.raises(lcx.LcxError, match="1:0 names layer 1, which reads no memory \\(memory layers: 0\\)"):
        lcx.attach(model, ["fot"], memory_layers="0", memory_heads="0:1,1:0").__enter__()


def test_positions_modes_differ_and_are_deterministic():
    model = tiny_model("llama")
    outs = {p: _logits(model, _ids(), local=32, positions=p)[0] for p in ("first", "fixed", "none")}
    assert not torch.allclose(outs["first"], outs["none"], atol=1e-4)
    assert not torch.allclose(outs["first"], outs["fixed"], atol=1e-4)
    again, _ = _logits(model, _ids(), local=32, positions="first")
    assert torch.equal(again, outs["first"])


def test_generate_batch_and_long_inputs_keep_memory_per_row():
    model = tiny_model("llama")
    ids = torch.cat([_ids(seed=1), _ids(seed=2)])
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    with lcx.attach(model, ["fot"], local=32, **PAPER) as run:  # sinks refuse a padded batch past the window
        new = lcx.generate(run, ids, mask, max_new_tokens=5)
        stores = run.memory.lcx_stores
    assert new.shape == (2, 5)
    layer = min(stores)
    # row 1's 30 padding tokens never enter memory; its positions start at 0
    assert len(stores[layer][(0, 0)]) - len(stores[layer][(1, 0)]) == 30
    assert stores[layer][(1, 0)].positions.min().item() == 0


def test_a_row_padded_longer_than_a_chunk_answers_as_it_does_alone():
    """Left padding longer than a chunk: the padding's queries see no key while the other row already reads
    memory.  They gave NaN there (-inf masks under a plain softmax), which the next layers' keys carried into
    the row's real tokens: 4 layers, the padded row generated token 0 only."""
    model = tiny_model("llama", num_hidden_layers=4)
    long, short = _ids(120, seed=1), _ids(40, seed=2)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 80, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :80] = 0
    logits = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o[-1, -1].detach().clone()))
    try:
        with lcx.attach(model, ["fot"], local=32, memory_layers="0,1", **PAPER) as run:
            batch = lcx.generate(run, ids, mask, max_new_tokens=4)[1]
        padded, logits[:] = list(logits), []
        with lcx.attach(model, ["fot"], local=32, memory_layers="0,1", **PAPER) as run:
            alone = lcx.generate(run, short, None, max_new_tokens=4)[0]
    finally:
        hook.remove()
    assert all(torch.isfinite(x).all() for x in padded)
    assert torch.equal(batch, alone)
    # window boundaries are cut at batch-wide positions, so the padded row's local/memory split differs a little
    # (the last forward of each: the generated tokens'; prefills take as many forwards as their chunks)
    assert max(float((x - y).abs().max()) for x, y in zip(padded[-4:], logits[-4:])) < 0.05


def test_cap_evicts_oldest():
    model = tiny_model("llama")
    _, stores = _logits(model, _ids(), local=32, max_entries=50)
    for per_layer in stores.values():
        for s in per_layer.values():
            assert len(s) == 50 and s.positions.min().item() > 0


def test_bad_options():
    model = tiny_model("llama")
    with pytest.raises(lcx.LcxError, match="k must be > 0"):
        lcx.attach(model, ["fot"], k=0)
    with pytest.raises(lcx.LcxError, match=r"train_k must be >= 0 \(0 = every memory key\), got -1"):
        lcx.attach(model, ["fot"], train_k=-1)
    with pytest.raises(lcx.LcxError, match="memory layer 9 out of range: the model has 2 layers"):
        lcx.attach(model, ["fot"], memory_layers="0,9")
    with pytest.raises(lcx.LcxError, match=r"fixed_distance must be >= 0 \(0 = local\), got -5"):
        lcx.attach(model, ["fot"], positions="fixed", fixed_distance=-5)
    with pytest.raises(lcx.LcxError, match="unknown memory backend"):
        lcx.attach(model, ["fot"], backend="annoy")
    assert model.config._attn_implementation == "sdpa"


def test_memory_from_another_model_is_refused(tmp_path):
    from lcx.adapters.peft_bridge import base_identity
    from lcx.plugins.fot.memory import make_store

    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    store = make_store(kind="torch")
    store.add(torch.randn(4, 32), torch.randn(4, 32), torch.arange(4))
    save_memory({(0, 0): store}, tmp_path / "mem", {"model": base_identity(a)})
    with lcx.attach(b, ["fot"]) as run:
        with pytest.raises(lcx.LcxError, match="built with another model"):
            run.method("fot").load(tmp_path / "mem", b)
    with lcx.attach(a, ["fot"], memory_layers="0") as run:  # the layer the memory holds
        meta = run.method("fot").load(tmp_path / "mem", a)
        assert run.method("fot").mode == "multi" and meta["model"]["model_type"] == "llama"


def test_memory_build_then_generate_with_it(tmp_path):
    from click.testing import CliRunner

    from lcx.cli import main
    from tests.helpers import make_tiny_model_dir

    m = make_tiny_model_dir(tmp_path / "m", max_position_embeddings=256)
    (tmp_path / "a.txt").write_text("alpha document. " * 20)
    (tmp_path / "b.txt").write_text("beta document here. " * 20)
    r = CliRunner().invoke(main, ["memory", "build", "-m", str(m), "-o", "local=64", "--out", str(tmp_path / "mem"),
                                  str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])
    assert r.exit_code == 0, r.output
    import json

    meta = json.loads((tmp_path / "mem" / "memory.json").read_text())
    assert [d["doc_id"] for d in meta["documents"]] == [0, 1]
    total = sum(d["tokens"] for d in meta["documents"])
    from lcx.plugins.fot.memory import load_memory

    stores, _ = load_memory(tmp_path / "mem")
    assert all(len(s) == total for s in stores.values())  # every token of both documents is in memory
    assert set(stores[(0, 0)].doc_ids.tolist()) == {0, 1}
    r = CliRunner().invoke(main, ["generate", "-m", str(m), "--method", "fot", "-o", "local=64", "--memory",
                                  str(tmp_path / "mem"), "-p", "which document?", "-n", "4", "--json"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["memory", "build", "-m", str(m), "--out", str(tmp_path / "mem"), str(tmp_path / "a.txt")])
    assert r.exit_code == 2 and "--overwrite" in r.output
    # read with other memory layers, its keys would never be read: refused, naming the layers it holds
    r = CliRunner().invoke(main, ["generate", "-m", str(m), "--method", "fot", "-o", "local=64", "-o", "memory_layers=0",
                                  "--memory", str(tmp_path / "mem"), "-p", "which document?", "-n", "4"])
    layers = ",".join(str(x) for x in sorted({int(s.split(".")[0]) for s in meta["stores"]}))
    assert r.exit_code == 2 and f"holds memory layers {layers}" in r.output and f"-o fot.memory_layers={layers}" in r.output


def test_chunk_slides_the_local_window():
    """chunk < local: every layer keeps exactly ``local`` keys, memory holds everything before them, in order."""
    model = tiny_model("llama")
    with lcx.attach(model, ["fot"], local=32, chunk=8, memory_layers="0", **PAPER) as run:
        tail_logits(run, _ids(), 40)
        cache = run.memory
        assert [e - s for s, e in run.plan.windows] == [8] * (N // 8)
    assert all(layer.keys.shape[-2] == 32 for layer in cache.layers)
    store = cache.lcx_stores[0][(0, 0)]
    assert torch.equal(store.positions, torch.arange(N - 32))
    with lcx.attach(model, ["fot"], local=32, chunk=64) as run:  # more than local is cut to local
        assert run.method("fot").chunk == 32 and run.method("fot").to_options()["chunk"] == 32
    with pytest.raises(lcx.LcxError, match=r"chunk and sinks must be >= 0 \(got chunk=-1, sinks=4\)"):
        lcx.attach(model, ["fot"], chunk=-1)


def test_sinks_keep_the_prompts_first_tokens_beside_the_window_as_streaming_does():
    """sinks=S: the first S tokens never go to memory and are read, re-rotated to sit right before the local
    keys, by every later query. With no memory key read (a gate no score reaches), fot's local + sinks cache
    is streaming's: the same logits as streaming with sinks=S and a window of local - chunk."""
    model = tiny_model("llama")
    ids = _ids()
    with lcx.attach(model, ["streaming"], sinks=4, window=24, chunk=8) as run:
        want = tail_logits(run, ids, 40)
    with lcx.attach(model, ["fot"], local=32, chunk=8, sinks=4, gate=1e9, memory_layers="0") as run:
        got = tail_logits(run, ids, 40)
        cache = run.memory
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert all(layer.held_sinks == 4 and layer.keys.shape[-2] == 32 for layer in cache.layers)
    assert torch.equal(cache.lcx_stores[0][(0, 0)].positions, torch.arange(4, N - 32))  # sinks stay out of memory
    plain, _ = _logits(model, ids, local=32, chunk=8, gate=1e9, memory_layers="0")
    assert not torch.allclose(plain, got, atol=1e-3)  # without sinks the window alone answers
    with pytest.raises(lcx.LcxError, match=r"sinks must be in 0..local - 1 \(31\), got 32"):
        lcx.attach(model, ["fot"], local=32, sinks=32)
    ids2 = torch.cat([ids[:, :60], torch.cat([torch.zeros(1, 20, dtype=torch.long), ids[:, :40]], 1)])
    mask = torch.ones_like(ids2)
    mask[1, :20] = 0
    with lcx.attach(model, ["fot"], local=32, sinks=4) as run:
        with pytest.raises(lcx.LcxError, match=r"fot sinks=4: a left-padded batch of 60 \+ 2 tokens moves past"):
            lcx.generate(run, ids2, mask, max_new_tokens=2)


def test_multi_doc_memory_holds_each_document_as_if_indexed_alone_in_any_order():
    """Documents are encoded on their own: a memory of A and B is A's memory plus B's, whatever the order."""
    model = tiny_model("llama")
    a, b = _ids(150, seed=1), _ids(90, seed=2)

    def build(*docs):
        with lcx.attach(model, ["fot"], local=32, memory_layers="0,1", mode="multi") as run:
            for doc_id, ids in docs:
                run.method("fot").ingest(run, ids, doc_id)
            return run.method("fot").stores_for_saving()

    def part(stores, doc_id):
        out = {}
        for key, s in stores.items():
            keep = s.doc_ids == doc_id
            out[key] = (s.keys[keep], s.values[keep], s.positions[keep])
        return out

    ab, ba, only_a, only_b = build((0, a), (1, b)), build((1, b), (0, a)), build((0, a)), build((1, b))
    for doc_id, alone in ((0, only_a), (1, only_b)):
        for key, (k, v, p) in part(alone, doc_id).items():
            assert len(p) == (150 if doc_id == 0 else 90)  # every token, the last window flushed too
            for both in (ab, ba):
                k2, v2, p2 = part(both, doc_id)[key]
                assert torch.equal(k, k2) and torch.equal(v, v2) and torch.equal(p, p2)


@pytest.mark.slow
def test_smollm2_multi_doc_memory_answers_about_a_and_about_b():
    """The issue's multi-document check on the real model, training-free (results/fot/multidoc, task kinds):
    one memory of document A (a pass key) and document B (a city's name) answers a question about each,
    in either indexing order, and the same memory without the documents does not."""
    from lcx.evals.passkey import FILLER, INSTRUCTION
    from lcx.generation import generate
    from lcx.models import load_model

    model, tok = load_model("smollm2-135m")
    enc = lambda s: tok(s, return_tensors="pt")["input_ids"]  # noqa: E731
    fill = lambda n: (" " + FILLER) * n  # noqa: E731
    docs = [INSTRUCTION + "\n" + fill(10) + " " + fact + fill(10) for fact in (
        "The pass key is 58203. Remember it. 58203 is the pass key.",
        "The secret city is called Quenmoor. Remember it. Quenmoor is the name of the secret city.")]
    prompt = INSTRUCTION + "\n" + fill(5) + "\n"
    questions = {"58203": prompt + "What is the pass key? The pass key is",
                 "Quenmoor": prompt + "What is the secret city called? The secret city is called"}
    for order in (docs, docs[::-1], []):
        with lcx.attach(model, ["fot"], local=1024, chunk=256, memory_layers="all", mode="multi", **PAPER) as run:
            for i, d in enumerate(order):
                run.method("fot").ingest(run, enc(d), i)
            answers = {want: tok.decode(generate(run, enc(q), max_new_tokens=6)[0]) for want, q in questions.items()}
        for want, text in answers.items():
            assert (want in text.replace(" ", "")) == bool(order), (len(order), answers)


def test_auto_memory_layers_are_the_full_attention_layers_of_a_sliding_window_model():
    """A sliding-window layer reads only its window: memory there broke Gemma 3's output, so auto skips them."""
    from lcx.plugins.fot import FoT

    gemma = (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert FoT().layers_of(18, gemma) == [5, 11, 17]
    assert FoT().layers_of(30) == [7, 15, 22] == FoT().layers_of(30, ["full_attention"] * 30)
    assert FoT(memory_layers="all").layers_of(18, gemma) == list(range(18))  # explicit choices stay the user's
    assert FoT(memory_layers="4,9").layers_of(18, gemma) == [4, 9]


def test_local_0_is_the_models_window_so_memory_holds_only_what_truncation_drops():
    """local=0: each model's own window (128 here) as the local window, set when fot attaches; the same logits
    as local=128 given by hand, and the chunk and sinks checked against it then."""
    model = tiny_model("llama")
    ids = torch.randint(3, 120, (1, 200), generator=torch.Generator().manual_seed(0))
    got = {}
    for local in (0, 128):
        with lcx.attach(model, ["fot"], local=local, chunk=16, sinks=2, memory_layers="0") as run:
            assert run.method("fot").local == 128
            got[local] = tail_logits(run, ids, 4)
    torch.testing.assert_close(got[0], got[128])
    with lcx.attach(model, ["fot"], local=0, chunk=200) as run:  # cut to the window once it is known
        assert run.method("fot").chunk == 128
    with pytest.raises(lcx.LcxError, match=r"sinks must be in 0..local - 1 \(127\), got 200"):
        lcx.attach(model, ["fot"], local=0, sinks=200)
    config = {"model_type": "llama", "num_hidden_layers": 4, "max_position_embeddings": 128}
    assert FoT.from_options(local=0, memory_layers="1").resolved(config) == {"memory_layers": "1", "gate": -1.0,
                                                                           "local": 128}  # no folder: auto's fallback


def test_records_written_before_the_defaults_changed_keep_fots_own_settings():
    """fot's defaults became results/fot/ppl-safe's (the whole window local, sinks, memory keys at 4096, a gate:
    -1, then auto): an adapter sidecar or journal that lacks those options ran FoT's own, and is read so, not at
    today's."""
    from lcx.session import trained_methods

    changed = ("local", "chunk", "sinks", "positions", "fixed_distance", "gate")
    assert [FoT.default_options()[k] for k in changed] == [0, 256, 4, "fixed", 4096, "auto"]
    assert [FoT.unrecorded_options()[k] for k in changed] == [2048, 0, 0, "first", 0, "off"]
    old = {"methods": [{"name": "fot", "options": {"local": 256, "chunk": 0, "positions": "first", "k": 32}}]}
    assert trained_methods(old)["fot"] == {"local": 256, "chunk": 0, "positions": "first", "k": 32,
                                           "sinks": 0, "fixed_distance": 0, "gate": "off"}


@pytest.mark.parametrize("sinks", [0, 4])
@pytest.mark.parametrize("family", ["gemma3_text", "mistral"])
def test_a_sliding_window_layer_keeps_only_its_window_and_answers_the_same(monkeypatch, sinks, family):
    """A sliding-window layer without memory keeps its window of past keys, not fot's whole local window: the keys
    it drops were masked out anyway, so logits and generated tokens (a left-padded batch's, without sinks) are
    those of the layer that keeps them all (chunks longer than the window included).  Gemma 3 names the window per
    layer; Mistral slides every layer over its config's window."""
    from lcx.adapters import families

    # layer 0 slides over 8 tokens; layer 1 attends fully (gemma3) or holds fot's memory (mistral: every layer slides)
    model = tiny_model(family, sliding_window=8)
    ids = _ids()
    batch = torch.cat([ids[:, :90], torch.cat([torch.zeros(1, 30, dtype=torch.long), ids[:, 100:160]], 1)])
    mask = torch.ones_like(batch)
    mask[1, :30] = 0
    if sinks:  # fot refuses sinks over left padding: one row
        batch, mask = ids[:, :90], None
    opts = dict(local=32, chunk=16, sinks=sinks, memory_layers="1")

    def run_all():
        logits, _ = _logits(model, ids, **opts)
        with lcx.attach(model, ["fot"], **{**PAPER, **opts}) as run:
            tokens = lcx.generate(run, batch, mask, max_new_tokens=6)
            kept = [layer.keys.shape[-2] for layer in run.memory.layers]
        return logits, tokens, kept

    logits, tokens, kept = run_all()
    assert kept == [8, 32]  # the sliding layer: its window (decode steps keep it); the full layer: local
    monkeypatch.setattr(families, "sliding_windows", lambda model, family: [None] * 2)
    want_logits, want_tokens, want_kept = run_all()
    assert want_kept == [32, 32]
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, want_tokens)
