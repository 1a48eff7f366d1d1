"""rope: scaled rotary embeddings through transformers' own initialisers, restored on detach."""

from __future__ import annotations

import pytest
import torch

import lcx
from tests.conftest import tiny_model


@pytest.mark.parametrize("kind", ["linear", "yarn", "ntk", "dynamic"])
def test_rope_swaps_rotary_and_detach_restores(kind):
    model = tiny_model("llama")
    rot = model.model.rotary_emb
    with lcx.attach(model, ["rope"], type=kind, factor=4.0):
        new = model.model.rotary_emb
        assert new is not rot
        if kind == "ntk":
            assert new.config.rope_parameters["rope_theta"] > rot.config.rope_parameters["rope_theta"]
        elif kind != "dynamic":
            assert new.config.rope_parameters["rope_type"] == kind
            assert not torch.allclose(new.inv_freq, rot.inv_freq) or kind == "yarn"
    assert model.model.rotary_emb is rot
    assert model.config.rope_parameters == rot.config.rope_parameters


def test_linear_interpolation_divides_positions():
    """Linear PI at factor 4: position 4p under rope equals position p without it."""
    model = tiny_model("llama")
    x = torch.zeros(1, 1, 1)
    cos_ref, _ = model.model.rotary_emb(x, torch.tensor([[3]]))
    with lcx.attach(model, ["rope"], type="linear", factor=4.0):
        cos_new, _ = model.model.rotary_emb(x, torch.tensor([[12]]))
    torch.testing.assert_close(cos_new, cos_ref)


def test_rope_rejects_bad_factor():
    with pytest.raises(lcx.LcxError, match="factor"):
        lcx.attach(tiny_model("llama"), ["rope"], factor=0.5)


def test_the_served_config_stretches_rope_as_lcx_does_for_a_legacy_llama3_config():
    """A Llama 3.x config.json: legacy `rope_scaling` (llama3, original 64) under max_position_embeddings 128.
    lcx's path stretches from the original 64; the served config stretched from 128 and, read through
    `rope_parameters` beside a `rope_scaling` that loaders take first, lost it."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from lcx.plugins.rope import Rope

    from tests.conftest import TINY_FAMILIES

    legacy = {**TINY_FAMILIES["llama"], "model_type": "llama", "rope_theta": 10000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64}}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**legacy)).eval()
    with lcx.attach(model, ["rope"], type="yarn", factor=4.0) as run:
        assert run.window == 64
        lcx_inv = model.model.rotary_emb.inv_freq.clone()
        lcx_params = dict(model.model.rotary_emb.config.rope_parameters)
    served = Rope(type="yarn", factor=4.0).vllm_config(json.loads(json.dumps(legacy)))
    assert "rope_scaling" not in served and served["rope_parameters"] == lcx_params
    assert lcx_params["original_max_position_embeddings"] == 64
    loaded = AutoConfig.for_model(**{k: v for k, v in served.items()})  # as a loader reads the written config
    assert torch.equal(LlamaRotaryEmbedding(config=loaded).inv_freq, lcx_inv)
