"""Training and evaluation data: local text files, folders, JSONL, through `datasets`.

    docs = load_documents(["../shared/data/books/"])            # one document per file
    windows = token_windows(docs, tokenizer, seq_len=2048)       # cached tokenisation

A folder contributes every text-like file below it (one document each); a
``.jsonl`` file contributes one document per line (its ``text`` field, or the
field you name).  Tokenisation is cached by `datasets` (fingerprinted by the
files' paths, sizes and modification times, and the tokenizer).

Instead of files, ``lcx train`` can read a synthetic *task* (``--data task:NAME[:ARG...]``): a ``Task`` that a
plugin registers with ``lcx_register_tasks`` and that makes fresh seeded batches every step.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from lcx.errors import LcxError

if TYPE_CHECKING:
    import random

    import torch

#: A synthetic task's batches: ``(rng, batch_size, seq_len) -> {"input_ids", "attention_mask", "labels"}``, each
#: (batch_size, seq_len), a pure function of ``rng``.
Batches = Callable[["random.Random", int, int], "dict[str, torch.Tensor]"]


@dataclass(frozen=True)
class Task:
    """A synthetic training task, named in ``lcx train --data task:NAME[:ARG...]`` (see ``lcx_register_tasks``)."""

    #: The NAME in ``task:NAME``.
    name: str
    #: The ARGs (strings, in order) -> the task's batches; an ``LcxError`` naming an ARG it does not take.
    make: Callable[[list[str]], Batches]
    #: What it is and which ARGs it takes, listed when an unknown task is named.
    help: str = ""


TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".text")
JSONL_SUFFIXES = (".jsonl", ".json")


def _files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise LcxError(f"data path {str(p)!r} does not exist; pass text files, folders or .jsonl files")
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES)
            if not found:
                raise LcxError(
                    f"data folder {str(p)!r} has no documents (looked for {', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)})"
                )
            out.extend(found)
        else:
            out.append(p)
    if not out:
        raise LcxError("no data paths given; pass text files, folders or .jsonl files")
    return out


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is not text
    except UnicodeDecodeError as e:
        raise LcxError(f"data file {str(path)!r} is not UTF-8 text (offset {e.start}); convert it or remove it") from None


def iter_documents(paths: Iterable[str | os.PathLike], text_field: str = "text") -> Iterable[dict[str, str]]:
    """Text files one document each; .jsonl one JSON object per line (a .json file may also be one array of
    them), the text in ``text_field``."""
    for f in _files(paths):
        if f.suffix.lower() in JSONL_SUFFIXES:
            text = _read_text(f)
            if f.suffix.lower() == ".json" and text.lstrip().startswith("["):
                try:
                    rows = list(enumerate(json.loads(text)))
                except json.JSONDecodeError as e:
                    raise LcxError(f"{str(f)!r} is not JSON ({e.msg} at line {e.lineno})") from None
                where = "item"
            else:
                rows, where = [], "line"
                for i, line in enumerate(text.splitlines()):
                    if not line.strip():
                        continue
                    try:
                        rows.append((i, json.loads(line)))
                    except json.JSONDecodeError as e:
                        raise LcxError(f"{str(f)!r} line {i + 1} is not JSON ({e.msg}); one JSON object per line "
                                       f"(or, in a .json file, one array of objects)") from None
            for i, row in rows:
                if not isinstance(row, dict) or text_field not in row:
                    have = f" (it has: {', '.join(map(str, list(row)[:6]))})" if isinstance(row, dict) else ""
                    raise LcxError(f"{str(f)!r} {where} {i + 1} has no {text_field!r} field{have}; "
                                   f"pass --text-field NAME")
                value = row[text_field]
                if not isinstance(value, str):  # null, a number or a list became the text "None", "42", "['a']"
                    raise LcxError(f"{str(f)!r} {where} {i + 1}: field {text_field!r} holds {json.dumps(value)[:40]}, "
                                   f"not text; give each document's text as a string (or leave the row out)")
                yield {"text": value, "source": f"{f}:{i + 1}"}
        else:
            yield {"text": _read_text(f), "source": str(f)}


def load_documents(paths: Iterable[str | os.PathLike], text_field: str = "text"):
    """A `datasets.Dataset` with columns ``text`` and ``source``; empty documents are dropped."""
    import datasets

    paths = [str(p) for p in paths]
    files = _files(paths)
    # The fingerprint makes `datasets` cache per file set + content version.
    stamp = hashlib.sha256(
        json.dumps([(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files] + [text_field]).encode()
    ).hexdigest()[:16]
    docs = [d for d in iter_documents(paths, text_field) if d["text"].strip()]
    if not docs:
        raise LcxError(f"the corpus {paths} is empty: every document is blank")
    ds = datasets.Dataset.from_list(docs)
    ds._fingerprint = f"lcx-docs-{stamp}"
    return ds


def special_prefix(tokenizer: Any) -> list[int]:
    """The tokens the tokenizer puts before every text (its BOS, where it adds one), or none."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    n = len(full) - len(plain)
    return list(full[:n]) if n > 0 and list(full[n:n + len(plain)]) == list(plain) else []


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Identity of a tokenizer's behaviour (its serialised fast tokenizer, or its vocabulary)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    blob = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"{blob}|{tokenizer.eos_token_id}".encode()).hexdigest()[:16]


def tokenize(docs, tokenizer: Any, num_proc: int | None = None):
    """Add ``input_ids`` (no special tokens; an EOS ends each document).

    Cached on disk under ``$LCX_HOME/data`` by (documents, tokenizer) fingerprint: a second
    run over the same files with the same tokenizer reads the Arrow cache instead of tokenising.
    """
    from lcx.models import cache_dir

    eos = tokenizer.eos_token_id
    cache = cache_dir() / "data" / f"tok-{docs._fingerprint}-{tokenizer_fingerprint(tokenizer)}.arrow"
    cache.parent.mkdir(parents=True, exist_ok=True)

    def fn(batch: dict[str, list]) -> dict[str, list]:
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + ([eos] if eos is not None else []) for x in ids]}

    return docs.map(fn, batched=True, remove_columns=["text"], num_proc=num_proc, desc="tokenizing",
                    cache_file_name=str(cache), load_from_cache_file=True)


def token_windows(docs, tokenizer: Any, seq_len: int, concat: bool = True):
    """Fixed-length training windows of ``seq_len`` tokens, each opening with the tokenizer's BOS where it adds
    one (:func:`special_prefix`).

    Documents longer than ``seq_len`` are cut into consecutive windows; with
    ``concat`` the remainders and short documents are concatenated (EOS between
    them) into further windows, as long-context training does.  Without
    ``concat``, every window lies within one document: a document's remainder, and a
    document shorter than ``seq_len`` altogether, give no window (an error only when
    no document gives one).
    """
    if seq_len <= 1:
        raise LcxError(f"seq_len must be > 1, got {seq_len}")
    tok = tokenize(docs, tokenizer)
    prefix = special_prefix(tokenizer)  # each window starts as the model's inputs do (Gemma's <bos>)
    body = seq_len - len(prefix)
    if body <= 0:
        raise LcxError(f"seq_len must be > {len(prefix)} (the tokenizer's BOS starts every window), got {seq_len}")

    def fn(batch: dict[str, list]) -> dict[str, list]:
        out, src, carry = [], [], []
        for ids, s in zip(batch["input_ids"], batch["source"]):
            stream = carry + ids if concat else ids
            n_full = len(stream) // body
            for k in range(n_full):
                out.append(prefix + stream[k * body:(k + 1) * body])
                src.append(s)
            carry = stream[n_full * body:] if concat else []
        return {"input_ids": out, "source": src}

    # one batch so documents concatenate across the whole corpus (deterministic order)
    windows = tok.map(fn, batched=True, batch_size=None, remove_columns=tok.column_names, desc="windowing")
    if len(windows) == 0:
        longest = max(len(x) for x in tok["input_ids"])
        raise LcxError(
            f"no training window of {seq_len} tokens can be formed: the longest document has {longest} tokens"
            + ("" if concat else "; allow concatenation (--concat) or lower --seq-len")
        )
    return windows.with_format("torch")
