"""FoT's dictionary-lookup task: documents are well-formed, the scorer is exact, the CLI runs."""

from __future__ import annotations

import json
import random

import pytest
import torch
from click.testing import CliRunner

from lcx.cli import main
from lcx.errors import LcxError
from lcx.evals import dictionary as dct
from tests.conftest import tiny_model


def test_document_structure():
    doc = dct.make_document(random.Random(0), 256, 256)
    ids, labels = doc.input_ids.tolist(), doc.labels.tolist()
    assert len(ids) == 512 and doc.n_queries == 25
    defs = {tuple(ids[i + 1:i + 5]): tuple(ids[i + 6:i + 10]) for i in range(0, 250, 10)}
    assert len(defs) == 25  # keys unique
    q0 = 256
    for q in range(doc.n_queries):
        e = ids[q0 + 10 * q:q0 + 10 * (q + 1)]
        assert e[0] == dct.QUERY and e[5] == dct.VALUE and defs[tuple(e[1:5])] == tuple(e[6:10])
        assert labels[q0 + 10 * q:q0 + 10 * q + 6] == [-100] * 6 and labels[q0 + 10 * q + 6:q0 + 10 * (q + 1)] == e[6:10]
    assert all(x == -100 for x in labels[:256])


def test_training_rows_of_back_to_back_documents():
    """task:dictionary:512 at --seq-len 1024: two whole 512-token documents per row, each queried only about
    its own definitions; a row length that cuts a document and a malformed task name are refused."""
    from lcx.train import synthetic_task

    batch = synthetic_task(["task:dictionary:512"])(random.Random(0), 3, 1024)
    assert batch["input_ids"].shape == (3, 1024) and (batch["labels"] != -100).sum(1).tolist() == [200] * 3
    for row in batch["input_ids"].tolist():
        for start in (0, 512):
            ids = row[start:start + 512]
            defs = {tuple(ids[i + 1:i + 5]): tuple(ids[i + 6:i + 10]) for i in range(0, 250, 10)}
            assert ids[0] == dct.KEY and ids[256] == dct.QUERY
            assert all(defs[tuple(ids[q + 1:q + 5])] == tuple(ids[q + 6:q + 10]) for q in range(256, 506, 10))
    one = synthetic_task(["task:dictionary"])(random.Random(0), 2, 1024)  # one document per row, as before
    assert (one["labels"] != -100).sum(1).tolist() == [204, 204]
    with pytest.raises(LcxError, match="--seq-len 1000 is not a multiple of the dictionary documents' 512"):
        synthetic_task(["task:dictionary:512"])(random.Random(0), 1, 1000)
    for bad in ("big", "near=2", "near=x", "far=0.5", "10"):
        with pytest.raises(LcxError, match=f"task:dictionary: '{bad}' is neither a document length"):
            synthetic_task([f"task:dictionary:{bad}"])


def _shared(a, b):
    return sum(x == y for x, y in zip(a, b))


def test_near_miss_keys_share_two_symbols_in_place_with_an_earlier_key():
    """near=1: every key after the first keeps exactly 2 of an earlier key's symbols in place; near=0 draws
    the same documents as before the option existed (its random stream is untouched), and in 512-token
    documents random keys rarely share 2 symbols (~0.4 pairs per document; near=0.5: ~12)."""
    from lcx.train import synthetic_task

    def keys(doc):
        ids = doc.input_ids.tolist()
        return [tuple(ids[i + 1:i + 5]) for i in range(0, 250, 10)]

    for seed in range(5):
        ks = keys(dct.make_document(random.Random(seed), 256, 256, near=1.0))
        assert len(set(ks)) == 25
        assert all(any(_shared(k, e) == dct.NEAR_SHARED for e in ks[:i]) for i, k in enumerate(ks) if i)
    plain = [keys(dct.make_document(random.Random(s), 256, 256)) for s in range(20)]
    assert plain == [keys(dct.make_document(random.Random(s), 256, 256, near=0.0)) for s in range(20)]
    pairs = sum(_shared(a, b) >= 2 for ks in plain for i, a in enumerate(ks) for b in ks[:i])
    assert pairs < 20  # 20 documents x 300 pairs x 6 / 64**2: ~9 pairs, ~0.4 per document
    half = [keys(dct.make_document(random.Random(s), 256, 256, near=0.5)) for s in range(20)]
    close = sum(any(_shared(k, e) >= 2 for e in ks[:i]) for ks in half for i, k in enumerate(ks) if i)
    assert 0.35 < close / (20 * 24) < 0.65
    batch = synthetic_task(["task:dictionary:512:near=1"])(random.Random(0), 2, 1024)
    row = batch["input_ids"][0].tolist()
    ks = [tuple(row[i + 1:i + 5]) for i in range(512, 762, 10)]  # the second document's keys
    assert all(any(_shared(k, e) == 2 for e in ks[:i]) for i, k in enumerate(ks) if i)
    with pytest.raises(LcxError, match="near must be a share in"):
        dct.make_document(random.Random(0), 256, 256, near=1.5)


def test_scorer_with_oracles():
    doc = dct.make_document(random.Random(1), 200, 100)
    T = doc.input_ids.numel()

    def oracle(ids, n):  # logits that put all mass on the true next token
        return torch.nn.functional.one_hot(ids[0, T - n:], dct.VOCAB_SIZE).float()

    def off_by_one(ids, n):
        return torch.nn.functional.one_hot((ids[0, T - n:] + 1) % dct.VOCAB_SIZE, dct.VOCAB_SIZE).float()

    assert dct.score(doc, oracle, 100) == {"queries": 10, "correct": 10, "tokens": 40, "tokens_correct": 40}
    assert dct.score(doc, off_by_one, 100)["correct"] == 0


def test_eval_dictionary_cli_runs_on_a_tiny_model(tmp_path):
    model = tiny_model("llama", vocab_size=dct.VOCAB_SIZE, max_position_embeddings=2048)
    model.save_pretrained(str(tmp_path / "m"))
    r = CliRunner().invoke(main, ["eval", "dictionary", "-m", str(tmp_path / "m"), "--method", "streaming",
                                  "-o", "chunk=128", "--dict-tokens", "300,1K", "--samples", "2",
                                  "--out", str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "out" / "dictionary.json").read_text())
    assert set(res["results"]) == {"300", "1024"} and len(res["results"]["300"]["samples"]) == 2
    assert 0.0 <= res["results"]["1024"]["accuracy"] <= 1.0
    assert res["label"] == "streaming" and set(res["runs"]) == {"streaming"}
    r = CliRunner().invoke(main, ["eval", "dictionary", "-m", str(tmp_path / "m"), "--dict-tokens", "300",
                                  "--samples", "1", "--label", "no memory", "--out", str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "out" / "dictionary.json").read_text())
    assert set(res["runs"]) == {"streaming", "no memory"} and (tmp_path / "out" / "dictionary.png").stat().st_size > 1000
    # the default label of a run with other options names another run: both are kept; a rerun replaces its own
    for chunk, runs in (("64", {"streaming", "no memory", "streaming #2"}), ("128", {"streaming", "no memory", "streaming #2"})):
        r = CliRunner().invoke(main, ["eval", "dictionary", "-m", str(tmp_path / "m"), "--method", "streaming",
                                      "-o", f"chunk={chunk}", "--dict-tokens", "300", "--samples", "1",
                                      "--out", str(tmp_path / "out"), "--json"])
        assert r.exit_code == 0, r.output
        assert set(json.loads((tmp_path / "out" / "dictionary.json").read_text())["runs"]) == runs
