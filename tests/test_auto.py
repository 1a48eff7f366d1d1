"""Options measured on the model itself (lcx.auto): fot's memory_layers=auto by retrieval analysis, measured once
per model, cached beside it, trusted only for the same model files and lcx version; an explicit option wins."""

from __future__ import annotations

import json

import pytest

import lcx
from lcx import auto
from lcx.models import load_model

from tests.helpers import make_tiny_model_dir


@pytest.fixture
def folder(tmp_path):
    return make_tiny_model_dir(tmp_path / "llama", max_position_embeddings=512)


@pytest.fixture
def probes(monkeypatch):
    """Retrieval analysis stubbed to find layer 1: returns the list of the lengths it was asked to probe."""
    import lcx.analyze

    calls: list[int] = []

    def fake(model, tokenizer, length, depths, keys, threshold=0.15, progress=True):
        calls.append(length)
        return {"suggested_memory_layers": "1", "suggested_memory_heads": "0:1,1:0"}

    monkeypatch.setattr(lcx.analyze, "retrieval_layers", fake)
    return calls


def fot_layers(folder) -> tuple[str, list[int]]:
    model, _ = load_model(str(folder))
    with lcx.attach(model, ["fot"]) as run:
        fot = run.method("fot")
        return fot.memory_layers, fot.layer_indices(run)


def test_auto_layers_are_measured_once_and_then_read_from_beside_the_model(folder, probes, capsys):
    assert fot_layers(folder) == ("1", [1])
    assert probes == [512]  # the probe stays inside the model's window
    entry = json.loads((folder / auto.AUTO_FILE).read_text())["entries"]["fot.memory_layers"]
    assert entry["value"] == "1" and entry["inputs"]["probe"] == "retrieval"
    assert "fot: memory layers 1 chosen by retrieval analysis (measured now" in capsys.readouterr().err
    auto._said.clear()
    assert fot_layers(folder) == ("1", [1])
    assert probes == [512]  # not measured again
    assert "(cached in" in capsys.readouterr().err


def test_auto_heads_come_from_the_same_analysis_and_keep_to_the_memory_layers(folder, probes, capsys):
    model, _ = load_model(str(folder))
    with lcx.attach(model, ["fot"], fot={"memory_heads": "auto"}) as run:
        fot = run.method("fot")
        assert (fot.memory_layers, fot.memory_heads) == ("1", "1:0")  # 0:1 is outside memory layer 1
        assert fot.head_mask(model.config, 1, "cpu").tolist() == [True, False]
        options = fot.to_options()
    assert probes == [512]  # one analysis for both options
    entries = json.loads((folder / auto.AUTO_FILE).read_text())["entries"]
    assert entries["fot.memory_heads"]["value"] == "0:1,1:0"  # the analysis as measured; the layers filter it
    assert "fot: memory heads 0:1,1:0 chosen by retrieval analysis" in capsys.readouterr().err
    with lcx.attach(model, ["fot"], fot=options) as run:  # what exports and result files record stands alone
        assert run.method("fot").head_mask(model.config, 1, "cpu").tolist() == [True, False]
    with lcx.attach(model, ["fot"], fot={"memory_heads": "auto", "memory_layers": "all"}) as run:
        assert run.method("fot").head_mask(model.config, 0, "cpu").tolist() == [False, True]
    assert probes == [512]  # cached


@pytest.mark.parametrize("layers, heads, note", [
    ("0,1", "0:1,1:0", None),
    ("0,1", "1:0", "memory layers 0 have no retrieving head: their memory is kept but not read"),
    ("0", "1:0", "no retrieving head (1:0) is in a memory layer (0); every head reads memory"),
])
def test_auto_heads_outside_every_memory_layer_leave_every_head_reading(folder, monkeypatch, capsys, layers, heads,
                                                                        note):
    import lcx.analyze

    monkeypatch.setattr(lcx.analyze, "retrieval_layers", lambda *a, **k: {"suggested_memory_layers": "1",
                                                                          "suggested_memory_heads": heads})
    model, _ = load_model(str(folder))
    with lcx.attach(model, ["fot"], fot={"memory_heads": "auto", "memory_layers": layers}) as run:
        mask = run.method("fot").head_mask(model.config, 0, "cpu")
    err = capsys.readouterr().err
    if layers == "0":
        assert mask is None and note in err  # every head of layer 0
    else:
        assert mask.tolist() == [False, "0:1" in heads]
        assert (note in err) if note else ("have no retrieving head" not in err)


def test_an_explicit_option_wins_and_nothing_is_measured(folder, probes):
    model, _ = load_model(str(folder))
    with lcx.attach(model, ["fot"], fot={"memory_layers": "0"}) as run:
        assert run.method("fot").layer_indices(run) == [0]
    assert probes == [] and not (folder / auto.AUTO_FILE).exists()


def test_the_real_analysis_runs_and_falls_back_to_the_depth_rule_when_no_layer_retrieves(folder):
    layers, used = fot_layers(folder)  # a random tiny model: no head puts 15% of its attention on the needle
    value = json.loads((folder / auto.AUTO_FILE).read_text())["entries"]["fot.memory_layers"]["value"]
    assert (layers, used) == ((value, [int(x) for x in value.split(",")]) if value else ("auto", [0, 1]))


@pytest.mark.parametrize("damage, said", [
    (lambda p: p.write_text("{not json"), "is damaged"),
    (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "lcx": "0.0.1"})), "measured by lcx 0.0.1"),
    (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "model": {"config_sha256": "0" * 64,
                                                                                "weights": {}}})), "other model files"),
])
def test_a_damaged_or_foreign_cache_is_measured_again_with_a_note(folder, probes, capsys, damage, said):
    fot_layers(folder)
    path = folder / auto.AUTO_FILE
    damage(path)
    auto._said.clear()
    capsys.readouterr()
    assert fot_layers(folder) == ("1", [1])
    assert len(probes) == 2
    assert said in capsys.readouterr().err
    assert json.loads(path.read_text())["lcx"] == lcx.__version__  # rewritten sound


def test_a_cache_of_other_weights_is_not_trusted(folder, probes):
    fot_layers(folder)
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes() + b"\0" * 8)
    assert auto._read(folder / auto.AUTO_FILE, auto.identity(folder), lambda s: None) == {}


def test_a_read_only_model_folder_caches_under_lcx_home(folder, probes, tmp_path, monkeypatch):
    import os

    if os.geteuid() == 0:  # root writes anywhere: stand in for a read-only folder
        monkeypatch.setattr(auto.os, "access", lambda p, mode: False)
    else:
        folder.chmod(0o555)
    monkeypatch.setenv("LCX_HOME", str(tmp_path / "home"))
    assert fot_layers(folder) == ("1", [1])
    assert not (folder / auto.AUTO_FILE).exists()
    assert len(list((tmp_path / "home" / "auto").glob("*.json"))) == 1


def test_a_model_with_sliding_window_layers_keeps_its_full_attention_layers_unmeasured(tmp_path, probes):
    folder = make_tiny_model_dir(tmp_path / "gemma", family="gemma3_text", max_position_embeddings=512)
    assert fot_layers(folder) == ("auto", [1])
    assert probes == []


def test_a_model_built_in_memory_keeps_the_depth_rule(llama, probes):
    with lcx.attach(llama, ["fot"]) as run:
        assert run.method("fot").layer_indices(run) == [0, 1]
    assert probes == []


def test_an_export_for_vllm_serves_the_layers_lcx_generate_measured(folder, probes, tmp_path):
    """The served form reads the options lcx's own path uses: `lcx export` resolves auto the same way (here from
    the cache an earlier attach left), writes the measured layers, and leaves the cache out of the export."""
    from lcx.integrations.vllm.export import export_for_vllm

    assert fot_layers(folder) == ("1", [1])
    exp = export_for_vllm(str(folder), ["fot"], out=tmp_path / "x")
    described = json.loads((exp.model_dir / "lcx.json").read_text())["methods"]
    assert described[0]["options"]["memory_layers"] == "1"
    assert probes == [512]  # measured once, by the attach
    assert not (exp.model_dir / auto.AUTO_FILE).exists()


def test_lcx_methods_on_a_model_shows_what_auto_comes_to_there(folder, probes, tmp_path):
    from click.testing import CliRunner

    from lcx.cli import main

    def on(path) -> dict:
        r = CliRunner().invoke(main, ["methods", "-m", str(path), "--json"])
        assert r.exit_code == 0, r.output
        return {m["name"]: m["on_model"] for m in json.loads(r.stdout)["methods"]}

    llama = on(folder)
    assert llama["fot"] == {"memory_layers": "1", "local": 512} and probes == [512]  # measured, then cached beside it
    assert llama["vanilla"] == {"window": 512}
    assert "streaming.chunk=" in llama["streaming"]["error"]  # its default chunk (512) fills this window: said, listed
    assert "512" in llama["rope"]["factor"] and llama["smt"] == {}
    gemma = make_tiny_model_dir(tmp_path / "gemma", family="gemma3_text", max_position_embeddings=512)
    assert on(gemma)["fot"] == {"memory_layers": "1", "local": 512} and probes == [512]  # its full-attention layer
