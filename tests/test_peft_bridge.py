"""PEFT bridge: standard LoRA adapter + lcx sidecar; base-model check; safetensors only."""

from __future__ import annotations

import json

import pytest
import torch

import lcx
from lcx.adapters import peft_bridge
from tests.conftest import tiny_model


def _trained_adapter(model):
    peft_model = peft_bridge.add_adapter(model, roles=("q", "k", "v", "o"), rank=4)
    with torch.no_grad():  # stand-in for training: make the adapter non-trivial
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return peft_model


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "phi3"])
def test_save_load_roundtrip_identical_logits(tmp_path, family):
    ids = torch.randint(3, 256, (1, 20))
    peft_model = _trained_adapter(tiny_model(family))
    assert all("lora" in n for n in peft_bridge.trainable_parameters(peft_model))
    ref = peft_model(ids).logits
    peft_bridge.save_adapter(peft_model, tmp_path, methods=[{"name": "vanilla", "options": {}}])
    assert (tmp_path / "adapter_config.json").exists() and (tmp_path / "adapter_model.safetensors").exists()
    side = json.loads((tmp_path / "lcx.json").read_text())
    assert side["methods"][0]["name"] == "vanilla" and side["base_model"]["model_type"] == family

    loaded, sidecar = peft_bridge.load_adapter(tiny_model(family), tmp_path)
    torch.testing.assert_close(loaded(ids).logits, ref, atol=0, rtol=0)
    with lcx.attach(loaded, ["vanilla"]) as run:  # attaching to a PeftModel reaches the model inside
        torch.testing.assert_close(run.model(ids).logits, ref, atol=1e-5, rtol=0)


def test_adapter_for_another_base_is_refused(tmp_path):
    peft_bridge.save_adapter(_trained_adapter(tiny_model("llama", seed=0)), tmp_path, methods=[])
    with pytest.raises(lcx.LcxError, match="trained for another base model.*embedding_sha256"):
        peft_bridge.load_adapter(tiny_model("llama", seed=1), tmp_path)
    with pytest.raises(lcx.LcxError, match="model_type"):
        peft_bridge.load_adapter(tiny_model("qwen2", seed=0), tmp_path)
    peft_bridge.load_adapter(tiny_model("llama", seed=0).to(torch.bfloat16), tmp_path)  # same weights, bf16: loads
    with pytest.raises(lcx.LcxError, match="embedding_sha256"):
        peft_bridge.load_adapter(tiny_model("llama", seed=1).to(torch.bfloat16), tmp_path)


def test_pickle_weights_and_broken_sidecar_are_refused(tmp_path):
    peft_bridge.save_adapter(_trained_adapter(tiny_model("llama")), tmp_path, methods=[])
    (tmp_path / "adapter_model.safetensors").rename(tmp_path / "adapter_model.bin")
    with pytest.raises(lcx.LcxError, match="safetensors only"):
        peft_bridge.load_adapter(tiny_model("llama"), tmp_path)
    (tmp_path / "lcx.json").write_text("{not json")
    with pytest.raises(lcx.LcxError, match="corrupted"):
        peft_bridge.load_adapter(tiny_model("llama"), tmp_path)
    with pytest.raises(lcx.LcxError, match="does not exist"):
        peft_bridge.load_adapter(tiny_model("llama"), tmp_path / "nothing")
    (tmp_path / "lcx.json").unlink()
    with pytest.raises(lcx.LcxError, match="not an lcx adapter"):
        peft_bridge.load_adapter(tiny_model("llama"), tmp_path)


def test_truncated_weights_give_a_clear_error(tmp_path):
    peft_bridge.save_adapter(_trained_adapter(tiny_model("llama")), tmp_path, methods=[])
    w = tmp_path / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(lcx.LcxError, match="adapter_model.safetensors. is corrupted or truncated"):
        peft_bridge.load_adapter(tiny_model("llama"), tmp_path)


def test_named_methods_keep_what_the_adapters_training_fixed_and_route_flat_options(tmp_path):
    """`--adapter A --method fot`: the options fot's training fixed (positions) stay the adapter's (they fell back
    to the default, a mode the memory keys were not trained in), the others are the user's; a flat option with
    several methods goes to the method that has it (it was refused with an adapter, accepted without)."""
    from lcx.session import apply_adapter

    adapter = peft_bridge.random_adapter(tiny_model("llama"), tmp_path / "a", seed=1,
                                         methods=[{"name": "fot", "options": {"positions": "none", "local": 16}}])
    _, _, methods, options = apply_adapter(tiny_model("llama"), adapter, ["fot"], {})
    # local: the default, as documented for named methods; fixed_distance: the sidecar lacks it, so FoT's own
    assert options["fot"] == {"positions": "none", "fixed_distance": 0}
    _, _, methods, options = apply_adapter(tiny_model("llama"), adapter, ["rope", "fot"], {"k": 8, "factor": 2.0})
    assert options["fot"] == {"positions": "none", "fixed_distance": 0, "k": 8} and options["rope"] == {"factor": 2.0}
    with pytest.raises(lcx.LcxError, match="trained with fot positions=none; positions=first is incompatible"):
        apply_adapter(tiny_model("llama"), adapter, ["fot"], {"positions": "first"})


def test_an_adapters_record_of_an_option_training_never_reads_is_not_applied(tmp_path):
    """focusllm's training draws its chunk sizes from train_chunks: the chunk an adapter's sidecar recorded (the
    default of its day) is dropped, so today's default (auto) or the user's -o applies, unless lcx train was given
    it; what training read (fragment, train_chunks) stays the adapter's."""
    from lcx.session import adapter_methods, apply_adapter, trained_methods

    recorded = {"chunk": 2048, "fragment": 64, "train_chunks": "64,128"}
    adapter = peft_bridge.random_adapter(tiny_model("llama"), tmp_path / "a", seed=1,
                                         methods=[{"name": "focusllm", "options": recorded}])
    sidecar = peft_bridge.read_sidecar(adapter)
    assert sidecar["methods"][0]["options"]["chunk"] == 2048  # recorded, as old adapters did
    assert "chunk" not in trained_methods(sidecar)["focusllm"]  # nor brought back as the option's `before` value
    assert adapter_methods(sidecar) == [{"name": "focusllm", "options": {"fragment": 64, "train_chunks": "64,128"}}]
    _, _, methods, options = apply_adapter(tiny_model("llama"), adapter, [], {})
    assert methods == ["focusllm"] and options["focusllm"]["fragment"] == 64 and "chunk" not in options["focusllm"]
    with lcx.attach(tiny_model("llama"), methods, **options) as run:
        assert run.methods[0].chunk == "auto"
    _, _, _, options = apply_adapter(tiny_model("llama"), adapter, [], {"chunk": 512})
    assert options["focusllm"]["chunk"] == 512
    for given in ({"focusllm": {"chunk": "2048"}}, {"chunk": "2048"}):  # given to lcx train (-o focusllm.chunk, -o chunk)
        sidecar["training"] = {"options": given}
        assert trained_methods(sidecar)["focusllm"]["chunk"] == 2048


def test_a_full_adapter_loaded_trainable_keeps_its_lora_host_frozen(tmp_path):
    """A --full q/k adapter (SMT's full training) hosts PEFT's config in an inert rank-1 LoRA that must never
    train: loaded as trainable (lcx train --init-adapter / --resume), only the fully trained modules are
    (PEFT marked the host's LoRA trainable too, and its B moved off 0 at the first step)."""
    peft_model = peft_bridge.add_adapter(tiny_model("llama"), roles=("q", "k"), modules_to_save=["q_proj", "k_proj"])
    assert not any(".lora_" in n for n in peft_bridge.trainable_parameters(peft_model))
    peft_bridge.save_adapter(peft_model, tmp_path, methods=[{"name": "smt", "options": {}}])
    loaded, _ = peft_bridge.load_adapter(tiny_model("llama"), tmp_path, trainable=True)
    names = list(peft_bridge.trainable_parameters(loaded))
    assert names and all(("q_proj" in n or "k_proj" in n) and ".lora_" not in n for n in names), names


def test_a_q_k_lora_on_a_fused_qkv_family_says_it_adapts_v_too():
    """phi3/gpt2/gpt_neox compute q, k and v in one projection: SMT's q/k LoRA there adapts v as well, said in
    a warning (LoRA on the fused projection is still what PEFT can do); q/k/v together or llama's: silent."""
    import warnings

    with pytest.warns(UserWarning, match="phi3 computes q, k and v in one projection .*adapts all three"):
        peft_bridge.lora_targets(tiny_model("phi3"), ("q", "k"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        peft_bridge.lora_targets(tiny_model("phi3"), ("q", "k", "v", "o"))
        peft_bridge.lora_targets(tiny_model("llama"), ("q", "k"))


def test_full_training_of_gpt2s_fused_attention_finds_a_lora_host():
    """gpt2's decoder layers (transformer.h) hold Conv1D layers, not nn.Linear under `.layers.`: --full c_attn was
    refused as covering every linear layer.  Now the inert host sits on another of its Conv1D layers."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's fan_in_fan_out note for Conv1D
        peft_model = peft_bridge.add_adapter(tiny_model("gpt2"), roles=("q", "k", "v"), modules_to_save=["c_attn"])
    names = list(peft_bridge.trainable_parameters(peft_model))
    assert names and all(".c_attn.modules_to_save." in n for n in names), names
