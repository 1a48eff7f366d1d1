"""Dictionary lookup (FoT, Tworkowski et al. 2023, appendix F): generator and scorer.

A document is a dictionary followed by queries.  Vocabulary: 64 ordinary
tokens plus the specials <k> <v> <q> (and <pad>).  A definition is
``<k> k1 k2 k3 k4 <v> v1 v2 v3 v4``; a query is ``<q> k1 k2 k3 k4 <v> v1 v2 v3 v4``
for a key defined earlier.  Training documents are 512 tokens (first half
definitions, second half queries) with the loss only on the queried values;
evaluation uses longer dictionaries and the last ``query_tokens`` (256) as
queries.  A query counts as correct when all four value tokens are predicted
(greedy, teacher-forced).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch

from lcx.errors import LcxError
from lcx.io import pyplot, save_figure, token_label

N_SYMBOLS = 64
KEY, VALUE, QUERY, PAD = 64, 65, 66, 67
VOCAB_SIZE = 68
KEY_LEN = VALUE_LEN = 4
ENTRY = 2 + KEY_LEN + VALUE_LEN  # <k>/<q> + key + <v> + value = 10 tokens


@dataclass
class Document:
    input_ids: torch.Tensor  # (T,)
    labels: torch.Tensor  # (T,) -100 except on queried value tokens
    n_queries: int


def make_document(rng: random.Random, dict_tokens: int, query_tokens: int, near: float = 0.0) -> Document:
    """A dictionary of ``dict_tokens // 10`` definitions followed by ``query_tokens // 10`` queries.

    ``near`` (training only; evaluation keeps 0): the share of definitions after the first whose key is a
    near miss of an earlier one: it keeps ``NEAR_SHARED`` of that key's symbols in place and draws the
    others anew.  Random keys rarely share two symbols in a short document (~1 such key per query among
    d = 32 documents) but often do in a long dictionary (~9 at 64K tokens); near misses put that
    competition into training."""
    n_def, n_q = dict_tokens // ENTRY, query_tokens // ENTRY
    if n_def < 1 or n_q < 1:
        raise LcxError(f"dictionary needs >= {ENTRY} tokens for definitions and queries (got {dict_tokens}, {query_tokens})")
    if n_def > N_SYMBOLS ** KEY_LEN:
        raise LcxError(f"{n_def} definitions exceed the {N_SYMBOLS ** KEY_LEN} distinct keys")
    if not 0.0 <= near <= 1.0:
        raise LcxError(f"near must be a share in [0, 1], got {near}")
    keys: set[tuple[int, ...]] = set()
    entries = []
    while len(entries) < n_def:
        if entries and near and rng.random() < near:
            k = _near_miss(rng, entries[rng.randrange(len(entries))][0])
        else:
            k = tuple(rng.randrange(N_SYMBOLS) for _ in range(KEY_LEN))
        if k in keys:
            continue
        keys.add(k)
        entries.append((k, tuple(rng.randrange(N_SYMBOLS) for _ in range(VALUE_LEN))))
    ids: list[int] = []
    for k, v in entries:
        ids += [KEY, *k, VALUE, *v]
    ids += [PAD] * (dict_tokens - len(ids))
    labels = [-100] * len(ids)
    for _ in range(n_q):
        k, v = entries[rng.randrange(n_def)]
        ids += [QUERY, *k, VALUE]
        labels += [-100] * (2 + KEY_LEN)
        ids += list(v)
        labels += list(v)
    pad = query_tokens - n_q * ENTRY
    ids += [PAD] * pad
    labels += [-100] * pad
    return Document(torch.tensor(ids), torch.tensor(labels), n_q)


NEAR_SHARED = 2  # symbols a near-miss key keeps from the key it is drawn from


def _near_miss(rng: random.Random, key: tuple[int, ...]) -> tuple[int, ...]:
    """``key`` with all but ``NEAR_SHARED`` of its symbols (positions drawn at random) replaced by others."""
    keep = set(rng.sample(range(KEY_LEN), NEAR_SHARED))
    return tuple(s if i in keep else rng.choice([x for x in range(N_SYMBOLS) if x != s]) for i, s in enumerate(key))


def training_batch(rng: random.Random, batch_size: int, length: int = 512,
                   doc_tokens: int | None = None, near: float = 0.0) -> dict[str, torch.Tensor]:
    """Training rows of ``length`` tokens; loss on queried values only.  Each row is one document (first
    half definitions, second half queries), or with ``doc_tokens`` ``length // doc_tokens`` such documents
    of ``doc_tokens`` tokens back to back, as the paper concatenates documents: then a row's later
    contexts of definitions are read with earlier, unrelated documents in memory, as every definition
    window after the first is at evaluation.  ``near``: near-miss keys, see ``make_document``."""
    doc = doc_tokens or length
    if length % doc:
        raise LcxError(f"--seq-len {length} is not a multiple of the dictionary documents' {doc} tokens; "
                       f"use a multiple (e.g. {max(doc, length // doc * doc)})")
    rows = []
    for _ in range(batch_size):
        docs = [make_document(rng, doc // 2, doc - doc // 2, near) for _ in range(length // doc)]
        rows.append((torch.cat([d.input_ids for d in docs]), torch.cat([d.labels for d in docs])))
    ids = torch.stack([r[0] for r in rows])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.stack([r[1] for r in rows])}


def score(doc: Document, logits_fn: Callable[[torch.Tensor, int], torch.Tensor], query_tokens: int) -> dict[str, int]:
    """``logits_fn(ids (1, T), n)`` -> logits (n, V) predicting the last n tokens.  Teacher-forced greedy check."""
    n = query_tokens
    logits = logits_fn(doc.input_ids[None], n)
    labels = doc.labels[-n:]
    pred = logits.argmax(-1).cpu()
    mask = labels != -100
    tok_ok = (pred == labels) & mask
    # group each query's 4 value tokens
    q_ok = tok_ok[mask].view(-1, VALUE_LEN).all(-1)
    return {"queries": int(q_ok.numel()), "correct": int(q_ok.sum()), "tokens": int(mask.sum()),
            "tokens_correct": int(tok_ok.sum())}


def plot(runs: dict[str, dict], path, title: str):
    """Query accuracy vs dictionary size (log x), one line per run (e.g. fot vs a no-memory baseline)."""
    from pathlib import Path

    fig, ax = pyplot().subplots(figsize=(6, 3.6))
    sizes = sorted({int(n) for r in runs.values() for n in r["results"]})
    for label, r in runs.items():
        xs = sorted(int(n) for n in r["results"])
        ax.plot(xs, [r["results"][str(n)]["accuracy"] for n in xs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [token_label(n) for n in sizes])
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("dictionary tokens before the queries")
    ax.set_ylabel("query accuracy (all 4 value tokens)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, Path(path), title)
