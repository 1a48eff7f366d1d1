"""Shared fixtures: tiny random models per family, and plugin registration helpers."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite compares paths token for token against float32 references; bf16 has its own tests (test_bf16, test_dtype).
os.environ.setdefault("LCX_DTYPE", "float32")
warnings.filterwarnings("ignore", message=".*must be `None` or an integer within the vocabulary.*")

VOCAB = 256

#: Tiny configs per family: 2 layers, small hidden, head_dim 32 (vLLM-compatible), GQA where the family has it.
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)
TINY_FAMILIES: dict[str, dict] = {
    "llama": dict(_COMMON),
    "mistral": dict(_COMMON, sliding_window=None),
    "qwen2": dict(_COMMON),
    "qwen3": dict(_COMMON),
    "gemma2": dict(_COMMON, sliding_window=64, query_pre_attn_scalar=32,
                   layer_types=["sliding_attention", "full_attention"]),
    "gemma3_text": dict(_COMMON, sliding_window=64, query_pre_attn_scalar=32,
                        layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(_COMMON, original_max_position_embeddings=128),
    "gpt2": dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, n_positions=128, bos_token_id=1, eos_token_id=2),
    "gpt_neox": dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, max_position_embeddings=128, rotary_pct=0.5,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0),
}


def tiny_model(family: str, seed: int = 0, **overrides):
    """A random-initialised fp32 model of ``family`` in eval mode (sdpa attention)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, **{**TINY_FAMILIES[family], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=overrides.pop("attn_implementation", "sdpa"))
    return model.eval()


@pytest.fixture(params=sorted(TINY_FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture
def llama():
    return tiny_model("llama")


@pytest.fixture
def isolated_registry(monkeypatch):
    """A fresh process-wide registry with entry-point autoloading off; restored afterwards."""
    from lcx import registry as reg

    monkeypatch.setenv(reg.ALLOWLIST_ENV, "")
    saved = reg._REGISTRY
    reg._REGISTRY = reg.Registry(load_entrypoints=False)
    try:
        yield reg._REGISTRY
    finally:
        reg._REGISTRY = saved


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray of 2 CPUs shared by a module's tests, shut down after them."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
