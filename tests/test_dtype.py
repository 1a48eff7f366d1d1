"""Which dtype a model computes in: ``--dtype`` / ``LCX_DTYPE`` / ``load_model(dtype=)``; auto picks bfloat16
only where the hardware runs it natively; the dtype is written into every result, journal and adapter, and a
journal or training run of one dtype is never silently continued in another."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from lcx import models
from lcx.cli import main
from lcx.errors import LcxError
from lcx.models import load_model, resolve_dtype
from tests.helpers import make_tiny_model_dir

CPU = torch.device("cpu")


@pytest.fixture
def flags(monkeypatch):
    """Pretend the CPU has the given feature flags."""
    def set_flags(*names: str) -> None:
        monkeypatch.setattr(models, "cpu_flags", lambda: set(names))
    return set_flags


def test_auto_is_bfloat16_only_where_the_cpu_runs_it_natively(flags, monkeypatch):
    monkeypatch.delenv("LCX_DTYPE", raising=False)
    flags("avx2", "amx_bf16", "amx_tile")
    assert resolve_dtype("auto", CPU) is torch.bfloat16
    assert resolve_dtype(None, CPU) is torch.bfloat16  # auto is the default
    flags("avx2", "avx512_bf16")
    assert resolve_dtype("auto", CPU) is torch.bfloat16
    flags("avx2", "avx512f")
    assert resolve_dtype("auto", CPU) is torch.float32


def test_explicit_names_aliases_and_the_variable(flags, monkeypatch):
    flags("amx_bf16")
    monkeypatch.setenv("LCX_DTYPE", "float32")
    assert resolve_dtype(None, CPU) is torch.float32  # the variable replaces auto as the default
    assert resolve_dtype("bf16", CPU) is torch.bfloat16  # the argument wins over the variable
    assert resolve_dtype("FP32", CPU) is torch.float32
    assert resolve_dtype(torch.bfloat16, CPU) is torch.bfloat16


def test_unknown_dtype_names_are_refused_with_the_choices(monkeypatch):
    with pytest.raises(LcxError, match=r"dtype 'int8' is not one lcx loads models in; give one of auto, float32, "
                                       r"bfloat16, float16"):
        resolve_dtype("int8", CPU)
    monkeypatch.setenv("LCX_DTYPE", "bfloat17")
    with pytest.raises(LcxError, match=r"dtype 'bfloat17' \(from LCX_DTYPE\)"):
        resolve_dtype(None, CPU)


def test_half_precision_without_native_support_is_said_not_silent(flags):
    said: list[str] = []
    flags("avx2")
    assert resolve_dtype("bfloat16", CPU, warn=said.append) is torch.bfloat16  # it runs, as asked ...
    assert len(said) == 1 and "no native bfloat16 (amx_bf16 or avx512_bf16)" in said[0] and "--dtype auto" in said[0]
    said.clear()
    flags("amx_bf16")
    resolve_dtype("bfloat16", CPU, warn=said.append)
    assert said == []  # ... and where it is native, nothing is said
    resolve_dtype("float16", CPU, warn=said.append)
    assert len(said) == 1 and "amx_fp16" in said[0]


def test_the_emulation_note_on_stderr_comes_once_a_process(flags, capsys, monkeypatch):
    import lcx.models

    monkeypatch.setattr(lcx.models, "_emulated_said", set())
    flags("avx2")
    for _ in range(3):  # lcx serve resolves its dtype, then the export and a measurement's load again
        resolve_dtype("float16", CPU)
    assert capsys.readouterr().err.count("no native float16") == 1


def test_load_model_and_the_cli_load_in_the_asked_dtype(tmp_path, flags):
    d = make_tiny_model_dir(tmp_path / "m")
    assert load_model(d, dtype="bfloat16")[0].dtype is torch.bfloat16
    assert load_model(d, dtype="float32")[0].dtype is torch.float32
    flags("amx_bf16")
    r = CliRunner().invoke(main, ["generate", "-m", str(d), "-p", "abc", "-n", "2", "--dtype", "auto", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output[r.output.index("{"):])["dtype"] == "bfloat16"
    r = CliRunner().invoke(main, ["generate", "-m", str(d), "-p", "abc", "-n", "2", "--dtype", "float32", "--json"])
    assert json.loads(r.output[r.output.index("{"):])["dtype"] == "float32"
    r = CliRunner().invoke(main, ["generate", "-m", str(d), "-p", "abc", "--dtype", "int4"])
    assert r.exit_code == 2 and "'int4' is not one of" in r.output, r.output


def test_a_passkey_journal_is_not_resumed_in_another_dtype(tmp_path):
    d = make_tiny_model_dir(tmp_path / "m", max_position_embeddings=512)
    args = ["eval", "passkey", "-m", str(d), "--lengths", "400", "--depths", "0.5", "--samples", "1",
            "--out", str(tmp_path / "pk"), "--json"]
    r = CliRunner().invoke(main, [*args, "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    head = json.loads((tmp_path / "pk" / "passkey.samples.jsonl").read_text().splitlines()[0])["fingerprint"]
    assert head["dtype"] == "float32"
    assert json.loads((tmp_path / "pk" / "passkey.json").read_text())["dtype"] == "float32"
    r = CliRunner().invoke(main, [*args, "--dtype", "bfloat16", "--resume"])
    assert r.exit_code == 2 and "differs in: dtype" in r.output and "pass --dtype float32 to resume" in r.output, r.output
    r = CliRunner().invoke(main, [*args, "--dtype", "float32", "--resume"])
    assert r.exit_code == 0, r.output


def test_a_journal_from_before_dtypes_resumes_as_float32_only(tmp_path):
    d = make_tiny_model_dir(tmp_path / "m", max_position_embeddings=512)
    args = ["eval", "passkey", "-m", str(d), "--lengths", "400", "--depths", "0.5", "--samples", "1",
            "--out", str(tmp_path / "pk"), "--json"]
    assert CliRunner().invoke(main, [*args, "--dtype", "float32"]).exit_code == 0
    journal = tmp_path / "pk" / "passkey.samples.jsonl"
    lines = journal.read_text().splitlines()
    head = json.loads(lines[0])
    del head["fingerprint"]["dtype"]  # as lcx wrote journals before it recorded the dtype
    journal.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    assert CliRunner().invoke(main, [*args, "--dtype", "bfloat16", "--resume"]).exit_code == 2
    assert CliRunner().invoke(main, [*args, "--dtype", "float32", "--resume"]).exit_code == 0


def test_training_records_its_dtype_keeps_trained_parameters_float32_and_refuses_another_on_resume(tmp_path):
    from lcx.train import TrainConfig, train

    d = make_tiny_model_dir(tmp_path / "m")
    (tmp_path / "doc.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    cfg = TrainConfig(model=str(d), data=[str(tmp_path / "doc.txt")], out=str(tmp_path / "a"), seq_len=32, steps=2,
                      save_every=1, dtype="bfloat16")
    train(cfg, progress=False, stop_after=1)
    from safetensors.torch import load_file

    weights = load_file(next((tmp_path / "a" / "checkpoints").glob("*/trainable.safetensors")))
    assert weights and all(t.dtype is torch.float32 for t in weights.values())
    cfg32 = TrainConfig(**{**cfg.__dict__, "dtype": "float32"})
    with pytest.raises(LcxError, match=r"--resume: dtype differs from the interrupted run \('bfloat16' there, "
                                       r"'float32' now\)"):
        train(cfg32, resume=True, progress=False)
    out = train(cfg, resume=True, progress=False)
    sidecar = json.loads((out / "lcx.json").read_text())
    assert sidecar["training"]["dtype"] == "bfloat16"
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)  # finite: bf16 weights, float32 LoRA, autocast


def test_an_adapter_used_in_another_dtype_than_it_was_trained_in_is_said(tmp_path, capsys):
    from lcx.adapters.peft_bridge import random_adapter
    from lcx.session import open_session

    d = make_tiny_model_dir(tmp_path / "m")
    adapter = random_adapter(load_model(d, dtype="float32", require_tokenizer=False)[0], tmp_path / "a", 0)
    open_session(str(d), [], {}, adapter, dtype="float32").close()
    assert "was trained over" not in capsys.readouterr().err
    s = open_session(str(d), [], {}, adapter, dtype="bfloat16")
    s.close()
    err = capsys.readouterr().err
    assert "was trained over float32 weights and is used over bfloat16 ones (pass --dtype float32" in err


def test_a_memory_read_in_another_dtype_than_it_was_built_in_is_said(tmp_path):
    from tests.helpers import make_word_documents

    d = make_tiny_model_dir(tmp_path / "m")
    docs = make_word_documents(tmp_path / "docs")
    build = ["memory", "build", "-m", str(d), "--out", str(tmp_path / "mem"), "-o", "local=32", "--dtype", "float32",
             "--json", str(docs)]
    r = CliRunner().invoke(main, build)
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "mem" / "memory.json").read_text())["dtype"] == "float32"
    gen = ["generate", "-m", str(d), "--method", "fot", "-o", "local=32", "--memory", str(tmp_path / "mem"),
           "-p", "alpha", "-n", "2", "--json"]
    r = CliRunner().invoke(main, [*gen, "--dtype", "float32"])
    assert r.exit_code == 0 and "was built in" not in r.output, r.output
    r = CliRunner().invoke(main, [*gen, "--dtype", "bfloat16"])
    assert r.exit_code == 0 and "was built in float32 and is read in bfloat16" in r.output, r.output


def test_an_adapter_from_before_bf16_fingerprints_over_bf16_weights_asks_for_float32(tmp_path):
    from lcx.adapters.peft_bridge import random_adapter
    from lcx.session import open_session

    d = make_tiny_model_dir(tmp_path / "m")
    adapter = random_adapter(load_model(d, dtype="float32", require_tokenizer=False)[0], tmp_path / "a", 0)
    sidecar = json.loads((adapter / "lcx.json").read_text())
    del sidecar["base_model"]["embedding_bf16_sha256"]  # as lcx saved adapters before 2026-11-28
    (adapter / "lcx.json").write_text(json.dumps(sidecar))
    open_session(str(d), [], {}, adapter, dtype="float32").close()  # its float32 fingerprint still matches
    with pytest.raises(LcxError, match=r"records its base model's weights in float32 only .* loaded in bfloat16: "
                                       r"load it with --dtype float32"):
        open_session(str(d), [], {}, adapter, dtype="bfloat16")
