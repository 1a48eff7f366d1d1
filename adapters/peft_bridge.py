"""PEFT bridge: a method's trainable state travels as a standard PEFT (LoRA) adapter.

An lcx adapter folder is what PEFT writes (``adapter_config.json`` +
``adapter_model.safetensors``) plus a sidecar ``lcx.json`` that PEFT ignores:
which methods (and hyperparameters) the adapter was trained with, and the
identity of the base model.  Plain LoRA is what vLLM can serve, so that is
what we write.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

from lcx.adapters import families
from lcx.errors import LcxError
from lcx.io import check_safetensors, commit_files, read_json_file, recover

SIDECAR = "lcx.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
FORMAT_VERSION = 1


def base_identity(model: nn.Module) -> dict[str, Any]:
    """Architecture fields plus a fingerprint of the input embeddings (cheap, weight-sensitive)."""
    model = unwrap(model)
    cfg = model.config
    return {
        "model_type": cfg.model_type,
        "num_hidden_layers": getattr(cfg, "num_hidden_layers", None),
        "hidden_size": getattr(cfg, "hidden_size", None),
        "vocab_size": getattr(cfg, "vocab_size", None),
        "name_or_path": str(getattr(cfg, "_name_or_path", "")),
        **embedding_hashes(model.get_input_embeddings().weight.detach()[:16]),
    }


def embedding_hashes(rows: torch.Tensor) -> dict[str, str]:
    """The fingerprint of a model's first embedding rows: sha256 of them in float32, and of them rounded to
    bfloat16 (equal for the same weights loaded in float32 or bfloat16)."""
    return {"embedding_sha256": hashlib.sha256(rows.float().contiguous().cpu().numpy().tobytes()).hexdigest(),
            "embedding_bf16_sha256": hashlib.sha256(
                rows.to(torch.bfloat16).float().contiguous().cpu().numpy().tobytes()).hexdigest()}


def same_embeddings(want: dict[str, Any], have: dict[str, Any]) -> bool:
    """Whether a sidecar's ``base_model`` fingerprint (``want``) and a model's (``have``) name the same weights:
    equal in float32, or, where the sidecar has it (adapters saved since 2026-11-28), rounded to bfloat16."""
    if want.get("embedding_sha256") == have.get("embedding_sha256"):
        return True
    return bool(want.get("embedding_bf16_sha256")) and want["embedding_bf16_sha256"] == have.get("embedding_bf16_sha256")


def adapter_digest(adapter_dir: str | os.PathLike) -> str:
    """sha256 of an adapter's weights file: which adapter a folder held (retraining into it changes it)."""
    h = hashlib.sha256()
    with open(Path(adapter_dir) / ADAPTER_WEIGHTS, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a PeftModel (or the model itself)."""
    return model.get_base_model() if isinstance(model, PeftModel) else model


@contextlib.contextmanager
def lora_off(model: nn.Module):
    """``model`` with its LoRA layers off inside (its base weights alone), as they were after."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [(m, m.disable_adapters) for m in model.modules() if isinstance(m, BaseTunerLayer)]
    grads = {p: p.requires_grad for p in model.parameters()}  # enable_adapters(True) sets them: kept as they were
    for m, _ in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m, off in layers:
            m.enable_adapters(not off)
        for p, g in grads.items():
            p.requires_grad_(g)


def lora_targets(model: nn.Module, roles: tuple[str, ...]) -> list[str]:
    """Module names (suffixes) for attention ``roles`` ("q", "k", "v", "o") in this family."""
    fam = families.family_of(unwrap(model))
    unknown = [r for r in roles if r not in fam.roles]
    if unknown:
        raise LcxError(f"unknown LoRA role {unknown[0]!r}; roles are {', '.join(fam.roles)}")
    targets = sorted({fam.roles[r] for r in roles})
    qkv = [r for r in roles if r in ("q", "k", "v")]
    if fam.fused_qkv and qkv and len(qkv) < 3:
        warnings.warn(f"{fam.model_type} computes q, k and v in one projection ({fam.roles['q']}): a LoRA for roles "
                      f"{', '.join(roles)} adapts all three", stacklevel=2)
    return targets


def add_adapter(
    model: nn.Module,
    roles: tuple[str, ...] = ("q", "k", "v", "o"),
    rank: int = 8,
    alpha: int | None = None,
    dropout: float = 0.0,
    target_modules: list[str] | None = None,
    modules_to_save: list[str] | None = None,
) -> PeftModel:
    """Wrap ``model`` with a fresh LoRA adapter on its attention projections; ``modules_to_save``
    (module-name suffixes) are trained fully and saved whole in the adapter (PEFT's mechanism).

    When the fully trained modules are all the LoRA targets (SMT's full q/k), PEFT 0.21 still needs one
    LoRA target: a frozen rank-1 LoRA with B = 0 on one other linear layer hosts the config and changes
    nothing (``lora_host``)."""
    if rank <= 0:
        raise LcxError(f"LoRA rank must be > 0, got {rank}")
    modules = dict(model.named_modules())
    missing = [m for m in modules_to_save or [] if not any(n == m or n.endswith("." + m) for n in modules)]
    if missing:  # PEFT matches by name suffix and says nothing when nothing matches
        leaves = sorted({n.rsplit(".", 1)[-1] for n, mod in modules.items() if not list(mod.children())})
        raise LcxError(f"no module of the model is named {', '.join(map(repr, missing))} (modules to train fully); "
                       f"its module names end in: {', '.join(leaves)}")
    targets: list[str] | str = [t for t in (target_modules or lora_targets(model, roles))
                                if t not in (modules_to_save or [])]
    host = None
    if not targets:
        host = lora_host(model, modules_to_save or [])
        targets, rank = f"^{re.escape(host)}$", 1  # a str target is matched in full against module names
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        lora_dropout=dropout,
        target_modules=targets,
        modules_to_save=modules_to_save,
        task_type="CAUSAL_LM",
    )
    peft = get_peft_model(model, config)
    if host is not None:
        freeze_host(peft)
    return peft


def freeze_host(peft: PeftModel) -> None:
    """Keep ``add_adapter``'s inert LoRA host frozen (its B stays 0): needed again after every load that
    makes the adapter trainable (``lcx train --init-adapter``/``--resume`` of a ``--full`` adapter), where
    PEFT marks every LoRA parameter trainable.  The host is the only str (regex) target lcx writes."""
    config = peft.peft_config.get(peft.active_adapter)
    if config is not None and isinstance(config.target_modules, str) and config.modules_to_save:
        for name, p in peft.named_parameters():
            if ".lora_" in name:
                p.requires_grad_(False)


def lora_host(model: nn.Module, modules_to_save: list[str]) -> str:
    """The first decoder linear layer not trained fully: where ``add_adapter`` puts its inert LoRA."""
    from transformers.pytorch_utils import Conv1D  # gpt2's linear layers

    model = unwrap(model)
    fam = families.FAMILIES.get(getattr(model.config, "model_type", ""))
    inside = f"{fam.layers}." if fam is not None else None  # the decoder layers (gpt2: transformer.h)
    for name, module in model.named_modules():
        in_layers = name.startswith(inside) if inside else ".layers." in f".{name}"
        if isinstance(module, (nn.Linear, Conv1D)) and in_layers and \
                not any(name == m or name.endswith("." + m) for m in modules_to_save):
            return name
    raise LcxError(f"the fully trained modules {modules_to_save} cover every linear layer; train every weight "
                   f"with --full all")


def random_adapter(model: nn.Module, out_dir: str | os.PathLike, seed: int, scale: float = 0.05,
                   roles: tuple[str, ...] = ("q", "k"), rank: int = 8, methods: list[dict] | None = None,
                   **lora: Any) -> Path:
    """Save a LoRA adapter with seeded random A and B (B ~ N(0, scale^2)): a stand-in for a trained one in
    tests and benchmarks (an untrained adapter, B = 0, would change nothing).  Wraps ``model`` in place."""
    torch.manual_seed(seed)  # PEFT draws lora_A from the global generator
    peft = add_adapter(model, roles=roles, rank=rank, **lora)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return save_adapter(peft, out_dir, methods=methods if methods is not None else [{"name": "smt", "options": {}}])


def save_adapter(model: PeftModel, out_dir: str | os.PathLike, methods: list[dict], extra: dict | None = None) -> Path:
    """Write the PEFT adapter (safetensors) and the lcx sidecar into ``out_dir``, as one atomic update
    (a crash leaves the previous adapter, or the new one once committed; never a mix)."""
    sidecar = {"format": FORMAT_VERSION, "methods": methods, "base_model": base_identity(model), **(extra or {})}
    return _save(model, out_dir, sidecar)


def save_full_model(model: nn.Module, out_dir: str | os.PathLike, methods: list[dict], extra: dict | None = None,
                    tokenizer: Any = None) -> Path:
    """A fully trained model (``--full all``): a whole model folder (safetensors, the tokenizer it was trained
    with if any) + the lcx sidecar.  Load it as a model (``-m OUT``), not as an adapter."""
    return _save(model, out_dir, {"format": FORMAT_VERSION, "methods": methods, "full_model": True, **(extra or {})},
                 tokenizer)


def _save(model: nn.Module, out_dir: str | os.PathLike, sidecar: dict[str, Any], tokenizer: Any = None) -> Path:
    def write(d: Path) -> None:
        model.save_pretrained(str(d), safe_serialization=True)
        if tokenizer is not None:  # a model folder that reads text: `-m OUT` needs its tokenizer
            tokenizer.save_pretrained(str(d))
        (d / SIDECAR).write_text(json.dumps(sidecar, indent=2))

    return commit_files(out_dir, write)


def read_sidecar(adapter_dir: str | os.PathLike) -> dict[str, Any]:
    d = Path(adapter_dir)
    if not d.is_dir():
        raise LcxError(f"adapter folder {str(d)!r} does not exist; pass the folder `lcx train` wrote")
    recover(d)  # finish a save that a crash interrupted after its commit point
    path = d / SIDECAR
    if not path.exists():
        raise LcxError(f"{str(d)!r} has no {SIDECAR}: not an lcx adapter (PEFT-only adapters load with peft directly)")
    return read_json_file(path, "re-save the adapter (or train it again)")


def check_base(model: nn.Module, sidecar: dict[str, Any], adapter_dir: str | os.PathLike) -> None:
    """Refuse an adapter trained for another base model, naming the first field that differs."""
    want = sidecar.get("base_model") or {}
    have = base_identity(model)
    keys = ["model_type", "num_hidden_layers", "hidden_size", "vocab_size", "embedding_sha256"]
    if same_embeddings(want, have):
        keys.pop()  # also the same weights in another precision
    from lcx.models import dtype_name, model_dtype

    dtype = dtype_name(model_dtype(model))
    if "embedding_sha256" in keys and not want.get("embedding_bf16_sha256") and dtype != "float32":
        raise LcxError(f"adapter {str(adapter_dir)!r} records its base model's weights in float32 only (saved by an "
                       f"older lcx), and the model is loaded in {dtype}: load it with "
                       f"--dtype float32, or add the bf16 fingerprint by re-saving the adapter")
    for key in keys:
        if want.get(key) != have.get(key):
            raise LcxError(
                f"adapter {str(adapter_dir)!r} was trained for another base model "
                f"({key}: adapter {want.get(key)!r}, model {have.get(key)!r}; "
                f"adapter base {want.get('name_or_path')!r}); load it on that model"
            )


def load_adapter(model: nn.Module, adapter_dir: str | os.PathLike, trainable: bool = False) -> tuple[PeftModel, dict]:
    """Load an lcx adapter onto ``model``: checks the base model, loads safetensors only."""
    d = Path(adapter_dir)
    if not (d / ADAPTER_WEIGHTS).exists() and (d / "config.json").exists() and any(d.glob("model*.safetensors")):
        raise LcxError(f"{str(d)!r} is a whole model (e.g. from `lcx train --full all`), not an adapter; "
                       f"load it as the model: -m {d}")
    sidecar = read_sidecar(adapter_dir)
    if not (d / ADAPTER_WEIGHTS).exists():
        raise LcxError(
            f"{str(d)!r} has no {ADAPTER_WEIGHTS}; lcx loads adapters from safetensors only (never pickle)"
        )
    fix = "re-save the adapter (or train it again)"
    read_json_file(d / "adapter_config.json", fix)
    check_safetensors(d / ADAPTER_WEIGHTS, fix)
    check_base(model, sidecar, adapter_dir)
    try:
        peft_model = PeftModel.from_pretrained(model, str(d), is_trainable=trainable, use_safetensors=True)
    except Exception as e:  # safetensors header errors, shape mismatches
        raise LcxError(f"could not load adapter {str(d)!r}: {type(e).__name__}: {e}") from None
    if trainable:
        freeze_host(peft_model)
    peft_model.eval()
    return peft_model, sidecar


def trainable_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}
