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
