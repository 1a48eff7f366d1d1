"""Per-family model maps: where things live in each Hugging Face architecture.

Methods never hard-code module names; they ask the family.  Supporting a new
family that already runs on transformers' attention interface costs one entry
in ``FAMILIES``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lcx.errors import UnsupportedModelError


@dataclass(frozen=True)
class Family:
    """Where a family keeps its decoder layers, attention, rotary embedding and projections."""

    model_type: str
    layers: str  # dotted path from the CausalLM to the ModuleList of decoder layers
    attention: str  # attribute of a decoder layer holding the attention module
    rotary: str | None  # dotted path to the rotary-embedding module; None = absolute positions
    #: LoRA target names by role. Fused projections name the same module for several roles.
    roles: dict[str, str] = field(default_factory=dict)
    notes: str = ""
    #: every layer slides over the config's ``sliding_window`` when it is set (no window on the attention modules)
    window_from_config: bool = False

    @property
    def positions(self) -> str:
        return "rotary" if self.rotary else "absolute"

    @property
    def fused_qkv(self) -> bool:
        return len({self.roles.get(r) for r in ("q", "k", "v")}) == 1


_LLAMA_ROLES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}


def _llama_like(model_type: str, notes: str = "", window_from_config: bool = False) -> Family:
    return Family(model_type, "model.layers", "self_attn", "model.rotary_emb", dict(_LLAMA_ROLES), notes,
                  window_from_config)


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in [
        _llama_like("llama"),
        _llama_like("mistral", "sliding-window attention in some checkpoints", window_from_config=True),
        _llama_like("qwen2"),
        _llama_like("qwen3", "keys are RMS-normalised before RoPE"),
        _llama_like("gemma", "embeddings scaled by sqrt(hidden)"),
        _llama_like("gemma2", "alternating sliding/full layers, attention softcap"),
        _llama_like("gemma3_text", "alternating sliding/full layers, per-layer-type RoPE, q/k norm"),
        _llama_like("olmo"),
        _llama_like("olmo2"),
        _llama_like("starcoder2", window_from_config=True),
        _llama_like("granite"),
        Family("phi3", "model.layers", "self_attn", "model.rotary_emb", {"q": "qkv_proj", "k": "qkv_proj", "v": "qkv_proj", "o": "o_proj"}, "fused qkv_proj", window_from_config=True),
        Family("gpt2", "transformer.h", "attn", None, {"q": "c_attn", "k": "c_attn", "v": "c_attn", "o": "c_proj"}, "fused c_attn, absolute positions"),
        Family("gpt_neox", "gpt_neox.layers", "attention", "gpt_neox.rotary_emb", {"q": "query_key_value", "k": "query_key_value", "v": "query_key_value", "o": "dense"}, "fused query_key_value, partial rotary"),
    ]
}

#: Families that exist in transformers but do not run through the attention interface.
NOT_ON_ATTENTION_INTERFACE = {"gptj", "falcon", "bloom", "mpt", "codegen", "gpt_neo"}


def get_submodule(root: nn.Module, path: str) -> nn.Module:
    return root.get_submodule(path)


def family_of(model: nn.Module) -> Family:
    """The family map for ``model``, or an error naming what is missing and what would still work."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    fam = FAMILIES.get(model_type or "")
    if fam is not None:
        return fam
    from lcx.registry import registry  # local import: registry imports plugins

    working = [n for n, m in sorted(registry().methods.items()) if not m.requires]
    if model_type in NOT_ON_ATTENTION_INTERFACE or not _uses_attention_interface(model):
        missing = "it does not run attention through transformers' AttentionInterface"
    else:
        missing = "lcx has no family map for it (add an entry to lcx.adapters.families.FAMILIES)"
    raise UnsupportedModelError(
        f"model family {model_type!r} is not supported: {missing}; "
        f"methods that still work: {', '.join(working) or 'none'}"
    )


def capabilities(model: nn.Module, family: Family) -> frozenset[str]:
    caps = set()
    if _uses_attention_interface(model):
        caps.add("attention_interface")
    if family.rotary:
        caps.add("rotary")
    return frozenset(caps)


def _uses_attention_interface(model: nn.Module) -> bool:
    fn = getattr(model, "_can_set_attn_implementation", None)
    return bool(fn and fn())


def attention_modules(model: nn.Module, family: Family) -> list[nn.Module]:
    """The attention module of every decoder layer, in layer order."""
    layers = get_submodule(model, family.layers)
    return [getattr(layer, family.attention) for layer in layers]


def sliding_windows(model: nn.Module, family: Family) -> list[int | None]:
    """Each decoder layer's sliding window in tokens (``layer_window``); None for a full-attention layer."""
    return [layer_window(m, model.config) for m in attention_modules(model, family)]


def layer_window(attention: nn.Module, config: Any) -> int | None:
    """An attention module's sliding window in tokens; None for full attention.  Families with per-layer types
    (Gemma, Qwen2) name it on each module; a family whose masks slide every layer over the config's window
    (``window_from_config``: Mistral, Phi-3, Starcoder2) takes it from there, whatever else the config holds."""
    own = getattr(attention, "sliding_window", None)
    if own:
        return int(own)
    family = FAMILIES.get(getattr(config, "model_type", None) or "")
    return (getattr(config, "sliding_window", None) or None) if family and family.window_from_config else None


def num_layers(model: nn.Module, family: Family) -> int:
    return len(get_submodule(model, family.layers))


def context_window(model: nn.Module) -> int:
    """The trained context length (positions) of the model."""
    return config_window(model.config)


def json_config(config: dict[str, Any]) -> Any:
    """A model folder's config.json (a dict) as transformers reads it (legacy fields such as ``rope_scaling``
    folded in)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})


def json_window(config: dict[str, Any]) -> int:
    """``config_window`` of a model folder's config.json (a dict)."""
    return config_window(json_config(config))


def config_window(cfg: Any) -> int:
    """The trained context length of a transformers config: a stretched rope's original length first."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    orig = rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None
    for v in (orig, getattr(cfg, "max_position_embeddings", None), getattr(cfg, "n_positions", None)):
        if v:
            return int(v)
    raise UnsupportedModelError(
        f"cannot tell the context window of model type {cfg.model_type!r}: its config has no "
        "max_position_embeddings; set it there (its trained context length), or for vanilla -o vanilla.window=N"
    )


def rotary_embedding(model: nn.Module, family: Family) -> nn.Module | None:
    return get_submodule(model, family.rotary) if family.rotary else None


def rotary_inv_freq(model: nn.Module, family: Family, layer_idx: int = 0) -> torch.Tensor:
    """Inverse frequencies (D_rot/2,) of layer ``layer_idx``'s RoPE, for re-rotating cached keys."""
    rot = rotary_embedding(model, family)
    if rot is None:
        raise UnsupportedModelError(f"model family {family.model_type!r} has no rotary embedding")
    inv = layer_inv_freq(rot, model.config, layer_idx)
    if inv is None:
        raise UnsupportedModelError(
            f"cannot find RoPE frequencies in {type(rot).__name__} of family {family.model_type!r}"
        )
    return inv


def layer_inv_freq(rot: nn.Module, config: Any, layer_idx: int) -> torch.Tensor | None:
    """Layer ``layer_idx``'s inverse frequencies in the rotary embedding ``rot`` built from ``config``: its one
    ``inv_freq``, or per layer type (gemma3: ``<type>_inv_freq``); None when it has neither."""
    inv = getattr(rot, "inv_freq", None)
    layer_types = getattr(config, "layer_types", None)
    if inv is None and layer_types:
        inv = getattr(rot, f"{layer_types[layer_idx]}_inv_freq", None)
    return inv
