"""score_tail (the ppl suite's scorer) equals a direct computation, through any plan."""

from __future__ import annotations

import math

import pytest
import torch

import lcx
from lcx.evals import ppl
from lcx.generation import score_tail
from tests.conftest import tiny_model


def _direct(model, ids, n):
    with torch.no_grad():
        logits = model(ids).logits[0, -n - 1:-1]
    t = ids[0, -n:]
    return float(torch.nn.functional.cross_entropy(logits, t, reduction="sum")), int((logits.argmax(-1) == t).sum())


@pytest.mark.parametrize("methods,opts", [([], {}), (["vanilla"], {}), (["streaming"], {"chunk": 7, "window": 500})])
def test_score_tail_matches_direct_within_window(methods, opts):
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (1, 100))
    nll, correct = _direct(model, ids, 30)
    with lcx.attach(model, methods, **opts) as run:
        r = score_tail(run, ids, 30)
    assert r["count"] == 30 and r["correct"] == correct
    assert math.isclose(r["nll_sum"], nll, rel_tol=1e-4)


def test_vanilla_scores_only_what_it_keeps():
    model = tiny_model("llama")  # window 128
    ids = torch.randint(3, 256, (1, 300))
    with lcx.attach(model, ["vanilla"]) as run:
        r = score_tail(run, ids, 40)  # the tail survives middle truncation
        assert r["count"] == 40
        with pytest.raises(lcx.LcxError, match="dropped scored tokens"):
            score_tail(run, ids, 100)  # the plan keeps only the last 64 of the tail


def test_ppl_suite_reports_per_context_and_document():
    model = tiny_model("llama")
    docs = [("a", list(range(3, 203))), ("b", list(range(5, 250)))]
    with lcx.attach(model, ["streaming"], chunk=16) as run:
        res = ppl.evaluate(lambda x, n: score_tail(run, x, n), docs, ppl.PplConfig(contexts=[32, 64], target=16, samples=2),
                           progress=False)
    assert set(res["summary"]["ppl"]) == {"32", "64"} and set(res["summary"]["by_document"]) == {"a", "b"}
    assert len(res["samples"]) == 2 * 2 * 2
    assert res["summary"]["documents_scored"] == 2 and res["summary"]["documents_too_short"] == []
    with lcx.attach(model, ["streaming"], chunk=16) as run:  # "a" (200 tokens) cannot hold 200 + 16: left out, said
        res = ppl.evaluate(lambda x, n: score_tail(run, x, n), docs, ppl.PplConfig(contexts=[200], target=16),
                           progress=False)
    assert res["summary"]["documents_scored"] == 1 and res["summary"]["documents_too_short"] == ["a"]
    with pytest.raises(lcx.LcxError, match="no document has.*smaller --contexts"):
        ppl.evaluate(lambda x, n: {}, docs, ppl.PplConfig(contexts=[1000]), progress=False)
    with pytest.raises(lcx.LcxError, match=r"no document has 5016 tokens \(--room 5000 \+ target\).*smaller --room"):
        ppl.evaluate(lambda x, n: {}, docs, ppl.PplConfig(contexts=[32], target=16, room=5000), progress=False)


def test_runs_with_different_contexts_score_the_same_spans_only_with_the_same_room(tmp_path):
    """`lcx eval ppl` puts the scored spans after the longest context asked for, so a run over 4K,8K and
    one over 4K..32K score different text; --room fixes where they go (the SMT beta ablation was
    misread this way once)."""
    from click.testing import CliRunner

    from lcx.cli import main

    docs = [("a", list(range(3, 400)))]
    seen = lambda cfg: {(s["end"], s["context"]) for s in ppl.evaluate(  # noqa: E731
        lambda x, n: {"nll_sum": float(x[0, -n:].sum()), "correct": 0, "count": n}, docs, cfg, progress=False)["samples"]}
    short, long_ = ppl.PplConfig(contexts=[32], target=16), ppl.PplConfig(contexts=[32, 128], target=16)
    assert {e for e, _ in seen(short)} != {e for e, _ in seen(long_)}
    assert seen(ppl.PplConfig(contexts=[32], target=16, room=128)) <= seen(long_)
    with pytest.raises(lcx.LcxError, match=r"room=64 leaves no space.*--room >= 128"):
        ppl.PplConfig(contexts=[32, 128], room=64).validate()
    doc = tmp_path / "doc.txt"
    doc.write_text("word " * 500)
    r = CliRunner().invoke(main, ["eval", "ppl", "-m", "x", "-d", str(doc), "--room", "1K,2K"])
    assert r.exit_code == 2 and "give one token count" in r.output


def test_plots_label_what_was_run(monkeypatch, tmp_path):
    """Axis labels read back as the lengths and depths asked for (4000 is not "3K", 0.25 not "0.2"); the ppl
    plot draws contexts in increasing order and names the scored tail it was given."""
    from lcx.evals import passkey
    from lcx.io import token_label

    assert [token_label(n) for n in (512, 1536, 4000, 8192, 131072)] == ["512", "1536", "4000", "8K", "128K"]
    figs = []
    monkeypatch.setattr(passkey, "save_figure", lambda fig, path, title: figs.append(fig) or path)
    monkeypatch.setattr(ppl, "save_figure", lambda fig, path, title: figs.append(fig) or path)
    cells = {f"{n}@{d}": 1.0 for n in (4000, 8192) for d in (0.05, 0.25)}
    passkey.plot_heatmap({"config": {"lengths": [4000, 8192], "depths": [0.05, 0.25]},
                          "summary": {"accuracy_by_cell": cells}}, tmp_path / "p.png", "t")
    ax = figs[-1].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4000", "8K"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0.05", "0.25"]
    res = {"config": {"target": 1024}, "summary": {"ppl": {"8192": 3.0, "2048": 5.0, "4096": 4.0},
                                                   "accuracy": {"8192": 0.5, "2048": 0.3, "4096": 0.4}}}
    ppl.plot({"s": res}, tmp_path / "q.png", "t")
    a1 = figs[-1].axes[0]
    assert list(a1.lines[0].get_xdata()) == [2048, 4096, 8192] and list(a1.lines[0].get_ydata()) == [5.0, 4.0, 3.0]
    assert a1.get_title() == "perplexity of the last 1024 tokens"
