"""focusllm: chunking, candidate keys/values (base = untrained adapter), serial = parallel, contiguous positions."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import lcx
from lcx.adapters.peft_bridge import add_adapter
from lcx.adapters.rotary import rotate
from lcx.errors import LcxError
from lcx.generation import generate, make_plan, prefill, tail_logits
from lcx.plugins.focusllm import chunk_spans
from tests.conftest import tiny_model

OPTS = {"chunk": 16, "local": 24, "fragment": 8}  # tiny llama: window 128


def _ids(T=100, rows=1, seed=0):
    return torch.randint(3, 256, (rows, T), generator=torch.Generator().manual_seed(seed))


def _reference_candidates(model, ids, chunk=16, local=24, fragment=8, overlap=0, scored=0):
    """Each chunk (with the `overlap` tokens before it) + the last `fragment` local tokens (before the `scored`
    last ones) through the plain model; the last position's keys/values per layer, moved from that position to
    the candidate's slot i."""
    T = ids.shape[1]
    memory, frag = ids[:, : T - local], ids[:, T - scored - fragment:T - scored]
    inv = model.model.rotary_emb.inv_freq
    per_layer = None
    for i, start in enumerate(range(0, memory.shape[1], chunk)):
        x = torch.cat([memory[:, max(0, start - overlap):start + chunk], frag], dim=1)
        with torch.no_grad():
            cache = model(input_ids=x, use_cache=True).past_key_values
        kv = [(rotate(l.keys[:, :, -1:], i - (x.shape[1] - 1), inv), l.values[:, :, -1:]) for l in cache.layers]
        per_layer = kv if per_layer is None else [(torch.cat([a, k], 2), torch.cat([b, v], 2))
                                                 for (a, b), (k, v) in zip(per_layer, kv)]
    return per_layer


def test_chunks_and_a_plan_of_placeholders_then_the_local_tokens():
    assert chunk_spans(76, 16) == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 76)]
    assert chunk_spans(76, 16, overlap=5) == [(0, 16), (11, 32), (27, 48), (43, 64), (59, 76)]
    model = tiny_model("llama")
    ids = _ids()
    with lcx.attach(model, ["focusllm"], focusllm=OPTS) as run:
        plan = make_plan(run, ids, None, 0)
    assert plan.windows == [(0, 5), (5, 29)] and plan.info == {"candidates": 5, "chunk": 16, "memory_tokens": 76}
    assert torch.equal(plan.input_ids[:, 5:], ids[:, -24:])  # the local tokens, after 5 candidate slots


@pytest.mark.parametrize("overlap", [0, 5])
def test_untrained_adapter_candidates_equal_the_base_models_keys_and_values(overlap):
    base = tiny_model("llama")
    ref = _reference_candidates(base, _ids(), overlap=overlap)
    assert overlap == 0 or not torch.allclose(ref[1][0], _reference_candidates(base, _ids())[1][0], atol=1e-3)
    peft = add_adapter(tiny_model("llama"), roles=("q", "k", "v", "o"), rank=4).eval()  # zero-initialised B
    with lcx.attach(peft, ["focusllm"], focusllm={**OPTS, "overlap": overlap}) as run:
        assert "focusllm_gate" in run.state
        cache = prefill(run, make_plan(run, _ids(), None, 0))
    for layer, (k, v) in zip(cache.layers, ref):
        torch.testing.assert_close(layer.keys, k, atol=1e-5, rtol=0)
        torch.testing.assert_close(layer.values, v, atol=1e-5, rtol=0)


def test_a_trained_adapter_changes_the_candidates_and_nothing_else():
    base = tiny_model("llama")
    peft = add_adapter(tiny_model("llama"), roles=("q", "k", "v", "o"), rank=4).eval()
    torch.manual_seed(3)
    for n, p in peft.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.5)
    ids = _ids()
    with lcx.attach(peft, ["focusllm"], focusllm=OPTS) as run:
        cache = prefill(run, make_plan(run, ids, None, 0))
        with torch.no_grad():  # the gate is closed outside candidates: a short input is the base model
            short = peft(input_ids=ids[:, :20]).logits
    assert not torch.allclose(cache.layers[1].keys, _reference_candidates(base, ids)[1][0], atol=1e-3)
    with torch.no_grad():
        torch.testing.assert_close(short, base(input_ids=ids[:, :20]).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("overlap", [0, 5])  # with an overlap the first chunk is shorter than the others
def test_serial_and_parallel_chunks_give_the_same_logits(overlap):
    model = tiny_model("llama")
    ids = _ids(rows=2)
    out = {}
    for parallel in (0, 1, 2):
        with lcx.attach(model, ["focusllm"], focusllm={**OPTS, "parallel": parallel, "overlap": overlap}) as run:
            out[parallel] = tail_logits(run, ids[:1], 16), generate(run, ids, max_new_tokens=4)
    for p in (1, 2):
        torch.testing.assert_close(out[p][0], out[0][0], atol=1e-5, rtol=0)
        assert torch.equal(out[p][1], out[0][1])


def test_local_tokens_read_the_candidates_at_contiguous_positions():
    """The local tokens' logits equal an explicit computation: a cache holding the reference candidates
    at positions 0..n-1, then the local tokens at positions n..n+23.  Scoring the last 16 tokens, the
    candidates read the 8 local tokens before them (the fragment never holds a scored token)."""
    model = tiny_model("llama")
    ids = _ids()
    ref = _reference_candidates(model, ids, scored=16)
    cache = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(ref):
        cache.update(k, v, layer)
    with torch.no_grad():
        want = model(input_ids=ids[:, -24:], position_ids=torch.arange(5, 29)[None], past_key_values=cache).logits[0, :-1]
    with lcx.attach(model, ["focusllm"], focusllm=OPTS) as run:
        got = tail_logits(run, ids, 16)
    torch.testing.assert_close(got, want[-16:], atol=1e-5, rtol=0)


def _topk_reference_attention(n: int, k: int):
    """An attention function for transformers' registry, written out per head and query: each query reads its k
    best-scoring keys among the first n (the candidates) and every key after them up to its own position."""
    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        B, Hq, T, D = query.shape
        g, S = Hq // key.shape[1], key.shape[2]
        out = torch.zeros(B, T, Hq, D)
        for b in range(B):
            for h in range(Hq):
                for t in range(T):
                    q, keys, vals = query[b, h, t], key[b, h // g], value[b, h // g]
                    raw = keys @ q
                    best = sorted(range(n), key=lambda j: -float(raw[j]))[:k]
                    seen = best + list(range(n, S - T + t + 1))
                    w = torch.softmax(raw[seen] * scaling, dim=0)
                    out[b, t, h] = w @ vals[seen]
        return out, None
    return attend


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_topk_local_queries_read_their_best_candidates_only(k, impl):
    """-o focusllm.topk=k: the local tokens' logits equal an explicit computation where each query head reads
    its k highest-scoring candidates (of 5) and all local tokens before it; they differ from reading all."""
    from transformers import AttentionInterface

    model = tiny_model("llama", attn_implementation=impl)
    ids = _ids()
    ref = _reference_candidates(model, ids, scored=16)
    AttentionInterface.register("lcx_test_topk", _topk_reference_attention(5, k))
    explicit = tiny_model("llama", attn_implementation="lcx_test_topk")
    cache = DynamicCache(config=explicit.config)
    for layer, (kk, v) in enumerate(ref):
        cache.update(kk, v, layer)
    with torch.no_grad():
        want = explicit(input_ids=ids[:, -24:], position_ids=torch.arange(5, 29)[None], past_key_values=cache).logits[0, :-1]
    with lcx.attach(model, ["focusllm"], focusllm={**OPTS, "topk": k}) as run:
        got = tail_logits(run, ids, 16)
        ahead = generate(run, ids, max_new_tokens=3)
    with lcx.attach(model, ["focusllm"], focusllm=OPTS) as run:
        every = tail_logits(run, ids, 16)
        assert run.implements("lcx_attention") == []  # the paper's attention: no stage claimed
    with lcx.attach(model, ["focusllm"], focusllm={**OPTS, "topk": k}) as run:
        assert run.implements("lcx_attention") == ["focusllm"]
    torch.testing.assert_close(got, want[-16:], atol=1e-5, rtol=0)
    assert not torch.allclose(got, every, atol=1e-3)
    assert ahead.shape == (1, 3)  # generation runs through the same attention
    with lcx.attach(model, ["focusllm"], focusllm={**OPTS, "topk": 5}) as run:  # as many as there are: all
        torch.testing.assert_close(tail_logits(run, ids, 16), every, atol=1e-6, rtol=0)


def test_scored_logits_never_read_the_tokens_they_predict():
    """Perplexity is causal: changing the last token changes no logit that predicts an earlier one.  The
    fragment (the prompt's last local tokens, read by every candidate) held the scored tokens, so each logit
    read what it predicted (all 22 did); with 23 of 24 local tokens scored, one token is left to read."""
    model = tiny_model("llama")
    ids = _ids()
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 250 + 3
    with lcx.attach(model, ["focusllm"], focusllm=OPTS) as run:
        for n in (23, 16):
            a, b = tail_logits(run, ids, n), tail_logits(run, changed, n)
            assert torch.equal(a[:-1], b[:-1]), n
        with pytest.raises(LcxError, match=r"focusllm scores at most its local tokens minus one \(23\), got 24"):
            tail_logits(run, ids, 24)


def test_a_memory_of_one_chunk_and_an_input_shorter_than_local():
    model = tiny_model("llama")
    with lcx.attach(model, ["focusllm"], focusllm=OPTS) as run:
        plan = make_plan(run, _ids(T=34), None, 0)  # 10 memory tokens: one (short) chunk
        assert plan.windows == [(0, 1), (1, 25)]
        assert generate(run, _ids(T=34), max_new_tokens=3).shape == (1, 3)
        assert make_plan(run, _ids(T=20), None, 0).windows == [(0, 20)]  # all local: the model as it is


def test_a_plan_left_unused_never_reaches_the_next_prompt():
    """A plan whose caller failed before the memory stage (or `make_plan` on its own) leaves its candidates in
    the run's state; a following prompt short enough to be read as it is got them in its cache."""
    model = tiny_model("llama")
    short = _ids(T=5, seed=3)
    with lcx.attach(model, ["focusllm"], focusllm=OPTS) as run:
        alone = generate(run, short, max_new_tokens=4)
        make_plan(run, _ids(), None, 0)  # candidates computed, never used
        assert torch.equal(generate(run, short, max_new_tokens=4), alone)


def test_recall_draws_always_fit_the_memory():
    """A copied span (cue + fresh tokens) longer than the memory left an empty random range: ValueError at a
    fixed step (18 of 2,000 with fresh=32, chunks 32/64, 1,024-token windows), and again on --resume."""
    import random

    from lcx.plugins.focusllm import FocusLLM

    m = FocusLLM(losses="continuation,recall", fresh=32, train_chunks="32,64")
    for step in range(2000):
        draw = m._draw(8192, 1024, "recall", random.Random(f"focusllm:0:{step}"))  # window 8K, 1K-token rows
        assert 0 <= draw.source and draw.source + draw.copied <= draw.memory, (step, draw)


def test_an_adapter_on_a_sliding_window_model_asks_for_refresh_0():
    """gemma2 (sliding layers) with a candidate adapter: refreshing crashed inside transformers' cache (crop on a
    sliding layer) at the prompt or partway through generation; it is refused up front, and refresh=0 works."""
    model = _adapted(tiny_model("gemma2"))
    ids = _ids(T=24 + 64)
    with lcx.attach(model, ["focusllm"], focusllm=OPTS) as run:
        with pytest.raises(LcxError, match=r"sliding-window layers \(sliding_window=64\).*use -o focusllm.refresh=0"):
            generate(run, ids, max_new_tokens=3)
    with lcx.attach(model, ["focusllm"], focusllm={**OPTS, "refresh": 0}) as run:
        assert generate(run, ids, max_new_tokens=3).shape == (1, 3)


def test_an_adapter_refreshes_on_a_window_no_layer_uses():
    """Qwen2 with use_sliding_window and max_window_layers covering every layer names a window (config.sliding_window)
    that no layer slides over: refreshing works there and was refused by the config's field alone."""
    model = _adapted(tiny_model("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=2))
    assert model.config.sliding_window == 64 and set(model.config.layer_types) == {"full_attention"}
    with lcx.attach(model, ["focusllm"], focusllm=OPTS) as run:
        assert generate(run, _ids(T=24 + 64), max_new_tokens=3).shape == (1, 3)


def _adapted(model):
    from lcx.adapters.peft_bridge import add_adapter

    return add_adapter(model, roles=("q", "k", "v", "o"), rank=4).eval()


def test_refreshed_chunks_past_the_window_are_refused_with_a_chunk_that_fits():
    """Refreshing grows each chunk's sequence by the generated tokens: 112 + 8 + 29 ran to position 148 of a
    128-token window, unchecked.  The error's chunk fits; refresh=0 needs no room."""
    model = tiny_model("llama")
    ids = _ids(T=248)
    opts = {"chunk": 112, "fragment": 8, "local": 24}
    with lcx.attach(model, ["focusllm"], focusllm=opts) as run, pytest.raises(
            LcxError, match=r"a chunk's 120 tokens \+ 29 generated ones exceed the model's window \(128\); use "
                            r"-o focusllm.chunk=91 or less"):
        generate(run, ids, max_new_tokens=30)
    for fix in ({"chunk": 91}, {"refresh": 0}):
        with lcx.attach(model, ["focusllm"], focusllm={**opts, **fix}) as run:
            assert generate(run, ids, max_new_tokens=30).shape == (1, 30)


def test_chunk_auto_doubles_the_chunk_until_the_memory_makes_few_candidates(monkeypatch):
    """chunk=auto: BASE_CHUNK, doubled while the memory would make more than MAX_CANDIDATES candidates, up to
    what one chunk's forward may read in the window (less the new tokens it refreshes with); the prompt's
    candidates are those an explicit chunk of that size makes, and the size is reported."""
    from lcx.plugins.focusllm import method as focus

    monkeypatch.setattr(focus, "BASE_CHUNK", 8)
    monkeypatch.setattr(focus, "MAX_CANDIDATES", 4)
    model = tiny_model("llama")  # window 128: a chunk's forward reads at most 128 - fragment 8 = 120 more
    opts = {"local": 24, "fragment": 8}
    # memory 32: 4 chunks of 8; 36: 5 of 8, 3 of 16; 76: 10, 5, then 3 of 32; 576: 120 at most, 5 candidates
    for T, new, chunk in ((56, 1, 8), (60, 1, 16), (100, 1, 32), (600, 1, 120), (600, 10, 111)):
        with lcx.attach(model, ["focusllm"], focusllm=opts) as run:
            plan = make_plan(run, _ids(T=T), None, new)
            auto = run.state["focusllm_candidates"]
            assert plan.info["chunk"] == chunk and run.method("focusllm").request_options() == {"chunk": chunk}
        with lcx.attach(model, ["focusllm"], focusllm={**opts, "chunk": chunk}) as run:
            assert make_plan(run, _ids(T=T), None, new).info == plan.info
            assert all(torch.equal(a, b) for pa, pb in zip(auto, run.state["focusllm_candidates"]) for a, b in zip(pa, pb))
            assert run.method("focusllm").request_options() == {}  # a chunk the user gave is not reported again
    monkeypatch.undo()  # the shipped rule, on an 8K window: 2048 up to 64K, 4096 at 128K, 7680 at most
    method = focus.FocusLLM.from_options()
    assert method.chunk == "auto"
    assert [method.chunk_for(8192, t) for t in (16384, 65536, 131072, 1 << 20)] == [2048, 2048, 4096, 7680]
    assert "doubled while the memory makes more than 32 candidates, up to 7,680 (the window less fragment and overlap)" in \
        method.resolved({"model_type": "llama", "max_position_embeddings": 8192})["chunk"]
    with pytest.raises(LcxError, match="chunk must be a number of tokens or auto, got 'big'"):
        lcx.attach(model, ["focusllm"], focusllm={"chunk": "big"})
    with lcx.attach(model, ["focusllm"], focusllm={"fragment": 100, "local": 110}) as run, pytest.raises(
            LcxError, match=r"chunk=100 \(auto's smallest\) \+ fragment=100 exceeds the model's window \(128\); use "
                            r"smaller pieces, e.g. -o focusllm.chunk=64"):
        make_plan(run, _ids(T=200), None, 0)
    with lcx.attach(model, ["focusllm"], focusllm={"fragment": 60, "local": 64}) as run, pytest.raises(
            LcxError, match=r"a chunk's 120 tokens \+ 29 generated ones exceed the model's window \(128\); use a "
                            r"smaller -o focusllm.fragment, fewer new tokens"):  # no chunk as long as the fragment fits
        make_plan(run, _ids(T=200), None, 30)


def test_bad_input():
    with pytest.raises(LcxError, match=r"fragment \(40\) must not be longer than the chunk \(16\)"):
        lcx.attach(tiny_model("llama"), ["focusllm"], focusllm={"chunk": 16, "fragment": 40, "local": 64})
    model = tiny_model("llama")
    with pytest.raises(LcxError, match="overlap must be at least 0 and shorter than the chunk \\(16\\), got 16"):
        lcx.attach(tiny_model("llama"), ["focusllm"], focusllm={**OPTS, "overlap": 16})
    for opts, needle in [({"chunk": 124, "fragment": 8, "local": 24}, r"chunk=124 \+ fragment=8 exceeds the model's window \(128\)"),
                         ({"chunk": 112, "overlap": 10, "fragment": 8, "local": 24},
                          r"chunk=112 \+ overlap=10 \+ fragment=8 exceeds the model's window \(128\); use -o focusllm.chunk=110 or less"),
                         ({"chunk": 16, "fragment": 8, "local": 128}, "local=128 leaves no room for candidates")]:
        with lcx.attach(model, ["focusllm"], focusllm=opts) as run, pytest.raises(LcxError, match=needle):
            make_plan(run, _ids(T=200), None, 0)
    ids, mask = _ids(rows=2), torch.ones(2, 100, dtype=torch.long)
    mask[1, :3] = 0
    with lcx.attach(model, ["focusllm"], focusllm=OPTS) as run, pytest.raises(LcxError, match="padded batches"):
        make_plan(run, ids, mask, 0)


# ---------------------------------------------------------------------- generation: candidate refresh
def _trained_peft(seed=3):
    peft = add_adapter(tiny_model("llama"), roles=("q", "k", "v", "o"), rank=4).eval()
    torch.manual_seed(seed)
    for n, p in peft.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.5)
    return peft


def _slots_after_generation(model, ids, n_new, **opts):
    """Generate n_new greedy tokens; return them and the decoder's candidate slots at the end."""
    with lcx.attach(model, ["focusllm"], focusllm={**OPTS, **opts}) as run:
        new = generate(run, ids, max_new_tokens=n_new)
        cache = run.memory
        gen = run.state.get("focusllm_generation")  # before the next plan, which lets it go
        n = make_plan(run, ids, None, 0).info["candidates"]
        slots = [(l.keys[:, :, :n].clone(), l.values[:, :, :n].clone()) for l in cache.layers]
    return new, slots, gen


def _from_scratch(model, ids, fed, **opts):
    """The candidates recomputed from scratch with the fed generated tokens appended to the fragment."""
    from lcx.plugins.focusllm import candidate_kv, to_slots

    o = {**OPTS, **opts}
    T = ids.shape[1]
    memory, frag = ids[:, : T - o["local"]], torch.cat([ids[:, T - o["fragment"]:], fed], dim=1)
    spans = chunk_spans(memory.shape[1], o["chunk"], o.get("overlap", 0))
    with lcx.attach(model, ["focusllm"], focusllm=o) as run:
        cand = candidate_kv(model, memory, frag, spans, 0, run.state.get("focusllm_gate"))
        lengths = torch.tensor([e - s + frag.shape[1] for s, e in spans])
        return to_slots(cand, lengths - 1, run)


@pytest.mark.parametrize("parallel,overlap", [(0, 0), (1, 0), (0, 5)])
def test_exact_refresh_equals_candidates_recomputed_with_every_generated_token(parallel, overlap):
    model, ids = _trained_peft(), _ids(T=110)  # 86 memory tokens: chunks of 16 and a last one of 6
    new, slots, gen = _slots_after_generation(model, ids, 6, refresh=1, parallel=parallel, overlap=overlap)
    assert gen["refreshes"] == 5  # every generated token but the last (never fed to the model)
    want = _from_scratch(model, ids, new[:, :5], overlap=overlap)
    for (k, v), (wk, wv) in zip(slots, want):
        torch.testing.assert_close(k, wk, atol=1e-5, rtol=0)
        torch.testing.assert_close(v, wv, atol=1e-5, rtol=0)
    stale = _from_scratch(model, ids, new[:, :0])  # the check can fail: refreshed candidates differ from the prompt's
    assert not torch.allclose(slots[1][0], stale[1][0], atol=1e-3)


def test_approximate_refresh_updates_every_n_tokens():
    model, ids = _trained_peft(), _ids(T=110)
    new, slots, gen = _slots_after_generation(model, ids, 6, refresh=3)
    assert gen["refreshes"] == 1 and sum(t.shape[1] for t in gen["pending"]) == 2  # fed 5: one refresh of 3, 2 pending
    for (k, v), (wk, wv) in zip(slots, _from_scratch(model, ids, new[:, :3])):
        torch.testing.assert_close(k, wk, atol=1e-5, rtol=0)
        torch.testing.assert_close(v, wv, atol=1e-5, rtol=0)


def test_refresh_zero_keeps_the_prompts_candidates_and_no_chunk_cache():
    model, ids = _trained_peft(), _ids(T=110)
    new, slots, gen = _slots_after_generation(model, ids, 6, refresh=0)
    assert gen is None
    for (k, v), (wk, wv) in zip(slots, _from_scratch(model, ids, new[:, :0])):
        torch.testing.assert_close(k, wk, atol=1e-5, rtol=0)


def test_refresh_needs_no_chunk_cache_when_only_one_token_is_generated():
    with lcx.attach(tiny_model("llama"), ["focusllm"], focusllm={**OPTS, "refresh": 1}) as run:
        generate(run, _ids(T=110), max_new_tokens=1)
        assert run.state.get("focusllm_generation") is None


@pytest.mark.parametrize("refresh", [1, 0])
def test_prompts_sharing_chunks_take_them_from_the_last_prompt_and_generate_the_same(refresh):
    """A passkey grid's prompts differ in the needle's chunk: with a PrefixReuse the others come from the
    previous prompt (its chunk caches too, refreshed while it generated: they must come back unchanged)."""
    from lcx.generation import PrefixReuse

    model, a = _trained_peft(), _ids(T=110)  # 6 chunks (86 memory tokens)
    b, c = a.clone(), a.clone()
    b[0, 40] = c[0, 40] = 7  # chunk 2 differs from a
    c[0, 70] = 9  # chunk 4 differs from b
    reuse = PrefixReuse()
    with lcx.attach(model, ["focusllm"], focusllm={**OPTS, "refresh": refresh}) as run:
        memo_slots = []
        for ids in (a, b, c, c):
            new = generate(run, ids, max_new_tokens=6, reuse=reuse)
            memo_slots.append((new, [(l.keys[:, :, :6].clone(), l.values[:, :, :6].clone()) for l in run.memory.layers]))
        memo = reuse.memo(run, "focusllm_chunks", None)
    assert memo.hits == 5 + 5 + 6  # b: all but chunk 2; c: all but chunk 4; c again: every chunk
    for ids, (new, slots) in zip((a, b, c, c), memo_slots):
        want_new, want, _ = _slots_after_generation(model, ids, 6, refresh=refresh)
        assert torch.equal(new, want_new)
        for (k, v), (wk, wv) in zip(slots, want):
            torch.testing.assert_close(k, wk, atol=1e-5, rtol=0)
            torch.testing.assert_close(v, wv, atol=1e-5, rtol=0)
    assert not torch.allclose(memo_slots[0][1][1][0], memo_slots[2][1][1][0], atol=1e-3)  # the prompts' candidates differ


@pytest.mark.parametrize("refresh", [1, 0])
def test_a_grids_next_prompt_is_estimated_with_the_chunk_forwards_its_memo_saves(monkeypatch, refresh):
    """The memo holds the last prompt's chunks (gigabytes at 128K), which stay in use: the next prompt's check
    counts only the chunk forwards it will run (those the memo lacks), not every chunk's, so a grid's second
    prompt is not refused for a forward it will not make; a prompt whose chunks all differ is estimated in full."""
    from lcx import limits
    from lcx.generation import PrefixReuse

    a = _ids(T=110)  # 6 chunks
    b = a.clone()
    b[0, 40] = 7  # chunk 2 differs
    want = _slots_after_generation(_trained_peft(), b, 4, refresh=refresh)[0]  # b alone, before memory is capped
    reuse = PrefixReuse()
    monkeypatch.setenv("LCX_HEAP_ALLOWANCE", "1")
    with lcx.attach(_trained_peft(), ["focusllm"], focusllm={**OPTS, "refresh": refresh, "parallel": 0}) as run:
        focus = run.method("focusllm")
        width, per_token = 16 + 8, limits.kv_bytes_per_token(run.model)

        def shapes(ids):
            run.reuse, run.request_ids = reuse, ids
            try:
                return focus.forward_shapes(run, 114), limits.check_request(run, 110, 4)
            finally:
                run.reuse = run.request_ids = None

        def kept(chunks):  # with refresh, the memo's own cache of the chunks decoded, beside the refreshed copies
            return [(1, 0, 0, chunks * width * per_token)] if refresh else []

        local = (1, 24, 30)  # the local tokens read after 6 candidates
        assert focus.forward_shapes(run, 114) == [(6, width, width), local]  # no grid: every chunk at once
        assert shapes(a)[0] == [(6, width, width), local, *kept(6)]  # a grid's first prompt: all of them, kept
        generate(run, a, max_new_tokens=4, reuse=reuse)
        assert run.request_ids is None and run.reuse is None  # shown to the check only
        one, est = shapes(b)
        assert one == [(1, width, width), local, *kept(1)]  # only the chunk b does not share with a
        assert shapes(a)[0] == [local]  # every chunk in the memo: the local tokens' pass alone
        assert shapes(_ids(T=110, seed=1))[0] == [(6, width, width), local, *kept(6)]  # nothing shared
        full = limits.check_request(run, 110, 4)  # as if no memo were there
        assert full["forward_bytes"] > est["forward_bytes"]
        need = (est["kv_bytes"] + est["forward_bytes"]) / limits.Limits.from_env().ram_fraction
        monkeypatch.setattr(limits, "available_memory", lambda device: int(need) + 1)
        with pytest.raises(limits.LimitError, match="more than"):
            limits.check_request(run, 110, 4)  # every chunk's forward: refused
        new = generate(run, b, max_new_tokens=4, reuse=reuse)  # the one forward b needs: it runs
    memo = reuse.peek(run, "focusllm_chunks")
    assert memo.hits == 5 and len(memo.chunks) == 6 and reuse.peek(object(), "focusllm_chunks") is None
    assert torch.equal(new, want)


def test_a_new_request_lets_the_last_ones_state_go_before_the_limits_check(monkeypatch):
    """The limits check measures free memory: the last prompt's decoder cache and refreshed chunk caches
    (7.6 GB at 128K) must be gone by then, not when the new plan replaces them."""
    import lcx.generation as g

    seen, check, trims = [], g.check_request, []

    def held(run):
        return sorted(k for k, v in (("focusllm_generation", run.state.get("focusllm_generation")),
                                     ("memory", run.memory), ("plan", run.plan)) if v is not None)

    monkeypatch.setattr(g, "check_request", lambda run, *a, **kw: seen.append(
        held(run)) or check(run, *a, **kw))
    monkeypatch.setattr(g, "trim_heap", lambda: trims.append(len(seen)))  # freed pages go back to the OS first
    with lcx.attach(_trained_peft(), ["focusllm"], focusllm={**OPTS, "refresh": 1}) as run:
        generate(run, _ids(T=110), max_new_tokens=4)
        assert held(run) == ["focusllm_generation", "memory", "plan"]
        generate(run, _ids(T=110, seed=1), max_new_tokens=4)
        assert run.state.get("focusllm_generation") is not None
    assert seen == [[], []] and trims == [1]  # trimmed before the second check, and only when something was held


# ---------------------------------------------------------------------- training: sampling and loss stages
TRAIN_OPTS = {**OPTS, "train_chunks": "16,32"}


def _explicit_loss(model, ids, d):
    """The continuation/repetition loss written out: each chunk + the fragment through the plain model,
    the last position's keys/values moved to slot i, then the local tokens after them; loss after the fragment."""
    local = ids[:, d.start:d.start + d.local]
    memory, frag = ids[:, :d.memory], local[:, :d.fragment]
    inv = model.model.rotary_emb.inv_freq
    per_chunk = []
    for i, (s, e) in enumerate(chunk_spans(d.memory, d.chunk)):
        x = torch.cat([memory[:, s:e], frag], dim=1)
        cache = model(input_ids=x, use_cache=True).past_key_values
        per_chunk.append([(rotate(l.keys[:, :, -1:], i - (x.shape[1] - 1), inv), l.values[:, :, -1:]) for l in cache.layers])
    cache = DynamicCache(config=model.config)
    for layer in range(len(per_chunk[0])):
        cache.update(torch.cat([c[layer][0] for c in per_chunk], 2), torch.cat([c[layer][1] for c in per_chunk], 2), layer)
    labels = local.clone()
    labels[:, :d.fragment] = -100
    n = len(per_chunk)
    return model(input_ids=local, position_ids=torch.arange(n, n + d.local)[None], past_key_values=cache, labels=labels).loss


def _train_run(peft, **opts):
    run = lcx.attach(peft, ["focusllm"], focusllm={**TRAIN_OPTS, **opts})
    run.seed = 0
    return run


def test_training_draws_follow_the_options_and_are_seeded():
    peft = add_adapter(tiny_model("llama"), roles=("q", "k", "v", "o"), rank=4)
    ids = _ids(T=120)
    with _train_run(peft) as run:
        draws = [run.hook.lcx_sample(run=run, batch={"input_ids": ids}, step=s)["focusllm"] for s in range(40)]
        again = run.hook.lcx_sample(run=run, batch={"input_ids": ids}, step=7)["focusllm"]
        run.rank = 1
        other_process = run.hook.lcx_sample(run=run, batch={"input_ids": ids}, step=7)["focusllm"]
    assert again == draws[7]  # a pure function of (seed, step): resumed runs draw the same
    assert other_process == draws[7]  # and so does every DDP process (as many forwards on each)
    cont = [d["continuation"] for d in draws]
    rep = [d["repetition"] for d in draws]
    assert {d.chunk for d in cont} == {16, 32} and len({d.local for d in cont}) > 3  # both sizes drawn, local varies
    for d in cont:
        assert d.start + d.local == 120 and d.memory == 120 - d.local and 2 <= d.local <= 24
        assert d.fragment == min(8, d.local // 2)
    for d in rep:  # a span copied from the memory, no longer than a chunk
        assert d.memory == 120 - d.local and d.start + d.local <= d.memory and d.local <= d.chunk
    with _train_run(peft, train_chunks="200") as run, pytest.raises(LcxError, match="no chunk size in train_chunks=200 fits"):
        run.hook.lcx_sample(run=run, batch={"input_ids": ids}, step=0)
    with _train_run(peft, train_chunks="8", overlap=10) as run, pytest.raises(
            LcxError, match=r"no chunk size in train_chunks=8 fits .* \(each longer than overlap=10\)"):
        run.hook.lcx_sample(run=run, batch={"input_ids": ids}, step=0)
    with _train_run(peft, train_chunks="8,16", overlap=10) as run:  # chunks no longer than the overlap are not drawn
        assert {run.hook.lcx_sample(run=run, batch={"input_ids": ids}, step=s)["focusllm"]["continuation"].chunk
                for s in range(20)} == {16}


def test_training_loss_equals_the_explicit_computation_and_only_the_adapter_gets_gradients():
    base = tiny_model("llama")
    peft = add_adapter(tiny_model("llama"), roles=("q", "k", "v", "o"), rank=4).train()  # untrained: zero B
    ids = _ids(T=120, seed=5)
    with _train_run(peft) as run:
        batch = run.hook.lcx_sample(run=run, batch={"input_ids": ids}, step=3)
        terms = {k: v for r in run.hook.lcx_loss(run=run, model=peft, batch=batch) for k, v in (r or {}).items()}
        assert set(terms) == {"continuation", "repetition"}
        with torch.no_grad():
            for name, d in batch["focusllm"].items():
                torch.testing.assert_close(terms[name], _explicit_loss(base, ids, d), atol=1e-5, rtol=0)
        sum(terms.values()).backward()
    grads = {n: p.grad for n, p in peft.named_parameters()}
    assert all(g is None for n, g in grads.items() if "lora_" not in n)  # base weights: no gradient, never change
    for role in ("q_proj", "k_proj", "v_proj", "o_proj"):  # the candidate path reaches every projection's adapter
        assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if role in n and "lora_B" in n), role


def test_the_loss_never_sees_the_tokens_it_predicts():
    """The decoder's logits at local position j depend on memory, fragment and local tokens <= j only:
    changing the last local token leaves every earlier logit unchanged (candidates built from the
    local tail would change them all)."""
    peft = _trained_peft().train()
    ids = _ids(T=120, seed=9)
    logits = []
    handle = peft.get_output_embeddings().register_forward_hook(lambda m, i, o: logits.append(o))
    with _train_run(peft, losses="continuation") as run, torch.no_grad():
        batch = run.hook.lcx_sample(run=run, batch={"input_ids": ids}, step=0)
        changed = ids.clone()
        changed[:, -1] = (ids[:, -1] + 1) % 250 + 3
        first = run.hook.lcx_loss(run=run, model=peft, batch=batch)[0]["continuation"]
        decoder_first = logits[-1]
        second = run.hook.lcx_loss(run=run, model=peft, batch={**batch, "input_ids": changed})[0]["continuation"]
        decoder_second = logits[-1]
    handle.remove()
    d = batch["focusllm"]["continuation"]
    assert decoder_first.shape[1] == d.local
    torch.testing.assert_close(decoder_first[:, :-1], decoder_second[:, :-1], atol=0, rtol=0)
    assert not torch.isclose(first, second)  # the last token is a target: its loss term changes


def _exact_generation_logits(peft, memory, local, t0, d, refresh=1, overlap=0):
    """Teacher-forced exact generation (refresh=1) through the inference path: the prompt memory +
    local[:t0 + 1], then each of the next tokens fed after its refresh; the logits of every step."""
    from lcx.generation import prefill

    opts = {**OPTS, "chunk": d.chunk, "local": t0 + 1, "fragment": d.fragment, "refresh": refresh, "overlap": overlap}
    out = []
    with lcx.attach(peft, ["focusllm"], focusllm=opts) as run, torch.no_grad():
        prompt = torch.cat([memory, local[:, :t0 + 1]], dim=1)
        plan = make_plan(run, prompt, None, d.fresh)
        cache = prefill(run, plan)
        n = plan.info["candidates"]
        feed = [plan.input_ids[:, n:]] + [local[:, t0 + j:t0 + j + 1] for j in range(1, d.fresh)]
        at = n
        for ids in feed:
            pos = torch.arange(at, at + ids.shape[1])[None]
            out.append(peft(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1])
            at += ids.shape[1]
        gen = run.state.get("focusllm_generation")
        if refresh:
            assert gen["refreshes"] == d.fresh - 1  # every fed token after the prompt refreshed the candidates
        else:
            assert gen is None  # the prompt's candidates throughout
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("parallel,overlap", [(0, 0), (1, 0), (1, 3)])
def test_fresh_training_predicts_each_token_as_exact_generation_does(parallel, overlap):
    """``fresh``: the training's logits for the last N local tokens equal those of exact generation
    (refresh=1) teacher-forced through the inference path, and only the candidates' adapter gets gradients."""
    peft = _trained_peft(seed=4).train()
    ids = _ids(T=120, seed=11)
    logits, got = [], {}
    handle = peft.get_output_embeddings().register_forward_hook(lambda m, i, o: logits.append(o))
    # parallel=1 also puts the recall term's cue and value among the local tokens (recall_local=1)
    with _train_run(peft, fresh=5, parallel=parallel, losses="continuation,repetition,recall",
                    recall_local=float(parallel), overlap=overlap) as run:
        step = next(s for s in range(2, 40)
                    if (run.hook.lcx_sample(run=run, batch={"input_ids": ids}, step=s)["focusllm"]["recall"].placed >= 0)
                    == bool(parallel))
        batch = run.hook.lcx_sample(run=run, batch={"input_ids": ids}, step=step)
        for term, d in batch["focusllm"].items():
            peft.zero_grad()
            loss = run.hook.lcx_loss(run=run, model=peft, batch={**batch, "focusllm": {term: d}})[0][term]
            loss.backward()
            grads = {n: p.grad for n, p in peft.named_parameters() if p.grad is not None}
            got[term] = (d, logits[-1].detach(), loss.detach(), grads)
    handle.remove()
    assert set(got) == {"continuation", "repetition", "recall"}
    for term, (d, out, loss, grads) in got.items():
        assert d.fresh == min(5, d.local // 2) and d.fragment == min(8, d.chunk, d.local - d.fresh)
        local = ids[:, d.start:d.start + d.local]
        memory = ids[:, :d.memory]
        if term == "recall" and not parallel:  # the window's end, then a cue + the 5 predicted tokens copied from
            # the memory, those 5 (in the memory too) the window's tokens at 5 random positions
            assert 4 + 5 <= d.copied <= d.local - 2 and d.source + d.copied <= d.memory and d.start == d.memory
            memory = torch.cat([memory[:, :d.source + d.copied - 5], ids[:, list(d.values)],
                                memory[:, d.source + d.copied:]], 1)
            local = torch.cat([local[:, :d.local - d.copied], memory[:, d.source:d.source + d.copied]], 1)
        elif term == "recall":  # cue + value: random tokens of the window, at `placed` among the local tokens
            m = d.copied  # and again at the end; the memory unchanged
            span = ids[:, list(d.values)]
            assert len(d.values) == m and 0 <= d.placed <= d.local - 2 * m
            local = torch.cat([local[:, :d.placed], span, local[:, d.placed + m:d.local - m], span], 1)
        t0 = d.local - d.fresh - 1
        assert out.shape[1] == d.fresh  # only the last N tokens are predicted
        torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(out[0], local[0, t0 + 1:]))
        want = _exact_generation_logits(peft, memory, local, t0, d, overlap=overlap)
        torch.testing.assert_close(out, want, atol=2e-4, rtol=0)
        assert grads and all("lora_" in n for n in grads)  # base weights: no gradient
        assert any("k_proj" in n and g.abs().sum() > 0 for n, g in grads.items())
        # the check can fail: read with the prompt's candidates (refresh=0), the later tokens differ
        stale = _exact_generation_logits(peft, memory, local, t0, d, refresh=0, overlap=overlap)
        torch.testing.assert_close(stale[:, 0], want[:, 0], atol=2e-4, rtol=0)
        assert not torch.allclose(stale[:, 1:], want[:, 1:], atol=1e-3), term


def test_bad_training_options_and_base_weights_are_refused():
    with pytest.raises(LcxError, match="losses must name one or more of continuation, repetition, recall"):
        lcx.attach(tiny_model("llama"), ["focusllm"], focusllm={**OPTS, "losses": "continuation,copy"})
    with pytest.raises(LcxError, match="recall_local is a share of the recall draws, from 0 to 1, got 1.5"):
        lcx.attach(tiny_model("llama"), ["focusllm"], focusllm={**OPTS, "recall_local": 1.5})
    with pytest.raises(LcxError, match="recall loss predicts the tokens after its cue.*set -o focusllm.fresh=N"):
        lcx.attach(tiny_model("llama"), ["focusllm"], focusllm={**OPTS, "losses": "recall"})
    with pytest.raises(LcxError, match=r"parallel, refresh, fresh and topk >= 0 \(got .*fresh=-2, topk=0\)"):
        lcx.attach(tiny_model("llama"), ["focusllm"], focusllm={**OPTS, "fresh": -2})
    with pytest.raises(LcxError, match="train_chunks must be positive integers"):
        lcx.attach(tiny_model("llama"), ["focusllm"], focusllm={**OPTS, "train_chunks": "64,big"})
    with lcx.attach(tiny_model("llama"), ["focusllm"], focusllm=OPTS) as run, pytest.raises(LcxError, match="has none"):
        run.hook.lcx_sample(run=run, batch={"input_ids": _ids(T=120)}, step=0)
    peft = add_adapter(tiny_model("llama"), roles=("q", "k", "v", "o"), rank=4, modules_to_save=["k_proj"])
    with _train_run(peft) as run, pytest.raises(LcxError, match="would train for every token; drop --full"):
        run.hook.lcx_sample(run=run, batch={"input_ids": _ids(T=120)}, step=0)


def test_lcx_train_focusllm_learns_and_its_adapter_serves_the_candidates(tmp_path):
    """`lcx train --method focusllm` end to end on a tiny model: both loss terms logged, the saved adapter
    gates in at inference (the candidates change, the short-input path stays the base model)."""
    from lcx.session import open_session
    from lcx.train import TrainConfig, train
    from tests.helpers import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "tiny", hidden_size=128, intermediate_size=256)
    (tmp_path / "doc.txt").write_text("the pass key is 4821. remember it. " * 40)
    out = train(TrainConfig(model=str(model_dir), data=[str(tmp_path / "doc.txt")], out=str(tmp_path / "run"),
                            methods=["focusllm"], options={"focusllm": TRAIN_OPTS}, seq_len=120, steps=4, lr=1e-2),
                progress=False)
    import json

    m = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(m) == 4 and all("loss/continuation" in r and "loss/repetition" in r for r in m)
    s = open_session(str(model_dir), adapter=out)
    try:
        assert "focusllm_gate" in s.run.state and s.run.method("focusllm").chunk == 16
    finally:
        s.close()
    other = make_tiny_model_dir(tmp_path / "other", seed=1, hidden_size=128, intermediate_size=256)
    with pytest.raises(LcxError, match="trained for another base model"):
        open_session(str(other), adapter=out)
    with pytest.raises(LcxError, match="drop --full"):
        train(TrainConfig(model=str(model_dir), data=[str(tmp_path / "doc.txt")], out=str(tmp_path / "full"),
                          methods=["focusllm"], options={"focusllm": TRAIN_OPTS}, seq_len=120, steps=1, full=["k_proj"]),
              progress=False)


def test_a_focusllm_adapter_is_read_only_under_focusllm_and_another_adapter_not_under_it(tmp_path):
    """focusllm reads its LoRA at candidate positions only: its adapter under other methods would act on every
    token, and an adapter trained without it (smt's q/k) would act at the candidates only.  Both refused,
    naming the fix; the adapter with its own method (named or by default) loads."""
    from lcx.adapters.peft_bridge import random_adapter
    from lcx.session import apply_adapter

    focus = random_adapter(tiny_model("llama"), tmp_path / "f", seed=0, roles=("q", "k", "v", "o"),
                           methods=[{"name": "focusllm", "options": {}}])
    smt = random_adapter(tiny_model("llama"), tmp_path / "s", seed=0)
    model = tiny_model("llama")
    with pytest.raises(lcx.LcxError, match="trained with focusllm.*every token: add --method focusllm"):
        apply_adapter(model, focus, ["vanilla"], {})
    assert not [n for n, _ in model.named_modules() if "lora" in n]  # the refused adapter was taken out again
    with pytest.raises(lcx.LcxError, match="trained with smt, not focusllm"):
        apply_adapter(tiny_model("llama"), smt, ["focusllm"], {})
    for methods in (["focusllm"], []):
        assert apply_adapter(tiny_model("llama"), focus, methods, {})[2] == ["focusllm"]
    assert apply_adapter(tiny_model("llama"), smt, ["vanilla"], {})[2] == ["vanilla"]


def test_an_outside_chunk_forward_gives_lcxs_candidates_and_is_refused_with_a_candidate_adapter():
    """`serve_request(forward=...)` (the server's engine runs the chunk forwards): given each chunk's last
    position keys/values it spools what lcx's own forwards give; with a candidate adapter (open at that
    position only) or a forward that answers for other chunks or layers it refuses."""
    model = tiny_model("llama").eval()
    ids = _ids()[0].tolist()
    rows = []

    def forward(chunks):
        rows.extend(chunks)
        out = []
        for row in chunks:
            with torch.no_grad():
                cache = model(input_ids=torch.tensor([row]), use_cache=True).past_key_values
            out.append([(l.keys[0, :, -1], l.values[0, :, -1]) for l in cache.layers])
        return out

    opts = {**OPTS, "refresh": 0}
    with lcx.attach(model, ["focusllm"], focusllm=opts) as run:
        want_ids, want = run.method("focusllm").serve_request(run, ids, 4)
        got_ids, got = run.method("focusllm").serve_request(run, ids, 4, forward=forward)
        with pytest.raises(LcxError, match=r"returned 4 candidates for 5 chunks"):
            run.method("focusllm").serve_request(run, ids, 4, forward=lambda c: forward(c)[:4])
    assert len(rows) == 5 + 5 and rows[1] == ids[16:32] + ids[-8:]  # [chunk ; fragment]
    assert got_ids == want_ids and got.keys() == want.keys()
    assert all(torch.allclose(got[k], want[k], atol=1e-5) for k in want)
    peft = add_adapter(tiny_model("llama"), roles=("q", "k", "v", "o"), rank=4).eval()
    with lcx.attach(peft, ["focusllm"], focusllm=opts) as run:
        with pytest.raises(LcxError, match="candidate adapter is open at the candidate position only"):
            run.method("focusllm").serve_request(run, ids, 4, forward=forward)
