"""Masks for caches that keep a subset of the positions they have seen.

Such caches (streaming's sinks + window, FoT's local window) report the full
logical length to transformers' mask builder, so padding is represented over
absolute positions; the attention stage then keeps the columns of the keys the
cache actually returned.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin


def visible_mask(attention_mask: torch.Tensor | None, runs: list[tuple[int, int]], total: int, q_len: int,
                 base_impl: str, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """The mask (B|1, 1, q_len, S) for the keys at absolute positions ``runs`` (ascending ``(start, stop)``
    ranges, S positions in all) and the last ``q_len`` of ``total`` positions as queries.  Keeps the base
    mask's kind (bool for sdpa, additive float for eager); builds a causal one on ``device`` when the base skipped
    it (None)."""
    if attention_mask is not None:  # slices, not a gather (indexing the columns one by one is far slower)
        parts = [attention_mask[..., a:b] for a, b in runs if b > a] or [attention_mask[..., :0]]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    kept = kept_positions(runs, device)
    q_pos = torch.arange(total - q_len, total, device=kept.device)
    allowed = (kept[None, :] <= q_pos[:, None])[None, None]  # (1, 1, q_len, S)
    if base_impl == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=kept.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return allowed


def kept_positions(runs: list[tuple[int, int]], device: torch.device | None = None) -> torch.Tensor:
    """The absolute positions of ``runs`` (``visible_mask``'s ranges) as one tensor."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in runs] or [torch.zeros(0, dtype=torch.long)])


def to_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool (True = attend) or additive mask as an additive float mask.  Hidden keys get the dtype's lowest
    finite value, not -inf: a query that sees no key at all (padding before a left-padded row's tokens) then
    averages the hidden ones instead of giving NaN, which the next layer's keys would carry into every real
    token (NaN times a zero weight is NaN); any visible key still takes all of the weight."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask.to(dtype)


class SubsetCacheLayer(CacheLayerMixin):
    """Base for cache layers that keep some of the positions they have seen.

    They report the full logical length to transformers (so masks and positions
    stay absolute) and their attention stage keeps the visible columns with
    ``visible_mask``.  Subclasses implement ``update`` and ``_reset_state``.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self) -> None:
        super().__init__()
        self.cumulative_length = 0  # every token ever seen (absolute cache index of the next one)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self.cumulative_length = 0
        self._reset_state()

    def _reset_state(self) -> None:
        pass
