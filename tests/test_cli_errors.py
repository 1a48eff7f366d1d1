"""Through the real `lcx` command: every user mistake gives one `error:` line naming the value and a fix, exit 2.

Commands run in-process with click's CliRunner (stdout and stderr kept apart); two cheap ones also run as
real subprocesses to pin the console script's exit status.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from lcx.adapters import peft_bridge
from lcx.cli import main
from lcx.models import load_model
from tests.helpers import make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("cli-errors") / "llama", max_position_embeddings=512)


def lcx(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), prog_name="lcx")


def assert_error(r: Result, *needles: str) -> str:
    """Exit status 2, nothing on stdout, exactly one stderr line starting with ``error:`` containing ``needles``."""
    assert r.exit_code == 2, (r.exit_code, r.output, r.exc_info)
    assert isinstance(r.exception, SystemExit), r.exc_info
    assert r.stdout == "", r.stdout
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, r.stderr
    line = lines[0]
    assert line.startswith("error: "), line
    for n in needles:
        assert n in line, (n, line)
    return line


# ---------------------------------------------------------------------- input text
def test_empty_prompt_without_input(tiny_dir):
    assert_error(lcx("generate", "-m", str(tiny_dir), "--method", "vanilla", "--prompt", ""),
                 "empty input", "--input FILE", "--prompt TEXT")


@pytest.mark.parametrize("content", ["", "  \n\t\n"], ids=["empty", "whitespace"])
def test_empty_input_file(tiny_dir, tmp_path, content):
    f = tmp_path / "doc.txt"
    f.write_text(content)
    assert_error(lcx("generate", "-m", str(tiny_dir), "--method", "vanilla", "--input", str(f)),
                 "empty input", "--prompt")


def test_empty_input_file_is_named(tiny_dir, tmp_path):
    f = tmp_path / "doc.txt"
    f.write_text("")
    assert_error(lcx("generate", "-m", str(tiny_dir), "--input", str(f)), str(f))


def test_non_utf8_input_file(tiny_dir, tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes(b"caf\xe9 latin1")
    assert_error(lcx("generate", "-m", str(tiny_dir), "--method", "vanilla", "--input", str(f), "-p", "hi"),
                 repr(str(f)), "not UTF-8", "0xe9", "offset 3", "iconv -f latin1 -t utf-8")


def test_missing_input_file(tiny_dir, tmp_path):
    f = tmp_path / "nope.txt"
    assert_error(lcx("generate", "-m", str(tiny_dir), "--input", str(f)), repr(str(f)), "does not exist")


# ---------------------------------------------------------------------- method and model names
def test_unknown_method_lists_installed_ones(tiny_dir):
    assert_error(lcx("generate", "-m", str(tiny_dir), "--method", "nosuch", "-p", "hi"),
                 "unknown method 'nosuch'", "installed methods:", "vanilla", "streaming", "rope", "`lcx methods`")


@pytest.mark.parametrize("name", ["org/name", "nosuch-model"])
def test_unknown_model_is_not_downloaded(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)  # so no relative folder of that name exists
    assert_error(lcx("generate", "-m", name, "--method", "vanilla", "-p", "hi"),
                 f"no local model folder {name!r}", "never downloads from a hub", "lcx models pull")


def test_folder_without_config(tmp_path):
    (tmp_path / "empty-model").mkdir()
    assert_error(lcx("generate", "-m", str(tmp_path / "empty-model"), "-p", "hi"),
                 repr(str(tmp_path / "empty-model")), "no config.json", "save_pretrained")


@pytest.mark.parametrize("arch", ["BertModel", "BertForMaskedLM"])
def test_not_a_causal_lm(tmp_path, arch):
    import transformers

    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64)
    folder = tmp_path / "bert"
    getattr(transformers, arch)(cfg).save_pretrained(str(folder))
    assert_error(lcx("generate", "-m", str(folder), "--method", "vanilla", "-p", "hi"),
                 repr(str(folder)), "not a causal language model", "model_type 'bert'", "decoder-only")


# ---------------------------------------------------------------------- adapters
@pytest.fixture(scope="module")
def two_bases_and_adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter")
    a = make_tiny_model_dir(root / "a", seed=0)
    b = make_tiny_model_dir(root / "b", seed=1)
    model_a, _ = load_model(str(a))
    adapter = peft_bridge.save_adapter(peft_bridge.add_adapter(model_a), root / "adapter-a",
                                       methods=[{"name": "vanilla", "options": {}}])
    return a, b, adapter


def test_adapter_for_another_base_model(two_bases_and_adapter):
    a, b, adapter = two_bases_and_adapter
    assert_error(lcx("generate", "-m", str(b), "--adapter", str(adapter), "-p", "hi"),
                 f"adapter {str(adapter)!r} was trained for another base model", "embedding_sha256",
                 repr(str(a)), "load it on that model")


def test_adapter_on_its_own_base_model_works(two_bases_and_adapter):
    a, _, adapter = two_bases_and_adapter
    r = lcx("generate", "-m", str(a), "--adapter", str(adapter), "-p", "hi", "-n", "2", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["new_tokens"] == 2 and [m["name"] for m in out["methods"]] == ["vanilla"]  # from the sidecar


def test_adapter_folder_missing(tiny_dir, tmp_path):
    assert_error(lcx("generate", "-m", str(tiny_dir), "--adapter", str(tmp_path / "nope"), "-p", "hi"),
                 repr(str(tmp_path / "nope")), "does not exist", "lcx train")


# ---------------------------------------------------------------------- method options
@pytest.mark.parametrize(("option", "needles"), [
    ("window", ["option 'window' is not KEY=VALUE", "-o window=1024"]),
    ("=1", ["option '=1' is not KEY=VALUE"]),
    ("nosuch=1", ["option 'nosuch' belongs to none of the selected methods (vanilla)", "`lcx methods -v`"]),
    ("vanilla.nosuch=1", ["unknown option 'nosuch' for method 'vanilla'", "head_fraction, window",
                          "`lcx methods -v`"]),
    ("window=abc", ["option window='abc' of method 'vanilla' is not a valid int"]),
    ("head_fraction=2", ["bad options for method 'vanilla'", "head_fraction must be in [0, 1], got 2.0"]),
], ids=["no-equals", "no-key", "unknown", "unknown-qualified", "bad-int", "out-of-range"])
def test_bad_method_options(tiny_dir, option, needles):
    assert_error(lcx("generate", "-m", str(tiny_dir), "--method", "vanilla", "-o", option, "-p", "hi"), *needles)


# ---------------------------------------------------------------------- usage errors (click)
@pytest.mark.parametrize(("args", "needle"), [
    (["--lengths", "abc"], "'abc' is not a token count (e.g. 4096 or 8K)"),
    (["--lengths", "8K,0"], "'0': token counts must be positive"),
    (["--depths", "2"], "depths must be between 0 and 1"),
])
def test_eval_passkey_bad_grid_is_a_usage_error(tiny_dir, args, needle):
    assert_error(lcx("eval", "passkey", "-m", str(tiny_dir), *args), needle, "(see `lcx eval passkey --help`)")


def test_an_unknown_option_is_one_error_line_and_a_bare_group_still_shows_its_help():
    assert_error(lcx("eval", "ppl", "--nope", "body"), "No such option '--nope'", "`lcx eval ppl --help`")
    r = lcx("eval")
    assert "Commands:" in r.output and "error:" not in r.output


def test_real_process_exit_status(tmp_path):
    """The console script itself: a click usage error and an LcxError (both need no torch, so this is quick)."""
    exe = Path(sys.executable).with_name("lcx")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "lcx.cli"]
    r = subprocess.run([*cmd, "eval", "passkey", "-m", "x", "--lengths", "abc"], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == "" and "'abc' is not a token count" in r.stderr
    r = subprocess.run([*cmd, "models", "pull", "nosuch"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.splitlines() == [r.stderr.strip()] and r.stderr.startswith("error: unknown model 'nosuch'; "
                                                                               "known models: smollm2-135m")


# ---------------------------------------------------------------------- happy paths
def test_generate_json(tiny_dir):
    r = lcx("generate", "-m", str(tiny_dir), "--method", "vanilla", "--prompt", "hello world", "-n", "3", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["new_tokens"] == 3 and out["prompt_tokens"] > 0 and isinstance(out["text"], str)
    assert out["model"] == str(tiny_dir) and out["dropped_tokens"] == 0
    assert out["methods"] == [{"name": "vanilla", "options": {"head_fraction": 0.5, "window": 0}}]


def test_eval_passkey_writes_json_and_plot(tiny_dir, tmp_path):
    out_dir = tmp_path / "pk"
    r = lcx("eval", "passkey", "-m", str(tiny_dir), "--method", "vanilla", "--lengths", "400", "--depths", "0.5",
            "--samples", "2", "--out", str(out_dir), "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["json"] == str(out_dir / "passkey.json") and summary["plot"] == str(out_dir / "passkey.png")
    assert {"accuracy", "accuracy_by_length", "accuracy_by_cell", "n"} <= set(summary) and summary["n"] == 2
    assert set(summary["accuracy_by_length"]) == {"400"} and 0.0 <= summary["accuracy"] <= 1.0
    res = json.loads((out_dir / "passkey.json").read_text())
    assert res["config"]["lengths"] == [400] and res["config"]["depths"] == [0.5] and len(res["samples"]) == 2
    assert res["methods"] == [{"name": "vanilla", "options": {"head_fraction": 0.5, "window": 0}}]
    assert (out_dir / "passkey.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------- found by a CLI audit (2026-11-27)
def test_vanilla_with_no_room_for_the_prompt_is_one_error_line(tiny_dir):
    assert_error(lcx("generate", "-m", str(tiny_dir), "--method", "vanilla", "-p", "hi", "-n", "600"),
                 "max_new_tokens=600 leaves no room in a window of 512", "ask for fewer new tokens")
    assert_error(lcx("generate", "-m", str(tiny_dir), "--method", "vanilla", "-o", "window=10", "-p", "hi", "-n", "16"),
                 "leaves no room in a window of 10")


@pytest.mark.parametrize(("args", "needles"), [
    (["--method", "nosuch"], ["no installed method is named 'nosuch'", "fot"]),
    (["--length", "-5"], ["'--length'", "-5"]),
    (["--depth", "1.5"], ["'--depth'", "1.5"]),
])
def test_demo_refuses_what_it_cannot_run(tiny_dir, args, needles):
    assert_error(lcx("demo", "-m", str(tiny_dir), "--json", *args), *needles)


def test_generate_with_a_memory_needs_a_method_that_reads_it(tiny_dir, tmp_path):
    """The run's methods are asked whether they read document memories (``Method.reads_memory``); the fix names
    the installed ones."""
    assert_error(lcx("generate", "-m", str(tiny_dir), "--method", "vanilla", "--memory", str(tmp_path), "-p", "x"),
                 f"--memory {str(tmp_path)!r} needs a method that reads document memories (fot); add --method fot")


def test_memory_build_refuses_a_file_as_out_and_a_blank_document(tiny_dir, tmp_path):
    doc, blank, f = tmp_path / "a.txt", tmp_path / "blank.txt", tmp_path / "f.txt"
    doc.write_text("Some text. " * 20)
    blank.write_text(" \n")
    f.write_text("not a folder")
    assert_error(lcx("memory", "build", "-m", str(tiny_dir), "--out", str(f), str(doc)), repr(str(f)), "is a file")
    assert_error(lcx("memory", "build", "-m", str(tiny_dir), "--out", str(tmp_path / "mem"), str(doc), str(blank)),
                 "1 document(s) have no text", repr(str(blank)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert_error(lcx("memory", "build", "-m", str(tiny_dir), "--out", str(tmp_path / "mem"), str(empty)),
                 "no documents in", str(empty))  # it saved an empty memory, which readers then refused obscurely
    assert not (tmp_path / "mem").exists()


def test_text_field_is_an_option_wherever_jsonl_documents_are_read(tiny_dir, tmp_path):
    """The error for a .jsonl without 'text' advises --text-field: eval ppl (and memory build) take it; a .json
    array of objects reads as the same documents."""
    rows = [{"body": "It was a bright cold day in April, and the clocks were striking thirteen. " * 30}] * 2
    jl, js = tmp_path / "c.jsonl", tmp_path / "c.json"
    jl.write_text("\n".join(json.dumps(r) for r in rows))
    js.write_text(json.dumps(rows))
    args = ["eval", "ppl", "-m", str(tiny_dir), "--contexts", "64", "--target", "16", "--json"]
    assert_error(lcx(*args, "-d", str(jl), "--out", str(tmp_path / "p0")), "line 1 has no 'text' field (it has: body)",
                 "--text-field NAME")
    results = []
    for data in (jl, js):
        r = lcx(*args, "-d", str(data), "--text-field", "body", "--out", str(tmp_path / data.suffix[1:]))
        assert r.exit_code == 0, r.output
        results.append(json.loads((tmp_path / data.suffix[1:] / "ppl.json").read_text())["summary"])
    assert results[0]["ppl"] == results[1]["ppl"] and len(results[1]["by_document"]) == 2
    assert_error(lcx("memory", "build", "-m", str(tiny_dir), "--text-field", "nope", "--out", str(tmp_path / "m"), str(js)),
                 "item 1 has no 'nope' field")


@pytest.mark.parametrize(("extra", "needles"), [
    (["--stack", "nosuch"], ["stack 'nosuch'", "nosuch"]),
    (["--stack", "streaming", "-o", "streaming.nosuch=3"], ["stack 'streaming'", "nosuch"]),
    (["--stack", "none", "-o", "rope.factor=2"], ["options for 'rope', which no stack has", "--stack rope"]),
    (["-o", "window=5"], ["options of a comparison name their method", "-o METHOD.window=VALUE"]),
])
def test_compare_checks_every_stack_before_running_any(tiny_dir, tmp_path, extra, needles):
    out = tmp_path / "cmp"
    assert_error(lcx("eval", "compare", "passkey", "-m", str(tiny_dir), "--stack", "vanilla", *extra,
                     "--lengths", "400", "--depths", "0.5", "--samples", "1", "--out", str(out)), *needles)
    assert not out.exists()  # the vanilla stack never ran


def test_compare_include_refuses_another_grid_an_unfinished_journal_and_a_non_journal(tiny_dir, tmp_path):
    grid = ["-m", str(tiny_dir), "--lengths", "400", "--depths", "0.5", "--samples", "1"]
    r = lcx("eval", "passkey", *grid, "--method", "vanilla", "--out", str(tmp_path / "pk"), "--json")
    assert r.exit_code == 0, r.output
    journal = tmp_path / "pk" / "passkey.samples.jsonl"
    compare = ["eval", "compare", "passkey", "--stack", "none", "--include", str(journal)]
    out = tmp_path / "cmp"
    assert_error(lcx(*compare, *grid[:-1], "2", "--out", str(out)), f"--include {journal}", "samples 1, not 2",
                 "rerun that stack with --stack")
    assert_error(lcx(*compare, *grid, "--dtype", "bfloat16", "--out", str(out)), "dtype float32, not bfloat16")
    assert_error(lcx("eval", "compare", "ruler", "--stack", "none", "--include", str(journal), *grid, "--haystack",
                     str(journal), "--out", str(out)), "tasks not recorded")
    other = make_tiny_model_dir(tmp_path / "other", max_position_embeddings=512)
    assert_error(lcx(*compare, "-m", str(other), *grid[2:], "--out", str(out)), f"model {str(tiny_dir)!r}, not")
    assert not out.exists()  # refused before the none stack ran
    r = lcx("eval", "compare", "passkey", *grid, "--stack", "vanilla", "--out", str(out))
    assert r.exit_code == 0, r.output
    own = out / "compare-passkey.vanilla.samples.jsonl"
    assert_error(lcx("eval", "compare", "passkey", *grid, "--stack", "vanilla", "--include", str(own), "--out", str(out)),
                 "a --stack of this command writes that journal")
    # one sample of two, its last line cut by a crash: refused, and the file left as it was (never repaired)
    assert lcx("eval", "passkey", *grid[:-1], "2", "--method", "vanilla", "--out", str(tmp_path / "pk2")).exit_code == 0
    part = tmp_path / "pk2" / "passkey.samples.jsonl"
    lines = part.read_text().splitlines()
    part.write_text("\n".join(lines[:2]) + "\n" + lines[2][:20])
    before = part.read_bytes()
    assert_error(lcx(*compare[:-1], str(part), *grid[:-1], "2", "--out", str(out)), "holds 1 of this grid's samples, not all")
    assert part.read_bytes() == before
    lines = journal.read_text().splitlines()
    journal.write_text(lines[0] + "\n")  # its header only: a run stopped before its first sample
    assert_error(lcx(*compare, *grid, "--out", str(out)), "holds 0 of this grid's samples, not all", "--resume")
    journal.write_text("not a journal\n")
    assert_error(lcx(*compare, *grid, "--out", str(out)), "not a passkey or RULER journal")
    assert_error(lcx("eval", "compare", "passkey", *grid, "--out", str(tmp_path / "c3")), "nothing to compare",
                 "--stack METHODS")
    assert_error(lcx("eval", "compare", "ppl", "-m", str(tiny_dir), "--include", str(journal), "--out", str(out)),
                 "ppl keeps no journal")


def test_train_full_with_a_module_name_that_matches_nothing(tiny_dir, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("some words to train on. " * 50)
    assert_error(lcx("train", "-m", str(tiny_dir), "--method", "vanilla", "-d", str(doc), "--seq-len", "32", "--steps", "1",
                     "--full", "nosuch_proj", "--out", str(tmp_path / "a")),
                 "no module of the model is named 'nosuch_proj'", "q_proj", "up_proj")


def test_passkey_lengths_shorter_than_a_passkey_prompt_are_refused(tiny_dir, tmp_path):
    """--lengths 10 used to run 245-token prompts recorded under length 10."""
    line = assert_error(lcx("eval", "passkey", "-m", str(tiny_dir), "--method", "vanilla", "--lengths", "10",
                            "--samples", "1", "--out", str(tmp_path / "pk")), "passkey length 10 is shorter than")
    least = int(line.split("at least ")[-1].replace(",", ""))
    from lcx.evals.passkey import build_prompt_ids
    from lcx.models import load_model

    tok = load_model(str(tiny_dir))[1]
    assert len(build_prompt_ids(tok, least, 0.5, 12345)) <= least  # the shortest allowed length is built as asked
    r = lcx("eval", "passkey", "-m", str(tiny_dir), "--method", "vanilla", "--lengths", str(least), "--depths", "0.5",
            "--samples", "1", "--out", str(tmp_path / "pk"), "--json")
    assert r.exit_code == 0, r.output


def test_analyze_retrieval_takes_one_length(tiny_dir):
    assert_error(lcx("analyze", "retrieval", "-m", str(tiny_dir), "--length", "256,512"), "give one token count")


def test_an_out_folder_that_is_a_file_is_a_usage_error(tiny_dir, tmp_path):
    f = tmp_path / "f.txt"
    f.write_text("a file")
    doc = tmp_path / "d.txt"
    doc.write_text("some words. " * 40)
    for args in (["eval", "passkey", "-m", str(tiny_dir), "--method", "vanilla", "--out", str(f)],
                 ["analyze", "attention", "-m", str(tiny_dir), "-d", str(doc), "--length", "64", "--out", str(f)],
                 ["export", str(tiny_dir), "--method", "rope", "--out", str(f)],
                 ["train", "-m", str(tiny_dir), "-d", str(doc), "--steps", "1", "--out", str(f)],
                 ["models", "init", str(f)]):
        assert_error(lcx(*args), str(f), "is a file"), args


@pytest.mark.parametrize(("setting", "needle"), [
    (["-s", "vocab_size=abc"], "llama cannot be built with vocab_size='abc'"),
    (["-s", "hidden_size=30", "-s", "num_attention_heads=4"], "hidden_size=30, num_attention_heads=4"),
])
def test_models_init_with_values_transformers_refuses(tmp_path, setting, needle):
    assert_error(lcx("models", "init", str(tmp_path / "m"), *setting), needle, "fix the -s settings")
    assert not (tmp_path / "m").exists()


def test_options_for_a_method_that_is_not_selected_say_so(tiny_dir):
    assert_error(lcx("generate", "-m", str(tiny_dir), "--method", "streaming", "-o", "rope.factor=4", "-p", "hi"),
                 "options for method 'rope', which is not selected (streaming)", "add --method rope")


def test_a_whole_model_folder_given_as_adapter_points_to_m(tiny_dir):
    assert_error(lcx("generate", "-m", str(tiny_dir), "--adapter", str(tiny_dir), "-p", "hi"),
                 "is a whole model", f"-m {tiny_dir}")


def test_temperature_without_sampling_is_refused(tiny_dir):
    assert_error(lcx("generate", "-m", str(tiny_dir), "-p", "hi", "--temperature", "1.5"),
                 "--temperature 1.5 applies to sampling; add --sample")
    r = lcx("generate", "-m", str(tiny_dir), "-p", "hi", "-n", "2", "--sample", "--temperature", "1.5", "--json")
    assert r.exit_code == 0, r.output


def test_models_pull_prints_only_the_path_on_stdout(tmp_path, monkeypatch):
    """`path=$(lcx models pull NAME)` gets the folder; the progress lines go to stderr."""
    from lcx import models

    monkeypatch.setattr(models, "pull", lambda name, force, wheels, log: (log(f"[models] {name} is ready"), tmp_path)[1])
    r = lcx("models", "pull", "smollm2-135m")
    assert r.exit_code == 0 and r.stdout == f"{tmp_path}\n" and "is ready" in r.stderr


def test_memory_build_and_models_init_print_json(tiny_dir, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("some words to remember. " * 30)
    r = lcx("memory", "build", "-m", str(tiny_dir), "-o", "local=64", "-o", "memory_layers=1", "--out", str(tmp_path / "mem"),
            "--json", str(doc))
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["memory_layers"] == [1] and out["documents"][0]["source"] == str(doc) and out["entries_per_layer_and_head"] > 0
    r = lcx("models", "init", str(tmp_path / "m"), "-s", "num_hidden_layers=1", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["path"] == str(tmp_path / "m"), r.output


def test_the_analyses_read_jsonl_documents_by_text_field(tiny_dir, tmp_path):
    """analyze attention and distraction read documents as eval ppl does: --text-field, which the error advises."""
    jl = tmp_path / "c.jsonl"
    jl.write_text("\n".join(json.dumps({"body": "It was a bright cold day in April. " * 40}) for _ in range(2)))
    args = ["analyze", "attention", "-m", str(tiny_dir), "-d", str(jl), "--length", "64", "--json"]
    assert_error(lcx(*args, "--out", str(tmp_path / "a0")), "has no 'text' field", "--text-field NAME")
    r = lcx(*args, "--text-field", "body", "--out", str(tmp_path / "a1"))
    assert r.exit_code == 0, r.output
    # memory layers and gate given: the error is then the only output (at auto, fot first measures them on the model)
    assert_error(lcx("analyze", "distraction", "-m", str(tiny_dir), "-d", str(jl), "--text-field", "nope",
                     "-o", "memory_layers=1", "-o", "gate=-1", "--out", str(tmp_path / "d")), "has no 'nope' field")


def test_models_init_overwrite_replaces_the_folder_and_takes_nested_settings(tiny_dir, tmp_path):
    """--overwrite replaces the folder (an old tokenizer beside a new 68-token model was read with it); a dotted
    setting (-s rope_scaling.factor=4) is a nested one (it was a TypeError traceback)."""
    import shutil

    m = tmp_path / "m"
    shutil.copytree(tiny_dir, m)
    assert (m / "tokenizer.json").exists() or (m / "tokenizer_config.json").exists()
    r = lcx("models", "init", str(m), "--overwrite", "-s", "num_hidden_layers=1", "-s", "vocab_size=68", "--json")
    assert r.exit_code == 0, r.output
    assert not (m / "tokenizer.json").exists() and not (m / "tokenizer_config.json").exists()
    r = lcx("models", "init", str(tmp_path / "r"), "-s", "num_hidden_layers=1", "-s", "rope_scaling.rope_type=linear",
            "-s", "rope_scaling.factor=2", "--json")
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    assert scaling["factor"] == 2 and scaling["rope_type"] == "linear", cfg


def test_a_file_the_machine_refuses_is_one_error_line(tmp_path):
    """OSError (a permission, a full disk, a file where a folder must go) prints one error: line naming the
    path, not a traceback."""
    f = tmp_path / "f.txt"
    f.write_text("x")
    r = lcx("models", "init", str(f / "m"), "-s", "num_hidden_layers=1")  # a folder inside a file
    assert r.exit_code == 2 and r.output.startswith("error: Not a directory") and str(f) in r.output, r.output
    assert "Traceback" not in r.output and f.read_text() == "x"


def test_option_values_and_keys_that_cannot_apply_are_one_error_line(tiny_dir):
    """nan/inf passed every range check (rope's factor=nan gave a NaN rotary table and NaN in --json); a key
    named like attach's own arguments, a method given both a value and options, and infK were tracebacks."""
    gen = ["generate", "-m", str(tiny_dir), "-p", "hello world", "-n", "2", "--json"]
    for value in ("nan", "inf", "-inf"):
        assert_error(lcx(*gen, "--method", "rope", "-o", f"factor={value}"), f"option factor={float(value)!r} of method "
                     "'rope' must be a finite number")
    for key in ("model", "methods"):
        assert_error(lcx(*gen, "--method", "rope", "-o", f"{key}=x"), f"option {key!r} belongs to none of the selected methods")
    assert_error(lcx(*gen, "--method", "rope", "-o", "rope=yarn", "-o", "rope.factor=8"),
                 "'rope' is given both as an option and as a method's options")
    assert_error(lcx("analyze", "retrieval", "-m", str(tiny_dir), "--length", "infK"), "'infK' is not a token count")
