"""fot crossbatch training: layout, gradients, no leaks, equality with inference and plain LM, data order."""

from __future__ import annotations

import pytest
import torch

import lcx
from lcx.generation import tail_logits
from lcx.plugins.fot import crossbatch
from tests.conftest import tiny_model

L = 16  # local context of the tests


def _forward(run, ids, step=0, labels=None, embeds=None):
    """One training forward through the run's sampling stage (crossbatch layout, positions)."""
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone() if labels is None else labels}
    batch = run.hook.lcx_sample(run=run, batch=batch, step=step)
    kw = {"inputs_embeds": embeds} if embeds is not None else {"input_ids": batch["input_ids"]}
    return run.model(**kw, position_ids=batch["position_ids"], labels=batch["labels"])


def _ids(rows, n, seed=0):
    return torch.randint(3, 256, (rows, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- layout
def test_default_layout_sees_own_earlier_contexts_and_d_minus_1_earlier_rows():
    lay = crossbatch.layout(L, w=2, d=3)
    assert lay.segments == ((0, 0), (1, 2), (2, 4))
    assert lay.sources(3, 0) == []
    assert lay.sources(3, 1) == [(3, 0, True), (2, 0, False), (1, 0, False)]
    assert lay.sources(3, 2) == [(3, 1, True), (3, 0, True), (2, 1, False), (2, 0, False), (1, 1, False), (1, 0, False)]
    assert lay.sources(0, 2) == [(0, 1, True), (0, 0, True)]  # the first row has no earlier rows: no negatives
    assert lay.sources(1, 2) == [(1, 1, True), (1, 0, True), (0, 1, False), (0, 0, False)]


def test_longllama_segments():
    lay = crossbatch.layout(L, w=3, d=2, segments="0:0,1:1,2:1,3:0")
    assert [len(lay.sources(5, j)) for j in range(4)] == [0, 2, 3, 3]
    assert lay.sources(5, 2) == [(5, 1, True), (5, 0, True), (4, 1, False)]
    assert all(p for _, _, p in lay.sources(5, 3))


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(w=1, d=1, segments="0:0"), "has 1 entries but rows hold 2 contexts"),
    (dict(w=1, d=1, segments="0:0,2:0"), "context 1 can have 0..1 positives"),
    (dict(w=1, d=1, segments="0:0,x"), "give POSITIVES:NEGATIVES per context"),
    (dict(w=-1, d=1), "w (previous contexts per document) must be >= 0"),
    (dict(w=1, d=0), "d (documents a memory layer sees) must be >= 1"),
    (dict(w=1, d=1, segments="0:0,1:1", most_d=1), "context 1 asks for 1 negatives, but with d=1"),
    (dict(w=3, d=1, segments="0:0,1:1,2:1,3:0", most_d=1), "context 1 asks for 1 negatives, but with d=1"),
    (dict(w=1, d=2, segments="0:0,1:4", most_d=2), "context 1 asks for 4 negatives, but with d=2 (documents a memory "
                                                   "layer sees, at most) only 1 earlier contexts"),
])
def test_bad_layouts(kwargs, needle):
    with pytest.raises(lcx.LcxError, match=needle.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        crossbatch.layout(L, **kwargs)


def test_negatives_are_checked_against_the_largest_d_the_schedule_reaches():
    """LongLLaMA's segments ask for negatives: with d=1 for good there are none (they were silently dropped); a
    schedule that reaches d=2 has them after it switches (before, a step gives what it has)."""
    model = tiny_model("llama")
    spec = "0:0,1:1,2:1,3:0"
    with pytest.raises(lcx.LcxError, match="context 1 asks for 1 negatives, but with d=1"):
        lcx.attach(model, ["fot"], w=3, d=1, segments=spec)
    with lcx.attach(model, ["fot"], w=3, d=1, segments=spec, d_schedule="step:100:2") as run:
        assert run.methods[0].crossbatch_layout(2).sources(1, 1) == [(1, 0, True), (0, 0, False)]


def test_d_schedules():
    assert crossbatch.d_for_step("constant", 2, 999, 0, 1.0, False) == (2, False)
    assert crossbatch.d_for_step("step:10:64", 2, 9, 0, None, False) == (2, False)
    assert crossbatch.d_for_step("step:10:64", 2, 10, 0, None, False) == (64, True)
    assert crossbatch.d_for_step("acc:0.98:64", 1, 5, 0, [0.99] * 9, False) == (1, False)  # 10 steps needed
    assert crossbatch.d_for_step("acc:0.98:64", 1, 5, 0, [0.5] + [0.99] * 9, False) == (1, False)  # mean 0.94
    assert crossbatch.d_for_step("acc:0.98:64", 1, 5, 0, [0.5] + [0.99] * 10, False) == (64, True)
    assert crossbatch.d_for_step("acc:0.98:64:2", 1, 5, 0, [0.97, 0.99], False) == (64, True)
    assert crossbatch.d_for_step("acc:0.98:64", 1, 6, 0, [0.5], True) == (64, True)  # stays switched
    picks = [crossbatch.d_for_step("choice:2,128", 1, s, 7, None, False)[0] for s in range(40)]
    assert set(picks) == {2, 128} and picks == [crossbatch.d_for_step("choice:2,128", 1, s, 7, None, False)[0]
                                                 for s in range(40)]
    for bad in ("step:x", "acc:0.9:4:0", "acc:0.9:4:2:2", "step:3:", "acc:high:8:2", "choice:2,x"):
        with pytest.raises(lcx.LcxError, match=f"d_schedule='{bad}': use constant"):
            crossbatch.d_for_step(bad, 1, 0, 0, None, False)
    for bad in ("step:3:0", "acc:0.9:-1", "choice:2,0"):  # each field is read when attached, not at its step
        with pytest.raises(lcx.LcxError, match=f"d_schedule='{bad}': d .* must be >= 1"):
            lcx.attach(tiny_model("llama"), ["fot"], d_schedule=bad)


# ---------------------------------------------------------------------- the training forward
def test_d1_without_previous_context_is_the_ordinary_lm_loss():
    model = tiny_model("llama").train()
    ids = _ids(3, L)
    plain = model(input_ids=ids, labels=ids).loss
    with lcx.attach(model, ["fot"], local=L, w=0, d=1, memory_layers="all") as run:
        loss = _forward(run, ids).loss
    torch.testing.assert_close(loss, plain, rtol=1e-5, atol=1e-6)


def test_training_forward_equals_inference_with_memory_of_the_previous_context():
    """d = 1, w = 1, positions=first: context 1 of a row is computed exactly as `fot` inference
    computes the second window of that document with all of the first in memory (dense)."""
    model = tiny_model("llama")
    ids = _ids(1, 2 * L)
    paper = {"sinks": 0, "positions": "first", "gate": "off"}  # FoT's own inference, which training mirrors
    with lcx.attach(model, ["fot"], local=L, w=1, d=1, memory_layers="1", **paper) as run:
        train_logits = _forward(run, ids).logits[0, L:]
    with lcx.attach(model, ["fot"], local=L, memory_layers="1", dense=True, **paper) as run:
        infer_logits = tail_logits(run, torch.cat([ids, ids[:, :1]], 1), L)
    torch.testing.assert_close(train_logits, infer_logits, rtol=1e-4, atol=1e-4)


def test_gradients_reach_positive_and_negative_keys_and_nothing_else():
    model = tiny_model("llama").train()
    ids = _ids(3, 2 * L)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    labels = torch.full_like(ids, -100)
    labels[1, L + 1:] = ids[1, L + 1:]  # loss only on context 1 of row 1
    with lcx.attach(model, ["fot"], local=L, w=1, d=2, memory_layers="1") as run:
        _forward(run, ids, labels=labels, embeds=embeds).loss.backward()
    g = embeds.grad.abs().sum(-1)  # (3, 2L)
    assert g[1, :L].sum() > 0  # positive: row 1's previous context
    assert g[0, :L].sum() > 0  # negative: row 0's previous context
    assert g[0, L:].sum() == 0  # row 0's current context is not memory for row 1
    assert g[2].sum() == 0  # a later row never reaches an earlier one


def test_no_information_flows_from_later_rows():
    model = tiny_model("llama")
    ids = _ids(4, 2 * L)
    changed = ids.clone()
    changed[3] = _ids(1, 2 * L, seed=9)[0]  # a different last document
    changed[1, L:] = _ids(1, L, seed=8)[0]  # and row 1's current context (no other row reads it)
    with lcx.attach(model, ["fot"], local=L, w=1, d=4, memory_layers="all") as run:
        a, b = _forward(run, ids).logits, _forward(run, changed).logits
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1, :L], b[1, :L])
    torch.testing.assert_close(a[2], b[2])
    changed[0, :L] = _ids(1, L, seed=7)[0]  # row 0's first context IS a negative for rows 1..3: must matter
    with lcx.attach(model, ["fot"], local=L, w=1, d=4, memory_layers="all") as run:
        c = _forward(run, changed).logits
    assert not torch.allclose(c[2, L:], b[2, L:])


def test_distraction_probe_sees_positive_share():
    model = tiny_model("llama")
    with lcx.attach(model, ["fot"], local=L, w=1, d=3, memory_layers="1") as run:
        run.state["crossbatch_probe"] = {}
        _forward(run, _ids(3, 2 * L))
        recs = run.state["crossbatch_probe"][1]
    assert [(r["row"], r["context"], r["positives"], r["negatives"]) for r in recs] == [(0, 1, 1, 0), (1, 1, 1, 1),
                                                                                          (2, 1, 1, 2)]
    for r in recs:
        assert torch.all(r["mass_positive"] <= r["mass_memory"] + 1e-6) and torch.all(r["mass_memory"] <= 1)
    assert torch.allclose(recs[0]["mass_positive"], recs[0]["mass_memory"])  # only positives visible


# ---------------------------------------------------------------------- bad input at training time
def test_bad_training_input():
    model = tiny_model("llama")
    with lcx.attach(model, ["fot"], local=L, w=1, d=3) as run:
        with pytest.raises(lcx.LcxError, match=r"d=3 .* larger than the batch \(2 rows\)"):
            _forward(run, _ids(2, 2 * L))
        with pytest.raises(lcx.LcxError, match=r"windows of \(w \+ 1\) x local = 2 x 16 = 32 tokens, got 40; set --seq-len 32"):
            _forward(run, _ids(3, 40))
    with pytest.raises(lcx.LcxError, match="d_schedule='sometimes'"):
        lcx.attach(model, ["fot"], d_schedule="sometimes")


# ---------------------------------------------------------------------- data order: documents pinned to rows
def test_streams_pin_each_row_to_consecutive_windows():
    from lcx.train import TrainConfig, rows_for

    cfg = TrainConfig(model="x", data=[], out="o", batch_size=3, grad_accum=2)
    n = 20  # windows in corpus order; 3 streams of 6 (the last 2 windows are never read)
    seen = {r: [] for r in range(3)}
    for step in range(4):
        for micro in range(2):
            for r, w in enumerate(rows_for(step, micro, 0, cfg, 1, n, "streams")):
                seen[r].append(w)
    assert seen[0] == [0, 1, 2, 3, 4, 5, 0, 1] and seen[1] == [6, 7, 8, 9, 10, 11, 6, 7] and seen[2][0] == 12
    # two processes split the rows: rank 1's rows continue after rank 0's
    assert rows_for(0, 0, 1, TrainConfig(model="x", data=[], out="o", batch_size=2), 2, 20, "streams") == [10, 15]
    with pytest.raises(lcx.LcxError, match="cannot fill 3 streams"):
        rows_for(0, 0, 0, cfg, 1, 2, "streams")


def test_analyze_distraction_cli(tmp_path, monkeypatch):
    import json

    from click.testing import CliRunner

    from lcx.cli import main
    from lcx.plugins.fot import calibrate
    from tests.helpers import make_tiny_model_dir, make_word_documents

    def no_calibration(*a, **k):  # the measure never reads fot's gate: calibrating it would be wasted probes
        raise AssertionError("analyze distraction calibrated fot's gate")

    monkeypatch.setattr(calibrate, "calibrate_gate", no_calibration)

    m, docs = make_tiny_model_dir(tmp_path / "m"), make_word_documents(tmp_path / "docs")
    args = ["analyze", "distraction", "-m", str(m), "-d", str(docs), "-o", "local=16", "-o", "memory_layers=1",
            "--ds", "1,2,3", "--batches", "2", "--out", str(tmp_path / "dis"), "--json"]
    r = CliRunner().invoke(main, [*args, "--label", "a"])
    assert r.exit_code == 0, r.output
    share = json.loads(r.stdout)["positive_share"]
    assert share["1"] == pytest.approx(1.0) and 0 < share["3"] < share["2"] < 1  # random model: about 1/d
    r = CliRunner().invoke(main, [*args, "--label", "b"])
    res = json.loads((tmp_path / "dis" / "distraction.json").read_text())
    assert set(res["runs"]) == {"a", "b"} and (tmp_path / "dis" / "distraction.png").exists()
    r = CliRunner().invoke(main, [*args[:10], "--ds", "4", "--out", str(tmp_path / "x")])
    assert r.exit_code != 0 and "d=4 needs at least 4 documents" in r.output, r.output
    r = CliRunner().invoke(main, [*args[:10], "--ds", "1,x"])
    assert r.exit_code == 2 and "'x' is not a positive integer" in r.output


def test_train_k_keeps_each_querys_top_k_memory_keys_only():
    """train_k = M (all memory keys) is dense crossbatch; train_k = 1 gives each query one memory key, the
    best-scoring one: the keys no query ranks first get no gradient, those ranked first do."""
    torch.manual_seed(0)
    B, H, D = 2, 2, 8
    lay = crossbatch.layout(L, w=1, d=2)  # row 1's second context sees 2 earlier contexts: M = 2L keys
    q, k, v = (torch.randn(B, H, 2 * L, D) for _ in range(3))
    dense = crossbatch.memory_attention(q, k, v, lay, None, "first", 0, D ** -0.5)
    torch.testing.assert_close(crossbatch.memory_attention(q, k, v, lay, None, "first", 0, D ** -0.5, topk=2 * L), dense)
    v1 = v.clone().requires_grad_(True)
    out = crossbatch.memory_attention(q, k, v1, lay, None, "first", 0, D ** -0.5, topk=1)
    out[1, L:].sum().backward()  # row 1's second context: memory = row 1's and row 0's first contexts
    mem_keys = torch.cat([k[1, :, :L], k[0, :, :L]], dim=1)  # (H, 2L, D), the order of lay.sources
    best = torch.einsum("hqd,hmd->hqm", q[1, :, L:], mem_keys).argmax(-1)  # (H, L): each query's top-1
    memory_grad = torch.cat([v1.grad[1, :, :L], v1.grad[0, :, :L]], dim=1).abs().sum(-1)  # (H, 2L)
    for h in range(H):
        chosen = set(best[h].tolist())
        assert all(memory_grad[h, m] > 0 for m in chosen)
        assert all(memory_grad[h, m] == 0 for m in range(2 * L) if m not in chosen)
    assert not torch.allclose(out, dense)


# ---------------------------------------------------------------------- bank of earlier steps' contexts
def test_bank_holds_the_previous_steps_contexts_as_memory():
    """bank = 2, rows of 2 contexts: the second step's contexts read the first step's two contexts from the
    bank; the logits equal one forward of a row holding all four contexts in which contexts 2 and 3 see
    every earlier context (segments 0:0,1:0,2:0,3:0)."""
    model = tiny_model("llama").train()
    a, b = _ids(1, 2 * L, seed=1), _ids(1, 2 * L, seed=2)
    with lcx.attach(model, ["fot"], local=L, w=1, d=1, memory_layers="all", bank=2) as run:
        _forward(run, a)
        banked = _forward(run, b, step=1).logits
        assert set(run.state["crossbatch_bank"]) == set(range(model.config.num_hidden_layers))
        assert run.state["crossbatch_bank"][0][0].shape[1] == 2 * L and not run.state["crossbatch_bank"][0][0].requires_grad
    with lcx.attach(model, ["fot"], local=L, w=3, d=1, memory_layers="all", segments="0:0,1:0,2:0,3:0") as run:
        whole = _forward(run, torch.cat([a, b], 1)).logits
    torch.testing.assert_close(banked[0], whole[0, 2 * L:], rtol=1e-4, atol=1e-4)
    with lcx.attach(model, ["fot"], local=L, w=1, d=1, memory_layers="all") as run:  # no bank: b alone
        alone = _forward(run, b).logits
    assert not torch.allclose(alone, banked, atol=1e-3)


def test_bank_keeps_the_newest_contexts_and_evaluation_forwards_do_not_fill_it():
    lay = crossbatch.layout(L, w=1, d=1)
    k = [torch.randn(2, 3, 2 * L, 8) for _ in range(2)]  # two forwards of 2 rows x 2 contexts
    bank = crossbatch.bank_update(None, k[0], k[0], lay, None, contexts=5)
    assert bank[0].shape == (3, 4 * L, 8)  # all 4 contexts of the first forward
    bank = crossbatch.bank_update(bank, k[1], k[1], lay, None, contexts=5)
    assert bank[0].shape == (3, 5 * L, 8)
    torch.testing.assert_close(bank[1][:, :L], k[0][1, :, L:])  # the oldest kept: row 1's context 1
    torch.testing.assert_close(bank[1][:, L:3 * L], k[1][0])  # then the second forward, row by row
    model = tiny_model("llama")
    with lcx.attach(model, ["fot"], local=L, w=1, d=1, memory_layers="all", bank=4) as run, torch.no_grad():
        _forward(run, _ids(1, 2 * L))
        assert not run.state["crossbatch_bank"]
    with pytest.raises(lcx.LcxError, match="bank must be >= 0"):
        lcx.attach(model, ["fot"], local=L, bank=-1)


def test_each_query_reads_its_bank_k_best_bank_entries():
    """bank_k = 1: a context without sources attends to its own keys (causal) and to the one bank entry its
    query scores highest, under one softmax; the bank gets no gradient, the query does."""
    torch.manual_seed(0)
    B, H, D, M = 1, 2, 8, 40
    lay = crossbatch.layout(L, w=0, d=1)  # one context per row: memory comes from the bank alone
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    bank = (torch.randn(H, M, D), torch.randn(H, M, D))
    q1 = q.clone().requires_grad_(True)
    out = crossbatch.memory_attention(q1, k, v, lay, None, "first", 0, D ** -0.5, bank=bank, bank_k=1)
    scale = D ** -0.5
    for h in range(H):
        best = (q[0, h] @ bank[0][h].T).argmax(-1)  # (L,)
        local = (q[0, h] @ k[0, h].T * scale).masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
        joint = torch.cat([local, (q[0, h] * bank[0][h][best]).sum(-1, keepdim=True) * scale], -1).softmax(-1)
        want = joint[:, :L] @ v[0, h] + joint[:, L:] * bank[1][h][best]
        torch.testing.assert_close(out[0, :, h], want)
    out.sum().backward()
    assert q1.grad.abs().sum() > 0
    every = crossbatch.memory_attention(q, k, v, lay, None, "first", 0, D ** -0.5, bank=bank, bank_k=M)
    assert not torch.allclose(every, out.detach())


def test_crossbatch_contexts_longer_than_a_sliding_window_are_refused():
    """gemma2's sliding layers (64 tokens) were trained with full attention over 128-token contexts: the loss
    equalled the one without any sliding window."""
    model = tiny_model("gemma2").train()  # sliding_window 64
    with lcx.attach(model, ["fot"], local=128, w=0, d=1, memory_layers="1") as run:
        with pytest.raises(lcx.LcxError, match="sliding-window layers see 64 tokens .* set -o fot.local=64 or less"):
            _forward(run, _ids(1, 128))
    with lcx.attach(model, ["fot"], local=64, w=1, d=1, memory_layers="1") as run:
        assert _forward(run, _ids(1, 128)).loss.isfinite()


def test_crossbatch_training_refuses_memory_heads():
    """memory_heads is read at inference only: training would train every head of the memory layers."""
    with lcx.attach(tiny_model("llama").train(), ["fot"], local=L, w=1, d=1, memory_heads="0:1") as run:
        with pytest.raises(lcx.LcxError, match="memory_heads=0:1 is an inference option"):
            _forward(run, _ids(1, 2 * L))
