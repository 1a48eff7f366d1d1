"""What the chunking stage returns: the tokens the model sees, and in which windows."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lcx.errors import LcxError

#: Most tokens one forward pass reads when the methods leave the prompt whole: a longer prompt is prefilled in
#: windows of this many (exact: each reads the cache of the ones before), so that masks, attention and
#: activations scale with it rather than with the prompt.
PREFILL_CHUNK = 4096


@dataclass
class Plan:
    """A chunking plan for one (batched) input.

    ``input_ids``/``attention_mask`` (B, T) are the tokens the model will see, in
    order (a method may drop or reorder tokens).  ``windows`` are contiguous
    ``(start, end)`` spans covering ``[0, T)``: all but the last are prefilled
    into the memory one at a time; generation starts from the last one.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    windows: list[tuple[int, int]]
    #: Tokens of the original input the model will never see (vanilla truncation).
    dropped: int = 0
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        T = self.input_ids.shape[1]
        expected = 0
        for s, e in self.windows:
            if s != expected or e <= s:
                raise LcxError(f"invalid plan windows {self.windows}: spans must be contiguous and non-empty")
            expected = e
        if expected != T:
            raise LcxError(f"invalid plan windows {self.windows}: they cover {expected} of {T} tokens")

    @classmethod
    def whole(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, dropped: int = 0) -> "Plan":
        """Feed the input as it is: in windows of ``PREFILL_CHUNK`` tokens, each reading the ones before."""
        return cls.chunked(input_ids, attention_mask, PREFILL_CHUNK, dropped=dropped)

    @classmethod
    def chunked(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, chunk: int, dropped: int = 0) -> "Plan":
        """Feed the whole input in windows of ``chunk`` tokens (the last one may be shorter)."""
        if chunk <= 0:
            raise LcxError(f"chunk size must be positive, got {chunk}")
        T = input_ids.shape[1]
        spans = [(s, min(s + chunk, T)) for s in range(0, T, chunk)]
        return cls(input_ids, attention_mask, spans, dropped=dropped)


def left_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D token rows into (B, T) ids and mask, padding on the left."""
    T = max(int(r.numel()) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        if r.numel():
            ids[i, T - r.numel():] = r
            mask[i, T - r.numel():] = 1
    return ids, mask


def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """The real tokens of each row, without padding."""
    return [input_ids[i][attention_mask[i].bool()] for i in range(input_ids.shape[0])]
