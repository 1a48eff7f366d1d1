"""Property tests (hypothesis) of every chunking and sampling plan, on the tiny llama (window 128).

For random lengths, windows and chunk sizes: every input token is accounted for exactly once (or as
the method defines: vanilla keeps a head and a tail, focusllm one candidate per chunk), positions
stay within the model's window or the method's documented range, and plans are deterministic under
a seed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import lcx
from lcx.adapters.rotary import rotate
from lcx.errors import LcxError
from lcx.generation import make_plan
from lcx.plugins import smt
from lcx.plugins.focusllm import chunk_spans
from lcx.plugins.fot import crossbatch
from lcx.plugins.streaming import SinkWindowLayer
from tests.conftest import tiny_model

WINDOW = 128
PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
MODEL = tiny_model("llama")
with lcx.attach(MODEL) as _run:
    assert _run.window == WINDOW


def _ids(rows: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (rows, T), generator=torch.Generator().manual_seed(seed))


def _padded(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Left-padded rows of the given lengths (pad id 0), and the rows themselves."""
    rows = [_ids(1, n, seed + i)[0] for i, n in enumerate(lengths)]
    T = max(lengths)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, T - len(r):], mask[i, T - len(r):] = r, 1
    return ids, mask, rows


def _windows_tile(windows, T, longest=None):
    """Windows are contiguous, non-empty, cover [0, T), each at most ``longest`` tokens."""
    assert windows[0][0] == 0 and windows[-1][1] == T
    assert all(e0 == s1 for (_, e0), (s1, _) in zip(windows, windows[1:]))
    assert all(s < e and (longest is None or e - s <= longest) for s, e in windows)


# ---------------------------------------------------------------------- chunked prefill: fot, streaming
@PROPS
@given(T=st.integers(1, 1500), chunk=st.integers(1, 128), rows=st.integers(1, 3), method=st.sampled_from(["fot", "streaming"]))
def test_chunked_plans_feed_every_token_once_in_order(T, chunk, rows, method):
    opts = {"fot": {"local": 128, "chunk": chunk}, "streaming": {"chunk": chunk, "sinks": 4}}[method]
    ids = _ids(rows, T)
    with lcx.attach(MODEL, [method], **{method: opts}) as run:
        plan = make_plan(run, ids, torch.ones_like(ids), 1)
        again = make_plan(run, ids, torch.ones_like(ids), 1)
    assert torch.equal(plan.input_ids, ids) and plan.dropped == 0  # every token, once, in order
    _windows_tile(plan.windows, T, longest=chunk)
    assert all(e - s == chunk for s, e in plan.windows[:-1])
    assert plan.windows == again.windows and torch.equal(plan.input_ids, again.input_ids)


# ---------------------------------------------------------------------- streaming's cache
@PROPS
@given(sinks=st.integers(0, 8), window=st.integers(1, 64), chunks=st.lists(st.integers(1, 40), min_size=1, max_size=30))
def test_streaming_keeps_the_sinks_and_a_contiguous_recent_block_at_in_range_positions(sinks, window, chunks):
    """Values carry each token's absolute position.  After every update the visible keys are the first
    min(sinks, seen) tokens and then a contiguous block ending at the newest token (each visible token
    once, none evicted ever coming back), at most sinks + window + chunk of them, and the re-rotated
    sinks sit right before the block, so no query-key distance exceeds the visible span."""
    D = 8
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    base = torch.randn(D, generator=torch.Generator().manual_seed(0))
    layer = SinkWindowLayer(sinks, window, inv_freq)
    seen, evicted = 0, set()
    for n in chunks:
        pos = torch.arange(seen, seen + n)
        k = rotate(base.expand(1, 1, n, D), pos, inv_freq)  # keys arrive rotated at their true positions
        v = pos.view(1, 1, n, 1).expand(1, 1, n, D).float()
        out_k, out_v = layer.update(k, v)
        got = out_v[0, 0, :, 0].long().tolist()
        ns, recent_start = layer.visible
        seen += n
        assert ns == min(sinks, seen - n)  # sinks fill before anything is evicted
        assert got == list(range(ns)) + list(range(recent_start, seen))
        assert len(got) <= sinks + window + n
        assert not evicted & set(got)
        evicted |= set(range(ns, recent_start))
        # positions as the queries see them: contiguous, ending at the newest token, so every
        # query-key distance stays below the visible span (sinks moved right before the block)
        want = rotate(base.expand(1, 1, len(got), D), torch.arange(seen - len(got), seen), inv_freq)
        torch.testing.assert_close(out_k, want, atol=1e-4, rtol=1e-4)
    assert evicted | set(range(min(sinks, seen))) | set(range(recent_start, seen)) == set(range(seen))


# ---------------------------------------------------------------------- vanilla truncation
@PROPS
@given(lengths=st.lists(st.integers(1, 400), min_size=1, max_size=3), new=st.integers(1, 64),
       head=st.floats(0.0, 1.0), seed=st.integers(0, 1000))
def test_vanilla_keeps_a_head_and_a_tail_that_fit_the_window(lengths, new, head, seed):
    ids, mask, rows = _padded(lengths, seed)
    with lcx.attach(MODEL, ["vanilla"], vanilla={"head_fraction": head}) as run:
        plan = make_plan(run, ids, mask, new)
    budget = WINDOW - new
    assert plan.input_ids.shape[1] + new <= WINDOW or max(lengths) + new <= WINDOW
    assert plan.dropped == max(0, max(lengths) - budget)
    for i, row in enumerate(rows):
        kept = plan.input_ids[i][plan.attention_mask[i].bool()]
        if len(row) <= budget:
            assert torch.equal(kept, row)  # short rows pass untouched
        else:
            h = int(budget * head)
            assert torch.equal(kept, torch.cat([row[:h], row[len(row) - (budget - h):]]))
    _windows_tile(plan.windows, plan.input_ids.shape[1])


# ---------------------------------------------------------------------- focusllm
@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 3000), chunk=st.integers(8, 96), local=st.integers(8, 64), fragment=st.integers(1, 8),
       new=st.integers(1, 8))
@example(T=2000, chunk=8, local=16, fragment=4, new=2)  # 248 candidates: refused
@example(T=1500, chunk=14, local=20, fragment=8, new=1)  # 106 + 20 + 1 = 127: just fits
def test_focusllm_gives_one_candidate_per_memory_chunk_and_the_local_tail(T, chunk, local, fragment, new):
    opts = {"chunk": min(chunk, WINDOW - fragment), "local": local, "fragment": fragment, "refresh": 0}
    ids = _ids(1, T)
    with lcx.attach(MODEL, ["focusllm"], focusllm=opts) as run:
        spans = chunk_spans(max(T - local, 0), opts["chunk"])
        if T > local and len(spans) + local + new > WINDOW:
            with pytest.raises(LcxError, match="exceed the model's window"):
                make_plan(run, ids, torch.ones_like(ids), new)
            event("refused: too many candidates")
            return
        plan = make_plan(run, ids, torch.ones_like(ids), new)
    # the memory chunks tile the memory exactly once, each at most `chunk` tokens
    covered = [i for s, e in spans for i in range(s, e)]
    assert covered == list(range(max(T - local, 0))) and all(e - s <= opts["chunk"] for s, e in spans)
    if T <= local:  # nothing to compress: the input as it is
        assert torch.equal(plan.input_ids, ids)
        event("short input")
        return
    event("candidates + local")
    n = len(spans)
    assert plan.info == {"candidates": n, "chunk": opts["chunk"], "memory_tokens": T - local}
    assert torch.equal(plan.input_ids[:, n:], ids[:, T - local:])  # the local tail, every token once
    assert plan.input_ids.shape[1] + new <= WINDOW  # candidates + local + new tokens fit
    assert plan.windows == [(0, n), (n, n + local)]


@PROPS
@given(window=st.integers(64, 1 << 17), tokens=st.integers(0, 1 << 21), local=st.integers(1, 4096),
       fragment=st.integers(1, 1024), overlap=st.integers(0, 256), new=st.integers(1, 64), refresh=st.integers(0, 2))
def test_focusllm_chunk_auto_is_the_smallest_doubling_that_keeps_few_candidates_within_the_window(
        window, tokens, local, fragment, overlap, new, refresh):
    from lcx.plugins.focusllm.method import BASE_CHUNK, MAX_CANDIDATES, FocusLLM

    m = FocusLLM.from_options(local=max(local, fragment), fragment=fragment, overlap=overlap, refresh=refresh)
    room = window - overlap - fragment - (new - 1 if refresh else 0)  # what one chunk's forward may add
    chunk = m.chunk_for(window, tokens, new)
    n = len(chunk_spans(max(0, tokens - m.local), chunk, overlap))
    start = max(min(BASE_CHUNK, room), fragment, overlap + 1)
    reads = chunk + overlap + fragment + (new - 1 if refresh else 0)  # one chunk's forward, refreshed to the end
    assert chunk >= start and (reads <= window or chunk == start)  # past the window only when even the start is
    assert n <= MAX_CANDIDATES or chunk >= room  # few candidates, or the largest chunk the window allows
    if chunk > start:  # doubled: the size before it made too many candidates
        before = max(chunk // 2, start) if chunk < room else None
        assert before is None or len(chunk_spans(max(0, tokens - m.local), before, overlap)) > MAX_CANDIDATES


# ---------------------------------------------------------------------- smt sampling
@PROPS
@given(memory=st.integers(0, 3000), budget=st.integers(0, 600), window=st.integers(1, 300), T=st.integers(1, 6),
       policy=st.sampled_from(["decay", "uniform"]), seed=st.integers(0, 2**31))
def test_smt_samples_distinct_memory_tokens_exactly_the_budget_deterministically(memory, budget, window, T, policy, seed):
    a = smt.sample_memory(memory, budget, window, T, policy, torch.Generator().manual_seed(seed))
    b = smt.sample_memory(memory, budget, window, T, policy, torch.Generator().manual_seed(seed))
    assert torch.equal(a, b)
    assert a.numel() == min(budget, memory)
    assert a.unique().numel() == a.numel() and torch.equal(a, a.sort().values)
    assert a.numel() == 0 or (0 <= int(a.min()) and int(a.max()) < memory)


@PROPS
@given(N=st.integers(40, 1200), budget=st.integers(4, WINDOW), target_frac=st.floats(0.05, 0.9),
       window=st.integers(1, 64), rows=st.integers(1, 3), step=st.integers(0, 10_000), seed=st.integers(0, 100),
       grow=st.booleans())
@example(N=98, budget=108, target_frac=0.8984375, window=1, rows=1, step=0, seed=0, grow=True)  # target > start
def test_smt_rows_keep_original_positions_and_the_contiguous_target(N, budget, target_frac, window, rows, step, seed, grow):
    target = max(1, min(budget - 1, int(budget * target_frac)))
    if N < target + 1:
        return
    method = smt.SMT(budget=budget, target=target, window=window, grow_every=7 if grow else 0, grow_by=64, start=96)
    run = SimpleNamespace(window=WINDOW, seed=seed, rank=0, state={})
    ids = torch.arange(N).expand(rows, N).contiguous()  # a token's id is its position in the window
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    if grow and min(N, 96) < target + 1:  # the first range in use leaves no memory: refused, at any step
        with pytest.raises(LcxError, match=rf"starts with {min(N, 96)} tokens .* target of {target} tokens"):
            method.lcx_sample(run=run, batch=batch, step=step)
        return
    out = method.lcx_sample(run=run, batch=batch, step=step)
    again = method.lcx_sample(run=run, batch=batch, step=step)
    assert all(torch.equal(out[k], again[k]) for k in ("input_ids", "position_ids"))  # deterministic under the seed
    R = out["smt_range"]
    assert R == (smt.position_range(step, N, 96, 7, 64) if grow else N) and R <= N
    pos = out["position_ids"]
    assert pos.shape[1] == min(budget, R) <= WINDOW  # what the model sees fits its window ...
    assert int(pos.max()) < R  # ... at positions inside the range in use
    assert bool((pos[:, 1:] > pos[:, :-1]).all())  # increasing: each token once, in order
    assert torch.equal(pos[:, -target:], torch.arange(R - target, R).expand(rows, -1))  # the target, contiguous
    assert torch.equal(out["input_ids"], ids[:, N - R:].gather(1, pos))  # each token at its original position
    lab = out["labels"]
    assert bool((lab[:, : pos.shape[1] - target + 1] == -100).all())
    assert torch.equal(lab[:, pos.shape[1] - target + 1:], out["input_ids"][:, pos.shape[1] - target + 1:])


# ---------------------------------------------------------------------- fot crossbatch
@PROPS
@given(local=st.integers(1, 64), w=st.integers(0, 6), d=st.integers(1, 8), rows=st.integers(1, 8))
def test_crossbatch_reads_only_earlier_contexts_of_at_most_d_documents(local, w, d, rows):
    lay = crossbatch.layout(local, w, d)
    pos = crossbatch.chunk_positions(rows, lay)
    assert pos.shape == (rows, (w + 1) * local) and int(pos.min()) == 0 and int(pos.max()) == local - 1
    for row in range(rows):
        for j in range(w + 1):
            src = lay.sources(row, j)
            assert len(set(src)) == len(src)  # every earlier context at most once
            pos_ = [(r, c) for r, c, p in src if p]
            neg = [(r, c) for r, c, p in src if not p]
            assert pos_ == [(row, c) for c in range(j - 1, -1, -1)]  # all earlier contexts of its document
            assert all(r < row and c < j for r, c in neg)  # negatives: earlier rows, earlier contexts only
            assert len({r for r, _ in neg}) <= d - 1 and len(neg) <= (d - 1) * j
            if row >= d - 1:  # enough rows before it: exactly the default (d - 1) * j negatives
                assert len(neg) == (d - 1) * j


@given(schedule=st.sampled_from(["choice:1,2,4", "choice:8,3"]), step=st.integers(0, 10**6), seed=st.integers(0, 10**6))
def test_crossbatch_d_schedules_are_deterministic_under_the_seed(schedule, step, seed):
    a = crossbatch.d_for_step(schedule, 1, step, seed, None, False)
    assert a == crossbatch.d_for_step(schedule, 1, step, seed, None, False)
    assert a[0] in {int(x) for x in schedule.split(":")[1].split(",")}
