"""Model provisioning and offline loading."""

from __future__ import annotations

import time

import pytest
import torch

from lcx.errors import LcxError
from lcx.models import KNOWN_MODELS, list_models, load_model, pull, resolve_model_path
from tests.helpers import make_tiny_model_dir


def test_local_folder_resolves_and_loads(tmp_path):
    d = make_tiny_model_dir(tmp_path / "m")
    assert resolve_model_path(str(d)) == d
    model, tok = load_model(str(d))
    assert not model.training and tok.padding_side == "left" and tok.pad_token is not None


def test_hub_names_fail_fast_without_network(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(LcxError, match="never downloads from a hub"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M")
    assert time.perf_counter() - t0 < 1.0


def test_folder_without_config_and_file_paths(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(LcxError, match="not a Hugging Face model folder"):
        resolve_model_path(str(tmp_path / "empty"))
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(LcxError, match="is a file"):
        resolve_model_path(str(tmp_path / "f.txt"))


def test_not_a_causal_lm_names_its_type(tmp_path):
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                         vocab_size=100)).save_pretrained(str(tmp_path / "bert"))
    with pytest.raises(LcxError, match="not a causal language model.*'bert'"):
        load_model(str(tmp_path / "bert"))


def test_unknown_and_unpulled_known_names(tmp_path, monkeypatch):
    monkeypatch.setenv("LCX_HOME", str(tmp_path))
    with pytest.raises(LcxError, match="smollm2-135m"):
        pull("no-such-model")
    with pytest.raises(LcxError, match="lcx models pull smollm2-135m"):
        resolve_model_path("smollm2-135m")
    rows = list_models()
    assert [r["name"] for r in rows] == list(KNOWN_MODELS) and not rows[0]["pulled"]


@pytest.mark.slow
def test_pull_smollm2_is_idempotent_and_the_model_answers():
    path = pull("smollm2-135m", log=lambda *_: None)  # the shared cache: converts only the first time
    cfg = (path / "config.json").read_text()
    assert '"model_type": "llama"' in cfg and '"num_hidden_layers": 30' in cfg and "quantization_config" not in cfg
    t0 = time.perf_counter()
    assert pull("smollm2-135m", log=lambda *_: None) == path
    assert time.perf_counter() - t0 < 5
    model, tok = load_model("smollm2-135m")
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
