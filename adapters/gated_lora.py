"""Token-gated LoRA: a PEFT LoRA adapter whose delta applies only at chosen token positions.

FocusLLM computes one *candidate* token per chunk with its own q/k/v/o projections while every
other token goes through the frozen base weights.  Carrying those projections as a LoRA adapter
whose delta is switched per token keeps them a plain PEFT adapter (saved, loaded and trained like
any other), with no copy of the modeling code: a forward hook on each ``lora_B`` multiplies the
delta by a (batch, tokens) gate.  A zero-initialised (untrained) adapter equals the base weights.

    gate = TokenGate()
    handles = gate_lora(peft_model, gate)
    with gate.only(mask):        # mask (B, T): 1 where the adapter applies, 0 where the base weights do
        peft_model(input_ids)
    # outside `only`: ordinary LoRA everywhere, or nowhere with TokenGate(default_open=False)
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from lcx.errors import LcxError


class TokenGate:
    """The per-token switch shared by every gated LoRA layer of a model."""

    def __init__(self, default_open: bool = True) -> None:
        self.mask: torch.Tensor | None = None  # (B, T) inside `only`
        self.default_open = default_open  # outside `only`: ordinary LoRA (True) or the base weights (False)

    @contextlib.contextmanager
    def only(self, mask: torch.Tensor) -> Iterator[None]:
        """Within the block, LoRA deltas apply where ``mask`` (B, T) is non-zero, nowhere else."""
        if mask.dim() != 2:
            raise LcxError(f"a token gate needs a (batch, tokens) mask, got shape {tuple(mask.shape)}")
        previous, self.mask = self.mask, mask
        try:
            yield
        finally:
            self.mask = previous

    def _hook(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        if self.mask is None:
            return output if self.default_open else output * 0
        if output.shape[:2] != self.mask.shape:
            raise LcxError(f"token gate of shape {tuple(self.mask.shape)} does not match a LoRA delta of "
                           f"{tuple(output.shape[:2])} (batch, tokens); set the gate for the tokens of this forward")
        return output * self.mask[..., None].to(output.dtype)


def gate_lora(model: nn.Module, gate: TokenGate, adapter: str = "default") -> list[torch.utils.hooks.RemovableHandle]:
    """Put every LoRA layer of ``adapter`` in ``model`` under ``gate``; returns the hook handles
    (``handle.remove()`` ungates).  Refuses merged adapters and LoRA variants (DoRA ...), whose delta
    is not the output of ``lora_B``."""
    from peft.tuners.lora import LoraLayer

    handles = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_B:
            continue
        if module.merged or adapter in getattr(module, "lora_variant", {}):
            raise LcxError(f"{name}: a merged LoRA or a LoRA variant (DoRA ...) cannot be gated per token; "
                           "use a plain, unmerged LoRA adapter")
        handles.append(module.lora_B[adapter].register_forward_hook(gate._hook))
    if not handles:
        raise LcxError(f"no LoRA layer of adapter {adapter!r} to gate; add the adapter first (lcx.adapters.peft_bridge.add_adapter)")
    return handles
