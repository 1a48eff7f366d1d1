"""The `lcx` command's evaluation paths write their JSON, tables and plots (errors: test_cli_errors.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from lcx.cli import main
from tests.helpers import make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("m") / "llama", max_position_embeddings=512)


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_eval_passkey_writes_json_and_heatmap(tiny_dir, tmp_path):
    r = run("eval", "passkey", "-m", str(tiny_dir), "--method", "streaming", "-o", "chunk=64", "--lengths", "600",
            "--depths", "0.5", "--samples", "2", "--out", str(tmp_path / "pk"), "--json")
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "pk" / "passkey.json").read_text())
    assert len(res["samples"]) == 2 and {"accuracy", "accuracy_by_length"} <= set(res["summary"])
    assert res["samples"][0]["tokens"] > 512  # longer than the tiny model's window
    assert (tmp_path / "pk" / "passkey.png").stat().st_size > 1000
    assert res["config"]["max_new_tokens"] == 8


def test_eval_passkey_and_compare_generate_the_new_tokens_asked_for(tiny_dir, tmp_path, monkeypatch):
    import lcx.generation

    asked, generate = [], lcx.generation.generate
    monkeypatch.setattr(lcx.generation, "generate",
                        lambda *a, **kw: asked.append(kw["max_new_tokens"]) or generate(*a, **kw))
    args = ["-m", str(tiny_dir), "--lengths", "400", "--depths", "0.5", "--samples", "1", "--max-new-tokens", "13"]
    r = run("eval", "passkey", *args, "--out", str(tmp_path / "pk"))
    assert r.exit_code == 0, r.output
    r = run("eval", "compare", "passkey", *args, "--stack", "none", "--out", str(tmp_path / "cmp"))
    assert r.exit_code == 0, r.output
    assert asked == [13, 13]
    assert json.loads((tmp_path / "pk" / "passkey.json").read_text())["config"]["max_new_tokens"] == 13


def test_eval_compare_includes_a_finished_journal_as_a_row_without_rerunning_it(tiny_dir, tmp_path, monkeypatch):
    import lcx.generation

    grid = ["-m", str(tiny_dir), "--lengths", "400", "--depths", "0.3,0.7", "--samples", "1"]
    r = run("eval", "passkey", *grid, "--method", "streaming", "-o", "chunk=64", "--out", str(tmp_path / "pk"))
    assert r.exit_code == 0, r.output
    own = json.loads((tmp_path / "pk" / "passkey.json").read_text())
    journal = tmp_path / "pk" / "passkey.samples.jsonl"
    before = journal.read_bytes()
    calls, generate = [], lcx.generation.generate
    monkeypatch.setattr(lcx.generation, "generate", lambda *a, **kw: calls.append(1) or generate(*a, **kw))
    r = run("eval", "compare", "passkey", *grid, "--stack", "none", "--include", str(journal),
            "--out", str(tmp_path / "cmp"))
    assert r.exit_code == 0, r.output
    assert len(calls) == 2  # the none stack's two samples; the included row is read, not generated
    assert journal.read_bytes() == before
    stacks = json.loads((tmp_path / "cmp" / "compare-passkey.json").read_text())["stacks"]
    assert list(stacks) == ["none", "streaming"]
    assert stacks["streaming"]["summary"] == own["summary"] and stacks["streaming"]["samples"] == own["samples"]
    assert stacks["streaming"]["methods"][0]["options"]["chunk"] == 64
    assert "| streaming |" in (tmp_path / "cmp" / "compare-passkey.md").read_text()
    # a stack of the same name run here keeps its name; the included one is told apart by its folder
    r = run("eval", "compare", "passkey", *grid, "--stack", "streaming", "-o", "streaming.chunk=64",
            "--include", str(tmp_path / "pk" / "passkey.samples.jsonl"), "--out", str(tmp_path / "cmp2"), "--json")
    assert r.exit_code == 0, r.output
    stacks = json.loads((tmp_path / "cmp2" / "compare-passkey.json").read_text())["stacks"]
    assert list(stacks) == ["streaming", "streaming (pk)"]
    assert stacks["streaming"]["summary"] == stacks["streaming (pk)"]["summary"]  # the same run, computed twice


def test_ruler_help_speaks_of_ruler_and_compare_help_of_both_suites():
    ruler, compare = (" ".join(run("eval", suite, "--help").output.split()) for suite in ("ruler", "compare"))
    assert "passkey" not in ruler and "(default: each task's own" in ruler
    assert "(default: passkey 8; ruler: each task's own" in compare


def test_eval_compare_ppl_writes_table(tiny_dir, tmp_path):
    (tmp_path / "doc.txt").write_text("the quick brown fox jumps over the lazy dog. " * 30)
    r = run("eval", "compare", "ppl", "-m", str(tiny_dir), "--stack", "none", "--stack", "streaming",
            "-o", "streaming.chunk=32", "-d", str(tmp_path / "doc.txt"), "--contexts", "64,256", "--target", "32",
            "--out", str(tmp_path / "cmp"), "--json")
    assert r.exit_code == 0, r.output
    table = (tmp_path / "cmp" / "compare-ppl.md").read_text()
    assert "| none |" in table and "| streaming |" in table
    assert (tmp_path / "cmp" / "compare-ppl.png").exists()


def test_eval_compare_loads_an_adapter_for_its_stack_only(tiny_dir, tmp_path):
    """--stack METHODS@DIR: that stack reads the model with the adapter (and its trained options), the other
    stacks without it, whichever order they come in; @DIR alone takes the adapter's methods; the passkey
    journals of a stack with and without the adapter are kept apart."""
    from lcx.adapters.peft_bridge import random_adapter
    from lcx.models import load_model

    model, _ = load_model(str(tiny_dir))
    adapter = random_adapter(model, tmp_path / "ad", seed=3, scale=0.5,
                             methods=[{"name": "streaming", "options": {"chunk": 32, "sinks": 2}}])
    (tmp_path / "doc.txt").write_text("the quick brown fox jumps over the lazy dog. " * 30)
    common = ["-d", str(tmp_path / "doc.txt"), "--contexts", "64,256", "--target", "32", "-o", "streaming.chunk=64",
              "--json"]

    def ppl(*stacks: str, out: str, options=common) -> dict:
        args = [a for st in stacks for a in ("--stack", st)]
        r = run("eval", "compare", "ppl", "-m", str(tiny_dir), *args, *options, "--out", str(tmp_path / out))
        assert r.exit_code == 0, r.output
        return json.loads((tmp_path / out / "compare-ppl.json").read_text())["stacks"]

    # (an option for streaming with no streaming stack would be refused: test_cli_errors)
    alone = ppl("none", out="alone", options=[x for x in common if x != "-o" and x != "streaming.chunk=64"])["none"]["summary"]["ppl"]
    both = ppl(f"streaming@{adapter}", "none", f"@{adapter}", out="both")
    assert both["none"]["summary"]["ppl"] == alone  # the adapter was removed after its stack
    mine = both[f"streaming@{adapter}"]
    assert mine["adapter"] == str(adapter) and mine["summary"]["ppl"] != alone
    # @DIR: the trained options under the given ones (chunk 64 given, sinks 2 trained); named methods: defaults
    assert both[f"@{adapter}"]["methods"] == [{"name": "streaming", "options": {**mine["methods"][0]["options"], "sinks": 2}}]
    assert mine["methods"][0]["options"]["sinks"] == 4 and mine["methods"][0]["options"]["chunk"] == 64
    r = run("eval", "compare", "passkey", "-m", str(tiny_dir), "--stack", "streaming", "--stack", f"streaming@{adapter}",
            "-o", "streaming.chunk=64", "--lengths", "400", "--depths", "0.5", "--samples", "1", "--out", str(tmp_path / "pk"), "--json")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "pk").glob("*.samples.jsonl")) == [
        "compare-passkey.streaming.samples.jsonl", "compare-passkey.streaming@ad.samples.jsonl"]
    r = run("eval", "compare", "ppl", "-m", str(tiny_dir), "--stack", "none", "--stack", "streaming@", *common)
    assert r.exit_code == 2 and "stack 'streaming@' names no adapter after '@'" in r.output
    # two adapter folders of one name (results/x/adapter, results/y/adapter): a journal each, resumable
    twin = random_adapter(model, tmp_path / "other" / "ad", seed=4, scale=0.5,
                          methods=[{"name": "streaming", "options": {"chunk": 32, "sinks": 2}}])
    args = ["eval", "compare", "passkey", "-m", str(tiny_dir), "--stack", f"streaming@{adapter}", "--stack",
            f"streaming@{twin}", "-o", "streaming.chunk=64", "--lengths", "400", "--depths", "0.5", "--samples", "1",
            "--out", str(tmp_path / "twins"), "--json", "--resume"]
    for _ in range(2):  # the second run resumes both stacks' journals
        r = run(*args)
        assert r.exit_code == 0, r.output
    journals = sorted(p.name for p in (tmp_path / "twins").glob("*.samples.jsonl"))
    assert len(journals) == 2 and "compare-passkey.streaming@ad.samples.jsonl" in journals, journals
    hashed = next(tmp_path / "twins" / j for j in journals if "@ad-" in j)  # the second twin's
    r = run(*args, "--include", str(hashed))
    assert r.exit_code != 0 and "a --stack of this command writes that journal" in r.output, r.output
    # @DIR writes the journal of its adapter's methods, which it refuses to --include as well
    own = tmp_path / "twins" / "compare-passkey.streaming@ad.samples.jsonl"
    r = run("eval", "compare", "passkey", "-m", str(tiny_dir), "--stack", f"@{adapter}", "--include", str(own),
            "--lengths", "400", "--depths", "0.5", "--samples", "1", "--out", str(tmp_path / "twins"))
    assert r.exit_code != 0 and "a --stack of this command writes that journal" in r.output, r.output


def test_methods_and_plugins_json():
    methods = json.loads(run("methods", "--json").output)
    assert {"vanilla", "rope", "streaming"} <= {m["name"] for m in methods}
    assert all(m["options"] is not None for m in methods)
    plugins = json.loads(run("plugins", "--json").output)
    assert any(p["source"] == "builtin" for p in plugins)


def test_eval_passkey_resume_reuses_the_journal_and_refuses_other_options(tiny_dir, tmp_path):
    args = ["eval", "passkey", "-m", str(tiny_dir), "--method", "streaming", "--lengths", "400", "--depths", "0.5",
            "--samples", "2", "--out", str(tmp_path / "pk"), "--json"]
    assert run(*args, "-o", "chunk=64").exit_code == 0
    first = json.loads((tmp_path / "pk" / "passkey.json").read_text())
    r = run(*args, "-o", "chunk=64", "--resume")
    assert r.exit_code == 0, r.output
    again = json.loads((tmp_path / "pk" / "passkey.json").read_text())
    assert again["resumed_samples"] == 2 and again["samples"] == first["samples"]
    r = run(*args, "-o", "chunk=32", "--resume")
    assert r.exit_code != 0 and "passkey.samples.jsonl" in r.output and "differs in: methods" in r.output


def test_eval_passkey_resume_refuses_another_adapter_in_the_same_folder(tiny_dir, tmp_path):
    """The journal knows the adapter by its weights, not only its path: retrained into the same folder, it is
    another run.  A journal written before the weights were recorded resumes, with a note saying so."""
    from lcx.adapters.peft_bridge import random_adapter
    from lcx.models import load_model

    a = tmp_path / "adapter"
    random_adapter(load_model(str(tiny_dir))[0], a, seed=1)
    args = ["eval", "passkey", "-m", str(tiny_dir), "--adapter", str(a), "--method", "streaming", "-o", "chunk=64",
            "--lengths", "400", "--depths", "0.5", "--samples", "2", "--out", str(tmp_path / "pk")]
    assert run(*args).exit_code == 0
    journal = tmp_path / "pk" / "passkey.samples.jsonl"
    head, *samples = journal.read_text().splitlines()
    r = run(*args, "--resume")
    assert r.exit_code == 0 and "resuming: 2 samples" in r.output and "predates" not in r.output, r.output
    random_adapter(load_model(str(tiny_dir))[0], a, seed=2)  # retrained into the same folder
    r = run(*args, "--resume")
    assert r.exit_code != 0 and "differs in: adapter_sha256" in r.output, r.output
    old = json.loads(head)
    del old["fingerprint"]["adapter_sha256"]  # as lcx wrote journals before it recorded the weights
    journal.write_text("\n".join([json.dumps(old), *samples]) + "\n")
    r = run(*args, "--resume")
    assert r.exit_code == 0 and "resuming: 2 samples" in r.output and "predates lcx recording the adapter's weights" in r.output


def test_a_memory_read_with_another_adapter_than_it_was_built_with_gets_a_note(tiny_dir, tmp_path):
    """`memory build --adapter` indexes with the adapter's projections and records it; `generate --memory` says
    so when the memory is read with another adapter (or none), and says nothing when they agree."""
    from lcx.adapters.peft_bridge import adapter_digest, random_adapter
    from lcx.models import load_model

    a = random_adapter(load_model(str(tiny_dir))[0], tmp_path / "a", seed=1, scale=0.5)
    doc = tmp_path / "d.txt"
    doc.write_text("some words to remember. " * 30)
    fot = ["-o", "local=64", "-o", "memory_layers=1"]
    mem0, mem_a = tmp_path / "mem0", tmp_path / "mem-a"
    assert run("memory", "build", "-m", str(tiny_dir), *fot, "--out", str(mem0), str(doc)).exit_code == 0
    r = run("memory", "build", "-m", str(tiny_dir), *fot, "--adapter", str(a), "--out", str(mem_a), str(doc))
    assert r.exit_code == 0, r.output
    assert json.loads((mem_a / "memory.json").read_text())["adapter"] == {"path": str(a), "sha256": adapter_digest(a)}
    assert (mem_a / "memory.safetensors").read_bytes() != (mem0 / "memory.safetensors").read_bytes()  # its keys
    gen = ["generate", "-m", str(tiny_dir), "--method", "fot", *fot, "-p", "words", "-n", "2", "--json"]
    for mem, adapter, note in ((mem0, None, None), (mem_a, a, None),
                               (mem0, a, "was built by the model without an adapter, and is read with the adapter in"),
                               (mem_a, None, "was built with the adapter then in")):
        r = run(*gen, "--memory", str(mem), *(["--adapter", str(adapter)] if adapter else []))
        assert r.exit_code == 0, r.output
        json.loads(r.stdout)  # the note goes to stderr
        assert (note in r.stderr if note else "note:" not in r.stderr), (mem, adapter, r.stderr)


def test_a_memory_read_under_other_options_than_it_was_built_with_gets_a_note(tiny_dir, tmp_path):
    """The options that shaped a memory's entries (fot: local, k, ...) are compared with the reading ones: each
    that differs is named with its built value and the -o that reads it as built; the same options say
    nothing, and a memory whose build predates an option counts it at the value that build ran with."""
    doc = tmp_path / "d.txt"
    doc.write_text("some words to remember. " * 30)
    fot = ["-o", "local=64", "-o", "memory_layers=1"]
    mem = tmp_path / "mem"
    assert run("memory", "build", "-m", str(tiny_dir), *fot, "--out", str(mem), str(doc)).exit_code == 0
    gen = ["generate", "-m", str(tiny_dir), "--method", "fot", "-p", "words", "-n", "2", "--json", "--memory", str(mem)]
    r = run(*gen, *fot)
    assert r.exit_code == 0 and "note:" not in r.stderr, r.stderr
    r = run(*gen, "-o", "local=128", "-o", "memory_layers=1", "-o", "k=8", "-o", "gate_sinks=false", "-o", "gate=0")
    assert r.exit_code == 0, r.output
    assert ("was built with fot local=64, chunk=64, k=32, gate=-1.0, gate_sinks=true, and is read with local=128, "
            "chunk=128, k=8, gate=0.0, gate_sinks=false" in r.stderr), r.stderr  # chunk: the default, cut to local
    assert "-o fot.local=64 -o fot.chunk=64 -o fot.k=32 -o fot.gate=-1.0 -o fot.gate_sinks=true" in r.stderr
    meta = json.loads((mem / "memory.json").read_text())
    del meta["method"]["options"]["gate_sinks"], meta["method"]["options"]["sinks"]  # as an older lcx recorded it
    (mem / "memory.json").write_text(json.dumps(meta))
    r = run(*gen, *fot)  # gate_sinks was then always true (its default); sinks were 0 (its `before`)
    assert r.exit_code == 0 and "note:" in r.stderr and "sinks=0, and is read with sinks=4" in r.stderr, r.stderr
    assert "gate_sinks" not in r.stderr
    # an option neither side reads is not named: fixed_distance without positions=fixed, k with dense memory
    from lcx.plugins.fot.method import FoT

    built = {"name": "fot", "options": {**FoT.default_options(), "positions": "first", "dense": True}}
    here = FoT.from_options(positions="first", dense=True, fixed_distance=1024, k=8)
    assert here.memory_built_otherwise({"method": built}) == {}
    assert FoT.from_options(fixed_distance=1024).memory_built_otherwise({"method": built}) == \
        {"positions": ("first", "fixed"), "fixed_distance": (4096, 1024), "dense": (True, False)}


def test_generate_json_says_the_rope_factor_its_request_ran_with(tiny_dir):
    r = run("generate", "-m", str(tiny_dir), "--method", "rope", "-p", "one two " * 400, "-n", "2", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    factor = out["request_options"]["rope"]["factor"]  # its length over the 512-token window, in quarter steps
    assert factor == max(1.0, -(-4 * (out["prompt_tokens"] + 2) // 512) / 4) and factor > 1
    r = run("generate", "-m", str(tiny_dir), "--method", "rope", "-o", "factor=2", "-p", "one", "-n", "2", "--json")
    assert json.loads(r.stdout)["request_options"] == {}  # a fixed factor is among the options


def test_eval_grids_record_what_per_request_options_came_to(tiny_dir, tmp_path):
    """rope's factor and focusllm's chunk under auto follow each prompt's length: every sample says what they
    came to; an option given as a number is among the run's options only."""
    def samples(name, *args):
        r = run("eval", "passkey", "-m", str(tiny_dir), *args, "--depths", "0.5", "--samples", "1",
                "--out", str(tmp_path / name), "--json")
        assert r.exit_code == 0, r.output
        return json.loads(Path(json.loads(r.stdout)["json"]).read_text())["samples"]

    rope = samples("rope", "--method", "rope", "--lengths", "400,600")
    assert [s["request_options"]["rope"]["factor"] for s in rope] == [1.0, 1.25]  # tokens / the 512-token window
    focus = ["--method", "focusllm", "-o", "fragment=32", "-o", "local=128", "--lengths", "600"]
    # all the window holds: 512 less the fragment and the 7 new tokens a refreshed candidate reads after it
    assert samples("focus", *focus)[0]["request_options"] == {"focusllm": {"chunk": 473}}
    assert "request_options" not in samples("fixed", *focus, "-o", "chunk=100")[0]
    journal = [json.loads(line) for line in (tmp_path / "focus" / "passkey.samples.jsonl").read_text().splitlines()]
    assert journal[-1]["request_options"] == {"focusllm": {"chunk": 473}}


def test_demo_runs_every_inference_method_and_leaves_out_training_only_ones(tiny_dir):
    from lcx.registry import registry

    r = run("demo", "-m", str(tiny_dir), "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [row["method"] for row in rows] == ["none", "focusllm", "fot", "rope", "streaming", "vanilla"]
    assert "smt" in registry().methods  # installed, but training-only (sampling + loss): no demo row
    assert all(row["prompt_tokens"] > 512 for row in rows)  # 2x the tiny model's window
    # focusllm's and streaming's defaults (chunks of 2048 and 512) do not fit a 512-token window: those rows
    # say why and how to fix it, the others ran
    errors = {row["method"]: row["output"] for row in rows if row["seconds"] is None}
    assert sorted(errors) == ["focusllm", "streaming"], errors
    assert all(row["found"] is None and row["error"] for row in rows if row["seconds"] is None)  # not "not found"
    assert "-o focusllm.chunk=256 -o focusllm.fragment=64" in errors["focusllm"]
    assert "-o streaming.chunk=128" in errors["streaming"]


def test_each_demo_row_says_why_it_found_or_missed_the_key(tiny_dir):
    """The key in the middle of 2x the window: vanilla cut it with the middle and streaming evicted it (both
    not read), the bare model read it past its window; a row that read the key and missed says so."""
    r = run("demo", "-m", str(tiny_dir), "--json", "--method", "none", "--method", "vanilla", "--method", "streaming",
            "--method", "fot", "-o", "streaming.chunk=128")
    assert r.exit_code == 0, r.output
    why = {row["method"]: row["why"] for row in json.loads(r.stdout)}
    assert "cut with the middle of the prompt" in why["vanilla"] and not why["vanilla"].startswith("read,")
    assert "was evicted before the question (it forgets the middle by design)" in why["streaming"]
    assert "past its 512-token window" in why["none"]
    assert "the key was in memory" in why["fot"] and "tokens from the end: only layers" in why["fot"]
    found = {row["method"]: row["found"] for row in json.loads(r.stdout)}
    assert why["fot"].startswith("read, but not answered: ") != found["fot"]  # a tiny random model, either way


def test_reach_follows_where_the_key_sits(llama):
    """Each method's reach against spans on either side of what it keeps."""
    import lcx

    model = llama
    with lcx.attach(model, []) as run:
        n, w = 2048, run.window
    with lcx.attach(model, ["vanilla"]) as run:
        head, tail = run.methods[0].keep(n, w - 8)
        assert run.methods[0].reach(run, n, 8, (head - 10, head - 2))[0]
        assert not run.methods[0].reach(run, n, 8, (head + 1, head + 9))[0]
        assert run.methods[0].reach(run, n, 8, (tail, tail + 8))[0]
    with lcx.attach(model, ["streaming"], chunk=64, window=128) as run:
        assert run.methods[0].reach(run, n, 8, (n - 100, n - 92))[0]
        assert not run.methods[0].reach(run, n, 8, (n - 200, n - 192))[0]
        assert run.methods[0].reach(run, n, 8, (1, 3))[0]  # among the sinks
    with lcx.attach(model, ["rope"], factor=4.0) as run:
        assert run.methods[0].reach(run, 4 * w - 8, 8, (0, 8))[0] and not run.methods[0].reach(run, 4 * w, 8, (0, 8))[0]
    with lcx.attach(model, ["focusllm"], chunk=128, local=256, fragment=32) as run:
        ok, line = run.methods[0].reach(run, 1024, 8, (300, 308))
        assert ok and "memory chunk 3 of 6" in line and "best" not in line
    with lcx.attach(model, ["focusllm"], chunk=128, local=256, fragment=32, topk=2) as run:
        assert run.methods[0].reach(run, 1024, 8, (300, 308))[1].endswith(
            "; each query head reads only the best 2 of these 6 candidates")


def test_demo_rows_take_the_options_their_errors_suggest(tiny_dir):
    r = run("demo", "-m", str(tiny_dir), "--json", "--method", "focusllm", "--method", "streaming", "--method", "fot")
    first = {row["method"]: row for row in json.loads(r.stdout)}
    hints = re.findall(r"-o (\S+=\d+)", first["focusllm"]["output"] + first["streaming"]["output"])
    assert len(hints) == 4, hints  # focusllm chunk, fragment, local; streaming chunk
    r = run("demo", "-m", str(tiny_dir), "--json", "--method", "focusllm", "--method", "streaming", "--method", "fot",
            *(x for h in hints for x in ("-o", h)))
    assert r.exit_code == 0, r.output
    rows = {row["method"]: row for row in json.loads(r.stdout)}
    assert all(row["seconds"] is not None for row in rows.values()), rows  # the rows ran this time
    assert rows["focusllm"]["options"] == {"chunk": "256", "fragment": "64", "local": "256"}
    assert rows["streaming"]["options"] == {"chunk": "128"} and rows["fot"]["options"] == {}


def test_a_demo_row_runs_over_the_adapter_given_for_its_method(tiny_dir, tmp_path):
    """--adapter focusllm=DIR: that row reads the model with the adapter and the options it was trained with (here
    ones that fit the tiny 512-token window, which focusllm's defaults do not: without the adapter the row is an
    error); the other rows run without it."""
    from lcx.adapters.peft_bridge import random_adapter
    from lcx.models import load_model

    fits = {"chunk": 256, "fragment": 64, "local": 256}
    adapter = random_adapter(load_model(str(tiny_dir))[0], tmp_path / "ad", seed=3, scale=0.5,
                             roles=("q", "k", "v", "o"), methods=[{"name": "focusllm", "options": fits}])
    side = json.loads((adapter / "lcx.json").read_text())  # as `lcx train -o ...` records them: chunk included
    side["training"] = {"options": {"focusllm": {k: str(v) for k, v in fits.items()}}}
    (adapter / "lcx.json").write_text(json.dumps(side))
    args = ["demo", "-m", str(tiny_dir), "--json", "--method", "none", "--method", "focusllm", "--method", "fot"]
    bare = {row["method"]: row for row in json.loads(run(*args).stdout)}
    assert bare["focusllm"]["seconds"] is None and bare["focusllm"]["adapter"] is None  # defaults do not fit
    r = run(*args, "--adapter", f"focusllm={adapter}")
    assert r.exit_code == 0, r.output
    rows = {row["method"]: row for row in json.loads(r.stdout)}
    assert rows["focusllm"]["seconds"] is not None and rows["focusllm"]["adapter"] == str(adapter)
    assert rows["focusllm"]["options"] == {} and "memory chunk" in rows["focusllm"]["why"]
    assert {k: rows["focusllm"]["ran_with"]["focusllm"][k] for k in fits} == fits  # the trained options it ran with
    assert rows["none"]["ran_with"] == {} and rows["fot"]["ran_with"]["fot"]["local"] == 512  # local=auto: the window
    assert rows["none"]["adapter"] is None and rows["fot"]["adapter"] is None
    assert [rows[m]["output"] for m in ("none", "fot")] == [bare[m]["output"] for m in ("none", "fot")]


@pytest.mark.parametrize("given, needle", [
    ("focusllm", "is not METHOD=DIR"),
    ("smt={ad}", "an adapter for 'smt', which the demo does not run"),
    ("nope={ad}", "an adapter for 'nope': no installed method has that name"),
    ("none={ad}", "that row is the bare model"),
    ("focusllm={missing}", "does not exist"),
    ("focusllm={smt}", "was trained with smt, not focusllm alone; give it to that method's row (--adapter smt=...)"),
])
def test_demo_refuses_an_adapter_it_cannot_apply_before_the_first_row(tiny_dir, tmp_path, given, needle):
    from lcx.adapters.peft_bridge import random_adapter
    from lcx.models import load_model

    smt = random_adapter(load_model(str(tiny_dir))[0], tmp_path / "smt", seed=0) if "{smt}" in given else None
    r = run("demo", "-m", str(tiny_dir), "--adapter", given.format(ad=tmp_path, missing=tmp_path / "missing", smt=smt),
            "-o", "focusllm.chunk=256")
    assert r.exit_code != 0 and needle in r.output and "[demo]" not in r.output, r.output


@pytest.mark.parametrize("option, needle", [
    ("chunk=128", "names no method; give METHOD.KEY=VALUE"),
    ("smt.beta=0", "options for 'smt', which the demo does not run"),
    ("nope.x=1", "no installed method has that name"),
])
def test_demo_refuses_options_it_cannot_apply(tiny_dir, option, needle):
    r = run("demo", "-m", str(tiny_dir), "--json", "-o", option)
    assert r.exit_code != 0 and needle in r.output, r.output
