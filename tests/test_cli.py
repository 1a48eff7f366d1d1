"""The `lcx` command: bad input gives one actionable line and exit status 2; happy paths write JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from lcx.adapters import peft_bridge
from lcx.cli import main
from lcx.models import load_model
from tests.helpers import make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("m") / "llama", max_position_embeddings=512)


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def assert_error(r, *needles: str) -> None:
    assert r.exit_code == 2, (r.exit_code, r.output)
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_empty_prompt_and_empty_file(tiny_dir, tmp_path):
    assert_error(run("generate", "-m", str(tiny_dir), "--method", "vanilla", "--prompt", ""), "empty input", "--prompt")
    (tmp_path / "empty.txt").write_text("")
    assert_error(run("generate", "-m", str(tiny_dir), "--input", str(tmp_path / "empty.txt")), "empty input")


def test_non_utf8_file(tiny_dir, tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes(b"caf\xe9 latin1")
    assert_error(run("generate", "-m", str(tiny_dir), "--input", str(f)), "not UTF-8", "0xe9", "iconv")


def test_unknown_method_lists_installed(tiny_dir):
    assert_error(run("generate", "-m", str(tiny_dir), "--method", "nosuch", "-p", "hi"),
                 "unknown method 'nosuch'", "streaming", "vanilla")


def test_hub_name_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_error(run("generate", "-m", "org/name", "-p", "hi"), "'org/name'", "never downloads from a hub")


def test_not_a_causal_lm(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                               vocab_size=100)).save_pretrained(str(tmp_path / "bert"))
    assert_error(run("generate", "-m", str(tmp_path / "bert"), "-p", "hi"), "not a causal language model", "'bert'")


def test_adapter_for_another_base_model(tmp_path):
    a = make_tiny_model_dir(tmp_path / "a", seed=0)
    b = make_tiny_model_dir(tmp_path / "b", seed=1)
    model_a, _ = load_model(str(a))
    peft_bridge.save_adapter(peft_bridge.add_adapter(model_a), tmp_path / "adapter",
                             methods=[{"name": "vanilla", "options": {}}])
    assert_error(run("generate", "-m", str(b), "--adapter", str(tmp_path / "adapter"), "-p", "hi"),
                 "trained for another base model", str(tmp_path / "adapter"))


def test_bad_options(tiny_dir):
    assert_error(run("generate", "-m", str(tiny_dir), "--method", "vanilla", "-o", "window", "-p", "hi"),
                 "not KEY=VALUE", "-o window=1024")
    assert_error(run("generate", "-m", str(tiny_dir), "--method", "vanilla", "-o", "nosuch=1", "-p", "hi"),
                 "'nosuch'", "none of the selected methods")
    assert_error(run("generate", "-m", str(tiny_dir), "--method", "streaming", "-o", "sinks=many", "-p", "hi"),
                 "sinks='many'", "int")


def test_bad_lengths_is_a_usage_error(tiny_dir):
    r = run("eval", "passkey", "-m", str(tiny_dir), "--lengths", "abc")
    assert r.exit_code == 2 and "4096,8K" in r.output


def test_generate_json(tiny_dir):
    r = run("generate", "-m", str(tiny_dir), "--method", "vanilla", "--prompt", "hello world", "-n", "3", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["new_tokens"] == 3 and out["methods"] == [{"name": "vanilla", "options": {"head_fraction": 0.5, "window": 0}}]


def test_eval_passkey_writes_json_and_heatmap(tiny_dir, tmp_path):
    r = run("eval", "passkey", "-m", str(tiny_dir), "--method", "streaming", "-o", "chunk=64", "--lengths", "600",
            "--depths", "0.5", "--samples", "2", "--out", str(tmp_path / "pk"), "--json")
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "pk" / "passkey.json").read_text())
    assert len(res["samples"]) == 2 and {"accuracy", "accuracy_by_length"} <= set(res["summary"])
    assert res["samples"][0]["tokens"] > 512  # longer than the tiny model's window
    assert (tmp_path / "pk" / "passkey.png").stat().st_size > 1000


def test_eval_compare_ppl_writes_table(tiny_dir, tmp_path):
    (tmp_path / "doc.txt").write_text("the quick brown fox jumps over the lazy dog. " * 30)
    r = run("eval", "compare", "ppl", "-m", str(tiny_dir), "--stack", "none", "--stack", "streaming",
            "-o", "streaming.chunk=32", "-d", str(tmp_path / "doc.txt"), "--contexts", "64,256", "--target", "32",
            "--out", str(tmp_path / "cmp"), "--json")
    assert r.exit_code == 0, r.output
    table = (tmp_path / "cmp" / "compare-ppl.md").read_text()
    assert "| none |" in table and "| streaming |" in table
    assert (tmp_path / "cmp" / "compare-ppl.png").exists()


def test_methods_and_plugins_json():
    methods = json.loads(run("methods", "--json").output)
    assert {"vanilla", "rope", "streaming"} <= {m["name"] for m in methods}
    assert all(m["options"] is not None for m in methods)
    plugins = json.loads(run("plugins", "--json").output)
    assert any(p["source"] == "builtin" for p in plugins)
