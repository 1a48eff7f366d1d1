"""Token-gated LoRA (FocusLLM's candidate projections): the delta applies exactly where the gate is open."""

from __future__ import annotations

import pytest
import torch

from lcx.adapters.gated_lora import TokenGate, gate_lora
from lcx.adapters.peft_bridge import add_adapter
from lcx.errors import LcxError
from tests.conftest import tiny_model


def _models(trained: bool = True):
    base = tiny_model("llama")
    peft = add_adapter(tiny_model("llama"), roles=("q", "k", "v", "o"), rank=4)
    if trained:  # a non-zero delta, as after training
        torch.manual_seed(1)
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.data.normal_(0, 0.5)
    return base, peft.eval()


def _ids(t=12):
    return torch.randint(3, 256, (2, t), generator=torch.Generator().manual_seed(0))


def test_the_delta_applies_only_where_the_gate_is_open():
    base, peft = _models()
    gate = TokenGate()
    gate_lora(peft, gate)
    ids = _ids()
    with torch.no_grad():
        plain = base(ids).logits
        lora = peft(ids).logits  # outside `only`: ordinary LoRA everywhere
        mask = torch.zeros(2, 12)
        mask[:, -1] = 1  # the candidate position of FocusLLM: the last one
        with gate.only(mask):
            gated = peft(ids).logits
    assert not torch.allclose(lora, plain, atol=1e-3)
    assert torch.allclose(gated[:, :-1], plain[:, :-1], atol=1e-5)  # every other token: the base weights
    # the last token: the adapter's projections over the base model's keys/values of the tokens before it
    # (FocusLLM's candidate) = the ungated adapter model continuing from the base model's cache
    with torch.no_grad():
        cache = base(ids[:, :-1], use_cache=True).past_key_values
        ref = peft(ids[:, -1:], past_key_values=cache).logits[:, -1]
    assert torch.allclose(gated[:, -1], ref, atol=1e-5) and not torch.allclose(gated[:, -1], lora[:, -1], atol=1e-3)
    with gate.only(torch.zeros(2, 12)), torch.no_grad():
        assert torch.allclose(peft(ids).logits, plain, atol=1e-5)  # closed everywhere: the base model


def test_an_untrained_adapter_equals_the_base_weights_even_where_open():
    base, peft = _models(trained=False)
    gate = TokenGate()
    gate_lora(peft, gate)
    with gate.only(torch.ones(2, 12)), torch.no_grad():
        assert torch.allclose(peft(_ids()).logits, base(_ids()).logits, atol=1e-6)


def test_gradients_reach_the_adapter_only_through_open_tokens():
    _, peft = _models()
    gate = TokenGate()
    gate_lora(peft, gate)
    mask = torch.zeros(2, 12)
    mask[:, -1] = 1
    with gate.only(mask):
        peft(_ids()).logits[:, :-1].sum().backward()  # a loss on the gated-off tokens only
    grads = [p.grad for n, p in peft.named_parameters() if "lora_" in n]
    assert grads and all(g is None or float(g.abs().sum()) == 0 for g in grads)
    assert all(not p.requires_grad for n, p in peft.named_parameters() if "lora_" not in n)  # base stays frozen


def test_bad_gates_and_models_are_refused():
    _, peft = _models()
    gate = TokenGate()
    handles = gate_lora(peft, gate)
    with pytest.raises(LcxError, match=r"token gate of shape \(2, 5\) does not match a LoRA delta of \(2, 12\)"):
        with gate.only(torch.ones(2, 5)), torch.no_grad():
            peft(_ids())
    with pytest.raises(LcxError, match="needs a \\(batch, tokens\\) mask"):
        with gate.only(torch.ones(12)):
            pass
    for h in handles:
        h.remove()
    with pytest.raises(LcxError, match="no LoRA layer of adapter 'default'"):
        gate_lora(tiny_model("llama"), gate)
