"""How a benchmark gets its model: the real weights, or the architecture with random weights (speed only),
on the CPU or an accelerator (``--device``)."""

from __future__ import annotations

import torch


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bench_model(name: str, device: str | None = None, random_weights: bool = False, dtype: str = "float32"):
    """(model in eval mode on ``device``, tokenizer).  ``random_weights``: ``name``'s architecture from its
    config.json with random weights (a speed measurement does not depend on them), for a machine that
    has the config and tokenizer but not the weights.  ``dtype``: a name in ``DTYPES``."""
    from lcx.models import load_model, resolve_device, resolve_model_path

    if dtype not in DTYPES:
        raise SystemExit(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if not random_weights:
        return load_model(name, device=device, dtype=DTYPES[dtype])
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)), dtype=DTYPES[dtype],
                                             attn_implementation="sdpa")
    return model.to(resolve_device(device)).eval(), AutoTokenizer.from_pretrained(str(path))


def _on_cuda(model) -> bool:
    from lcx.generation import model_device

    return model_device(model).type == "cuda"


def device_name(model) -> str:
    from lcx.generation import model_device

    return torch.cuda.get_device_name(model_device(model)) if _on_cuda(model) else "cpu"


def sync(model) -> None:
    """Wait for the model's device (CUDA kernels run asynchronously: time the work, not its launch)."""
    from lcx.generation import model_device

    sync_device(model_device(model))


def sync_device(device: torch.device) -> None:
    """``sync`` for a device: wait for its queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_gpu_peak(model) -> None:
    """Start counting the peak GPU memory (``gpu_peak``) here, when the model is on a GPU."""
    if _on_cuda(model):
        torch.cuda.reset_peak_memory_stats()


def gpu_peak(model) -> dict:
    """``{"peak_gpu_mib": ...}`` since ``reset_gpu_peak`` on a GPU; nothing on the CPU."""
    return {"peak_gpu_mib": round(torch.cuda.max_memory_allocated() / 2**20)} if _on_cuda(model) else {}
