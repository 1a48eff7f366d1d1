"""Multi-LoRA products for vLLM's CPU path: one matrix product per adapter in the batch.

vLLM 0.32's CPU punica wrapper (``vllm.lora.punica_wrapper.punica_cpu``) computes every LoRA product
with the PyTorch ops of ``vllm.lora.ops.torch_ops``, which gather a copy of an adapter's matrix for
every token (``weights[indices]``: for a 16K-token prefill of a rank-8 q/k adapter, 16K copies of each
matrix per layer) and then multiply token by token.  They also read a token's adapter slot ``-1``
("no LoRA") as Python does, as the *last* slot: a base-model request batched with others gets the
adapter that sits in the last slot.

The ops here take the same arguments and give the same result for every token that names an adapter:
they group the tokens by slot and multiply each group by its adapter's matrix once; a token of slot
``-1`` gets no LoRA, as vLLM's GPU kernels give it.  ``install()`` puts them in the CPU wrapper's
namespace; ``register()`` (lcx's vLLM plugin) calls it in every vLLM process.  ``LCX_VLLM_LORA_OPS=vllm``
in the server's environment keeps vLLM's own ops (``bench/serve_lora_cost.py`` compares the two).
"""

from __future__ import annotations

import os

import torch

#: Environment variable: ``vllm`` keeps vLLM's own CPU LoRA ops.
OPS_ENV = "LCX_VLLM_LORA_OPS"


def _products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = inputs[t] @ weights[indices[t]].T`` for every token ``t``, zero where ``indices[t] < 0``:
    ``inputs`` [tokens, in], ``weights`` [slots, (1,) out, in], ``indices`` [tokens] (or one for all)."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype)
    n = inputs.shape[0]
    if indices.numel() == 1 and n != 1:
        indices = indices.expand(n)
    out = inputs.new_zeros((n, weights.shape[1]))
    slots = indices.unique().tolist()
    for slot in slots:
        if slot < 0:
            continue
        w = weights[slot].to(dtype)
        if len(slots) == 1:
            out = inputs @ w.T
        else:
            rows = (indices == slot).nonzero().squeeze(1)
            out[rows] = inputs[rows] @ w.T
    return out


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    outputs = _products(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    outputs = _products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int, slice_size: int,
                      add_inputs: bool = True):
    outputs = _products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = outputs


def _tokens(lora_indices_tensor: torch.Tensor, seq_len_tensor: torch.Tensor) -> torch.Tensor:
    """Each token's slot, from each sequence's (what vLLM's ``sgmv_*`` ops are given)."""
    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor, batches,
                max_seq_length, token_nums, scaling: float):
    bgmv_shrink(inputs, lora_a_weights, output_tensor, _tokens(lora_indices_tensor, seq_len_tensor), scaling)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor, batches,
                max_seq_length, token_nums, add_inputs: bool = False):
    bgmv_expand(inputs, lora_b_weights, output_tensor, _tokens(lora_indices_tensor, seq_len_tensor), add_inputs)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                      batches, max_seq_length, token_nums, slice_offset: int, slice_size: int, add_inputs: bool = False):
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, _tokens(lora_indices_tensor, seq_len_tensor),
                      slice_offset, slice_size, add_inputs)


OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")


def install() -> bool:
    """Replace the CPU punica wrapper's ops by these; False (and nothing changed) where that wrapper or one
    of its ops is missing (another vLLM version: its own ops stay) or ``LCX_VLLM_LORA_OPS=vllm`` asks for
    vLLM's."""
    if os.environ.get(OPS_ENV, "lcx") == "vllm":
        return False
    try:
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return False
    if not all(callable(getattr(punica_cpu, name, None)) for name in OPS):
        return False
    for name in OPS:
        setattr(punica_cpu, name, globals()[name])
    return True
