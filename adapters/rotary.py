"""Re-rotating RoPE vectors after the fact (keys arrive from transformers already rotated).

RoPE rotations compose, R(a) R(b) = R(a + b), so a key rotated at position p can
be moved to position p + s by rotating it by s, and un-rotated (to "position 0")
by rotating it by -p.  Layout is transformers' rotate-half convention; with
partial rotary (gpt_neox) only the first ``2 * len(inv_freq)`` dims rotate.
"""

from __future__ import annotations

import torch


def rotate(x: torch.Tensor, shift: int | torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate RoPE vectors ``x`` (..., S, D) by ``shift`` positions: an int, or a tensor (S,) / (..., S)."""
    rot = 2 * inv_freq.numel()
    shift_t = torch.as_tensor(shift, dtype=torch.float64, device=x.device)
    angle = shift_t[..., None] * inv_freq.to(device=x.device, dtype=torch.float64)  # float64: shifts reach 1e5 rad
    cos = torch.cat([angle.cos(), angle.cos()], dim=-1).to(torch.float32)  # (..., rot) or (..., S, rot)
    sin = torch.cat([angle.sin(), angle.sin()], dim=-1).to(torch.float32)
    v = x[..., :rot].float()
    half = rot // 2
    rotated_half = torch.cat([-v[..., half:], v[..., :half]], dim=-1)
    out = (v * cos + rotated_half * sin).to(x.dtype)
    return torch.cat([out, x[..., rot:]], dim=-1) if rot < x.shape[-1] else out
