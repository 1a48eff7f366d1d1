"""The shared books as one token stream, for benchmarks that need N real tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from lcx.data import load_documents

BOOKS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "books"


def book_tokens(tokenizer, n: int) -> torch.Tensor:
    """The first ``n`` tokens of the books, read in order: shape (1, n)."""
    ids: list[int] = []
    for doc in load_documents([BOOKS]):
        ids += tokenizer(doc["text"], add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            return torch.tensor(ids[:n])[None]
    raise SystemExit(f"the books in {BOOKS} hold only {len(ids)} tokens; lower --lengths")
