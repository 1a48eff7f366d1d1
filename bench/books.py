"""The shared books as one token stream, for benchmarks that need N real tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from lcx.data import iter_documents

BOOKS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "books"


def book_tokens(tokenizer, n: int, offset: int = 0) -> torch.Tensor:
    """``n`` tokens of the books read in order, from token ``offset``: shape (1, n)."""
    ids: list[int] = []
    for doc in iter_documents([str(BOOKS)]):  # a plain generator: no `datasets` needed
        ids += tokenizer(doc["text"], add_special_tokens=False)["input_ids"]
        if len(ids) >= offset + n:
            return torch.tensor(ids[offset:offset + n])[None]
    raise SystemExit(f"the books in {BOOKS} hold only {len(ids)} tokens; lower --lengths")
