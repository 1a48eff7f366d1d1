"""rope: scaled rotary embeddings through transformers' own initialisers, restored on detach."""

from __future__ import annotations

import json

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


def test_the_served_config_stretches_rope_as_lcx_does_for_a_legacy_scaled_config():
    """A config.json with a legacy `rope_scaling` (yarn x2 from an original 64, under max_position_embeddings 128,
    written with the old `type` key): lcx's path stretches that yarn by 4 more (factor 8 from the original 64),
    and the served config says the same, without `rope_scaling` (loaders take it over `rope_parameters`) and
    without the legacy `type` beside `rope_type` (vLLM refuses the pair as conflicting)."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from lcx.plugins.rope import Rope

    from tests.conftest import TINY_FAMILIES

    legacy = {**TINY_FAMILIES["llama"], "model_type": "llama", "rope_theta": 10000.0, "max_position_embeddings": 128,
              "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**legacy)).eval()
    with lcx.attach(model, ["rope"], type="yarn", factor=4.0) as run:
        assert run.window == 64
        lcx_inv = model.model.rotary_emb.inv_freq.clone()
        lcx_params = dict(model.model.rotary_emb.config.rope_parameters)
    assert lcx_params["rope_type"] == "yarn" and lcx_params["factor"] == 8.0
    assert lcx_params["original_max_position_embeddings"] == 64 and "type" not in lcx_params
    served = Rope(type="yarn", factor=4.0).vllm_config(json.loads(json.dumps(legacy)))
    assert "rope_scaling" not in served and served["rope_parameters"] == lcx_params
    loaded = AutoConfig.for_model(**{k: v for k, v in served.items()})  # as a loader reads the written config
    assert torch.equal(LlamaRotaryEmbedding(config=loaded).inv_freq, lcx_inv)


def test_rope_stretches_a_scaled_rope_of_its_type_further_and_refuses_to_replace_another():
    """A model trained with linear x2: rope linear x4 makes it linear x8 (positions 8p read as p did unscaled);
    rope yarn would replace the linear scaling, and any rope would replace Llama 3.1's llama3 scaling (shrinking
    what such a model reads): both refused, naming the scaling and the way out."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.conftest import TINY_FAMILIES

    def model_with(scaling):
        cfg = {**TINY_FAMILIES["llama"], "model_type": "llama", "rope_theta": 10000.0, "rope_scaling": scaling}
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).eval()

    plain, x = tiny_model("llama"), torch.zeros(1, 1, 1)
    cos_ref, _ = plain.model.rotary_emb(x, torch.tensor([[3]]))
    model = model_with({"rope_type": "linear", "factor": 2.0})
    with lcx.attach(model, ["rope"], type="linear", factor=4.0):
        cos_new, _ = model.model.rotary_emb(x, torch.tensor([[24]]))
    torch.testing.assert_close(cos_new, cos_ref)
    with pytest.raises(lcx.LcxError, match=r"already scaled \(linear, factor 2.0\).*rope.type=linear"):
        lcx.attach(model, ["rope"], type="yarn", factor=4.0)
    llama3 = model_with({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})
    with pytest.raises(lcx.LcxError, match=r"already scaled \(llama3, factor 8.0\).*without rope"):
        lcx.attach(llama3, ["rope"], type="yarn", factor=4.0)
    assert llama3.model.rotary_emb.config.rope_parameters["rope_type"] == "llama3"  # nothing left attached


def test_rope_on_phi3_is_refused_for_vllm_with_the_reason():
    """vLLM validates a phi3 config's rope as longrope (short and long factors) and fails on yarn or linear
    with a KeyError in its engine; the export refuses it first."""
    from lcx.plugins.rope import Rope

    from tests.conftest import TINY_FAMILIES

    with pytest.raises(lcx.LcxError, match="phi3.*longrope"):
        Rope(type="yarn", factor=4.0).vllm_config({**TINY_FAMILIES["phi3"], "model_type": "phi3"})


def test_factor_auto_stretches_by_each_requests_length():
    """rope.factor=auto: inside the window the model's own rotary embedding reads the prompt (the bare logits);
    past it, the factor is the request's length / the window in quarter steps, and the logits are those of that
    factor given as a number; detach puts the model's own embedding back."""
    from lcx.generation import tail_logits

    model = tiny_model("llama", max_position_embeddings=64)
    rot, ids = model.model.rotary_emb, torch.randint(0, 100, (1, 150))
    with lcx.attach(model, []) as run:
        bare = tail_logits(run, ids[:, :60], 8)
    with lcx.attach(model, ["rope"], factor="auto") as run:
        torch.testing.assert_close(tail_logits(run, ids[:, :60], 8), bare, rtol=0, atol=0)
        assert model.model.rotary_emb is rot
        auto = tail_logits(run, ids, 8)  # 150 tokens over a 64-token window: 2.34 -> 2.5
        assert model.model.rotary_emb.config.rope_parameters["factor"] == 2.5
        assert run.methods[0].reach(run, 150, 0, (0, 1))[1].startswith("positions stretched x2.5")
        assert run.methods[0].request_options() == {"factor": 2.5}  # lcx generate --json says which
        torch.testing.assert_close(tail_logits(run, ids[:, :60], 8), bare, rtol=0, atol=0)  # back to x1
    assert model.model.rotary_emb is rot
    with lcx.attach(model, ["rope"], factor=2.5) as run:
        torch.testing.assert_close(tail_logits(run, ids, 8), auto, rtol=0, atol=0)


def test_factor_auto_is_fixed_by_the_longest_request_where_one_factor_must_hold(tmp_path):
    """vLLM serves one rope for every request: --max-model-len fixes the factor (written as a number beside
    the export), and without it the export is refused naming both fixes (lcx train's --seq-len: test_smt).
    A word other than auto is refused as an option value; so is a model's rope auto could not stretch."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lcx.integrations.vllm import export_for_vllm
    from lcx.plugins.rope import Rope

    from tests.conftest import TINY_FAMILIES
    from tests.helpers import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "llama", max_position_embeddings=64)
    exp = export_for_vllm(str(model_dir), ["rope"], out=tmp_path / "x", max_model_len=150)
    assert exp.methods[0]["options"]["factor"] == 2.5 and exp.max_model_len == 150
    baked = json.loads((exp.model_dir / "config.json").read_text())
    assert baked["rope_parameters"]["factor"] == 2.5
    with pytest.raises(lcx.LcxError, match=r"factor=auto.*--max-model-len N.*-o rope.factor=F"):
        export_for_vllm(str(model_dir), ["rope"], out=tmp_path / "y")
    assert not (tmp_path / "y").exists()
    with pytest.raises(lcx.LcxError, match=r"factor=auto.*--max-model-len N"):
        Rope.from_options(factor="auto").check_serving()
    with pytest.raises(lcx.LcxError, match=r"factor must be a number >= 1 or auto, got 'most'"):
        Rope.from_options(factor="most")
    assert Rope.from_options(factor="2").factor == 2.0
    cfg = {**TINY_FAMILIES["llama"], "model_type": "llama", "rope_theta": 10000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 64}}
    llama3 = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).eval()
    with pytest.raises(lcx.LcxError, match=r"already scaled \(llama3"):
        lcx.attach(llama3, ["rope"], factor="auto")
