"""Untrusted files: lcx's own formats are safetensors + JSON only, remote code runs only when asked,
and a corrupted or truncated file of each kind gives a clear error naming that file."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch

from lcx.adapters.peft_bridge import load_adapter
from lcx.errors import LcxError
from lcx.plugins.fot.memory import load_memory, make_store, save_memory
from lcx.models import load_model
from lcx.train import TrainConfig, train
from tests.helpers import make_tiny_model_dir

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("sdk", "plugins", "adapters", "integrations")


# ---------------------------------------------------------------------- no pickle
#: Modules and calls that unpickle (or pickle) objects.
PICKLE_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
PICKLE_CALLS = {("torch", "load"), ("torch", "save"), ("np", "load"), ("numpy", "load")}


def _pickle_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in PICKLE_CALLS or node.attr in ("from_pickle", "read_pickle", "to_pickle"):
                found.append(f"{node.value.id}.{node.attr}")
    return [f"{path.relative_to(REPO)}:{f}" for f in found]


def test_lcx_source_never_pickles():
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    assert len(files) > 20
    uses = [u for p in files for u in _pickle_uses(p)]
    assert not uses, f"pickle in lcx: {uses}"


def test_the_scan_finds_pickle(tmp_path):  # the scan itself can fail
    bad = REPO / "sdk" / "_scan_probe.py"
    try:
        bad.write_text("import torch\nimport pickle\nx = torch.load('a.pt')\n")
        assert _pickle_uses(bad) == ["sdk/_scan_probe.py:import pickle", "sdk/_scan_probe.py:torch.load"]
    finally:
        bad.unlink()


# ---------------------------------------------------------------------- what lcx writes
@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A model folder, a finished training run with checkpoints, and a memory, as lcx writes them."""
    root = tmp_path_factory.mktemp("written")
    model = make_tiny_model_dir(root / "model")
    (root / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 60)
    cfg = TrainConfig(model=str(model), data=[str(root / "corpus.txt")], out=str(root / "run"), seq_len=32, steps=6,
                      save_every=2, keep_checkpoints=5)
    train(cfg, progress=False)
    store = make_store(kind="torch")
    store.add(torch.randn(10, 8), torch.randn(10, 8), torch.arange(10))
    save_memory({(0, 0): store}, root / "memory", {})
    return root


def test_everything_lcx_writes_is_safetensors_or_json(written):
    pickle_magic = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"PK\x03\x04")  # pickle, torch.save zip
    files = [p for d in ("run", "memory") for p in (written / d).rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files) and any(p.parent.name.startswith("step-") for p in files)
    for p in files:
        assert p.suffix in (".safetensors", ".json", ".jsonl", ".md"), f"{p.name}: not safetensors/JSON"
        assert not p.read_bytes()[:4].startswith(pickle_magic), f"{p.name} is a pickle"


def test_adapters_without_safetensors_weights_are_refused(written, tmp_path):
    d = shutil.copytree(written / "run", tmp_path / "a")
    (d / "adapter_model.safetensors").rename(d / "adapter_model.bin")
    with pytest.raises(LcxError, match="safetensors only"):
        load_adapter(load_model(str(written / "model"))[0], d)


# ---------------------------------------------------------------------- remote code
def test_remote_code_runs_only_with_the_flag(tmp_path):
    d = make_tiny_model_dir(tmp_path / "custom")
    marker = tmp_path / "ran"
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "custom_config.CustomConfig"}
    cfg["model_type"] = "lcx_custom"  # no transformers class: only the folder's code can read it
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "custom_config.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\n"
        "from transformers import LlamaConfig\n"
        "class CustomConfig(LlamaConfig):\n    model_type = 'lcx_custom'\n")
    with pytest.raises(LcxError, match="--trust-remote-code"):
        load_model(str(d))
    assert not marker.exists(), "the folder's code ran without --trust-remote-code"
    from click.testing import CliRunner

    from lcx.cli import main

    r = CliRunner().invoke(main, ["generate", "-m", str(d), "-p", "hi", "--max-new-tokens", "1"])
    assert r.exit_code != 0 and "--trust-remote-code" in r.output and not marker.exists()
    with pytest.raises(Exception):  # with the flag the folder's code runs (and this config has no model class)
        load_model(str(d), trust_remote_code=True)
    assert marker.read_text() == "imported"


# ---------------------------------------------------------------------- corrupted / truncated files
def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if how == "truncated" else b"\x00\xffgarbage" + data[10:])


def _load(kind: str, d: Path, written: Path) -> None:
    if kind == "adapter":
        load_adapter(load_model(str(written / "model"))[0], d)
    elif kind == "memory":
        load_memory(d)
    elif kind == "model":
        load_model(str(d))
    else:  # a checkpoint: resume the run
        cfg = json.loads((d / "train_config.json").read_text())
        train(TrainConfig(**{**cfg, "out": str(d)}), resume=True, progress=False)


CASES = [("adapter", f) for f in ("adapter_model.safetensors", "adapter_config.json", "lcx.json")] + \
        [("memory", f) for f in ("memory.safetensors", "memory.json")] + \
        [("checkpoint", f) for f in ("trainable.safetensors", "optimizer.safetensors", "rng-0.safetensors", "meta.json")] + \
        [("model", f) for f in ("config.json", "model.safetensors", "tokenizer.json")]


@pytest.mark.parametrize("how", ["truncated", "garbled"])
@pytest.mark.parametrize("kind,name", CASES)
def test_a_damaged_file_gives_a_clear_error_naming_it(written, tmp_path, kind, name, how):
    src = {"adapter": "run", "checkpoint": "run", "memory": "memory", "model": "model"}[kind]
    d = shutil.copytree(written / src, tmp_path / src)
    target = d / name
    if kind == "checkpoint":  # the newest checkpoint is damaged; an older one exists
        target = d / "checkpoints" / "step-4" / name
    _damage(target, how)
    with pytest.raises(LcxError) as e:
        _load(kind, d, written)
    msg = str(e.value)
    # the file is named: by its path, or by its folder for the tokenizer (which several files make up)
    assert str(target) in msg or (name == "tokenizer.json" and "tokenizer" in msg and str(d) in msg), msg
    if kind == "checkpoint":
        assert "step-2" in msg, msg  # the way out: resume from the previous checkpoint
