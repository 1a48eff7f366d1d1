"""Corpora: files, folders, JSONL; cached tokenisation; windowing with and without concatenation."""

from __future__ import annotations

import json
import re

import pytest

from lcx.data import load_documents, token_windows
from lcx.errors import LcxError
from tests.helpers import char_tokenizer


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("LCX_HOME", str(tmp_path / "home"))
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("a" * 50)
    (d / "sub" / "b.py").write_text("b" * 20)
    (d / "skip.bin").write_bytes(b"\x00\x01")
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps({"body": "c" * n}) for n in (5, 7)) + "\n")
    return tmp_path


def test_sources(corpus):
    docs = load_documents([corpus / "docs", corpus / "rows.jsonl"], text_field="body")
    assert [len(t) for t in docs["text"]] == [50, 20, 5, 7]
    assert docs["source"][2].endswith("rows.jsonl:1")
    with pytest.raises(LcxError, match="no 'text' field"):
        load_documents([corpus / "rows.jsonl"])


def test_windows_concat_and_not(corpus):
    tok = char_tokenizer()
    docs = load_documents([corpus / "docs"])
    w = token_windows(docs, tok, seq_len=16)  # 51 + 21 tokens (with EOS) concatenated -> 4 full windows
    assert len(w) == 72 // 16 and w[0]["input_ids"].shape == (16,)
    w = token_windows(docs, tok, seq_len=16, concat=False)  # each document windowed on its own: 3 + 1
    assert len(w) == 4
    with pytest.raises(LcxError, match="longest document has 51 tokens"):
        token_windows(docs, tok, seq_len=64, concat=False)


def test_tokenisation_is_cached_on_disk(corpus):
    tok = char_tokenizer()
    docs = load_documents([corpus / "docs"])
    token_windows(docs, tok, seq_len=16)
    cached = list((corpus / "home" / "data").glob("tok-*.arrow"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    token_windows(load_documents([corpus / "docs"]), tok, seq_len=8)
    assert cached[0].stat().st_mtime_ns == stamp  # read, not rewritten
    (corpus / "docs" / "a.txt").write_text("changed text")  # new content -> new cache entry
    token_windows(load_documents([corpus / "docs"]), tok, seq_len=4)
    assert len(list((corpus / "home" / "data").glob("tok-*.arrow"))) == 2


def test_missing_and_empty(corpus):
    with pytest.raises(LcxError, match="does not exist"):
        load_documents([corpus / "nope"])
    (corpus / "blank").mkdir()
    (corpus / "blank" / "x.txt").write_text("   ")
    with pytest.raises(LcxError, match="empty"):
        load_documents([corpus / "blank"])
    (corpus / "bin").mkdir()
    (corpus / "bin" / "x.bin").write_bytes(b"1")
    with pytest.raises(LcxError, match="has no documents"):
        load_documents([corpus / "bin"])


def test_text_fields_that_are_not_text_are_refused_and_a_byte_order_mark_is_not_text(tmp_path):
    from lcx.data import iter_documents
    from lcx.session import read_text_file

    for value, shown in ((None, "null"), (42, "42"), (["a", "b"], '["a", "b"]')):
        f = tmp_path / "d.jsonl"
        f.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
        with pytest.raises(LcxError, match=re.escape(f"line 2: field 'text' holds {shown}, not text")):
            list(iter_documents([str(f)]))
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "hello"}).encode() + b"\n")
    assert [d["text"] for d in iter_documents([str(bom)])] == ["hello"]
    txt = tmp_path / "bom.txt"
    txt.write_bytes(b"\xef\xbb\xbfhello")
    assert [d["text"] for d in iter_documents([str(txt)])] == ["hello"] and read_text_file(txt) == "hello"


def test_ppl_documents_sharing_a_file_name_keep_apart(tmp_path):
    """eval ppl's per-document results are keyed by document name: two __init__.py in different folders were
    merged into one entry.  Unique names stay short; shared ones are the whole path."""
    from lcx.cli.evaluation import _ppl_documents
    from tests.helpers import char_tokenizer

    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "__init__.py").write_text(f"text of {sub} " * 20)
    (tmp_path / "a" / "book.txt").write_text("a book " * 20)
    names = [name for name, _ in _ppl_documents((str(tmp_path),), char_tokenizer(), None)]
    assert sorted(names) == sorted([str(tmp_path / "a" / "__init__.py"), str(tmp_path / "b" / "__init__.py"), "book.txt"])


def test_windows_open_with_the_bos_of_a_tokenizer_that_adds_one(corpus):
    """Gemma's tokenizer adds <bos>, and the model degenerates on text without it: windows keep their length and
    start with it; a tokenizer adding none (SmolLM2's, Qwen's) gives the windows it always gave."""
    from tokenizers import processors

    from lcx.data import special_prefix

    tok = char_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert special_prefix(tok) == [1]
    docs = load_documents([corpus / "docs"])
    w = token_windows(docs, tok, seq_len=16)  # 72 tokens, 15 per window after the BOS
    assert len(w) == 72 // 15 and all(x["input_ids"].shape == (16,) and x["input_ids"][0] == 1 for x in w)
    text = "".join(tok.decode(x["input_ids"][1:]) for x in w)
    assert text.startswith("a" * 50) and "<s>" not in text
    plain = token_windows(docs, char_tokenizer(), seq_len=16)
    assert plain[0]["input_ids"][0] != 1
