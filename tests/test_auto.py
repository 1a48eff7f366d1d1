"""Options measured on the model itself (lcx.auto): fot's memory_layers=auto by retrieval analysis, measured once
per model, cached beside it, trusted only for the same model files and lcx version; an explicit option wins."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

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


def test_explicit_options_win_and_nothing_is_measured(folder, probes):
    model, _ = load_model(str(folder))
    with lcx.attach(model, ["fot"], fot={"memory_layers": "0", "gate": 0.5}) as run:
        assert run.method("fot").layer_indices(run) == [0] and run.method("fot").gate_logit == 0.5
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


def test_a_comparison_measures_each_stacks_auto_options_when_that_stack_runs(tmp_path, probes):
    from lcx.evals.compare import check_stacks, compare

    # 8 layers: auto's unmeasured rule is layers 2,4,6; the measurement (stubbed) finds 1, where head 1:0 is
    model, _ = load_model(str(make_tiny_model_dir(tmp_path / "llama", max_position_embeddings=512,
                                                  num_hidden_layers=8)))
    measured_by_then = []

    def evaluate(run, adapter):
        measured_by_then.append(list(probes))
        return {"layers": run.method("fot").layer_indices(run) if run.methods else None}

    fot = {"gate": "off", "memory_heads": "1:0"}
    results = compare(model, ["none", "fot"], {"fot": fot}, evaluate, log=lambda line: None)
    assert measured_by_then == [[], [512]]  # the stacks' check before "none" measured nothing
    assert results["fot"]["layers"] == [1]  # the measured layers, which hold head 1:0
    with pytest.raises(lcx.LcxError, match="memory_heads: head 1:9 out of range"):
        check_stacks(model, ["fot"], {"fot": {**fot, "memory_heads": "1:9"}})  # what needs no measuring is checked


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
    # an engine in another dtype than the attach's (the tests load in float32) is served what that dtype measures
    export_for_vllm(str(folder), ["fot"], out=tmp_path / "y", dtype="bfloat16")
    assert probes == [512, 512]


def test_lcx_methods_on_a_model_shows_what_auto_comes_to_there(folder, probes, tmp_path):
    from click.testing import CliRunner

    from lcx.cli import main

    def on(path, dtype: str = "float32") -> dict:
        asked = ["--dtype", dtype] if dtype != "float32" else []
        r = CliRunner().invoke(main, ["methods", "-m", str(path), "--json", *asked])
        assert r.exit_code == 0, r.output
        listing = json.loads(r.stdout)
        assert listing["dtype"] == dtype  # the tests' LCX_DTYPE unless --dtype says otherwise
        return {m["name"]: m["on_model"] for m in listing["methods"]}

    llama = on(folder)
    gate = json.loads((folder / auto.AUTO_FILE).read_text())["entries"]["fot.gate"]["value"]["gate"]  # calibrated
    assert llama["fot"] == {"memory_layers": "1", "gate": -1.0 if gate is None else gate, "local": 512}
    assert probes == [512]  # measured, then cached beside it
    assert llama["vanilla"] == {"window": 512}
    assert "streaming.chunk=" in llama["streaming"]["error"]  # its default chunk (512) fills this window: said, listed
    assert "512" in llama["rope"]["factor"] and llama["smt"] == {}
    gemma = make_tiny_model_dir(tmp_path / "gemma", family="gemma3_text", max_position_embeddings=512)
    assert on(gemma)["fot"]["memory_layers"] == "1" and probes == [512]  # its full-attention layer
    assert on(folder, "bfloat16")["fot"]["memory_layers"] == "1" and probes == [512, 512]  # measured in that dtype too


# ---------------------------------------------------------------------- fot's gate=auto (calibrate.py)
def test_the_gate_chosen_is_the_largest_that_leaves_every_answer_token_enough_open_heads():
    from lcx.plugins.fot.calibrate import choose_gate

    m = torch.full((2, 4, 3), -5.0)  # (layers, heads, answer tokens)
    m[0, :, 0], m[1, :3, 1], m[:, :2, 2] = 3.0, 1.5, 2.5  # token 0: 4 heads at 3; token 1: 3 at 1.5; token 2: 4 at 2.5
    gates = [-1.0, 0.0, 1.0, 2.0, 3.0]
    assert choose_gate([m], gates, min_open=3) == 1.0  # 2 would leave token 1 with none
    assert choose_gate([m], gates, min_open=4) is None  # token 1 never has 4 heads above -5
    assert choose_gate([m, torch.full((2, 4, 2), 9.0)], gates, min_open=3) == 1.0  # every probe counts
    assert choose_gate([torch.empty(0, 0, 2)], gates, min_open=1) is None  # no probe reached memory


def test_only_the_probes_fot_answered_choose_the_gate(monkeypatch):
    from lcx.plugins.fot import calibrate

    probe = {**calibrate.GATE_PROBE, "depths": [0.1, 0.25, 0.4], "gates": [-1.0, 0.0, 1.0], "min_open": 2}
    wide, narrow = torch.full((1, 4, 2), 1.5), torch.full((1, 4, 2), -3.0)  # every head open at 1 / none at -1
    script = iter([(wide, [1], True), (narrow, [7], False), (wide, [2], True)])
    monkeypatch.setattr(calibrate, "probe_margins", lambda *a: next(script))
    tokenizer = SimpleNamespace(decode=lambda ids, **kw: " " + "".join(map(str, ids)))
    found = calibrate.calibrate_gate(None, tokenizer, {}, 256, probe, progress=False)
    assert found["gate"] == 1.0 and found["answered"] == 2  # the missed probe's closed heads do not pull it down
    assert [p["answered"] for p in found["probes"]] == [True, False, True] and found["probes"][1]["output"] == " 7"
    script = iter([(wide, [7], False)] * 3)
    assert calibrate.calibrate_gate(None, tokenizer, {}, 256, probe, progress=False)["gate"] is None  # none answered
    script = iter([(narrow, [1], True)] + [(wide, [7], False)] * 2)  # answered, but every gate shuts its heads
    assert calibrate.calibrate_gate(None, tokenizer, {}, 256, probe, progress=False)["gate"] == "off"


def test_a_probes_margins_are_those_at_the_queries_that_wrote_its_answer(folder):
    """The margins recorded while fot answers equal those of the prompt and answer read at once (teacher forced),
    at the queries that predicted each answer token."""
    import lcx
    from lcx.evals.passkey import prompt_and_needle
    from lcx.generation import generate
    from lcx.plugins.fot.calibrate import probe_margins

    model, tokenizer = load_model(str(folder))
    opts = {"local": 128, "chunk": 64, "sinks": 0, "memory_layers": "0,1"}
    margins, new, _ = probe_margins(model, tokenizer, opts, 256, 0.1, 12345)
    ids, _ = prompt_and_needle(tokenizer, 256, 0.1, 12345)
    with lcx.attach(model, ["fot"], fot={**opts, "gate": "off"}) as run:
        run.method("fot").record_margins = {}
        generate(run, torch.cat([ids, torch.tensor(new[:-1], dtype=torch.long)])[None], max_new_tokens=1)
        recorded = run.method("fot").record_margins
    forced = torch.stack([torch.cat(b, dim=-1)[:, -len(new):] for _, b in sorted(recorded.items())])
    assert margins.shape[:2] == (2, model.config.num_attention_heads) and margins.shape[-1] == len(new) > 1
    # aligned to the queries that predicted each token (one step off is far); not exact, since one long read
    # splits the text into other windows than the prompt's, and so moves other tokens into memory
    assert torch.allclose(margins, forced, atol=2e-3)
    assert not torch.allclose(margins[..., 1:], forced[..., :-1], atol=2e-3)


def test_memory_attention_records_the_margin_its_gate_thresholds():
    from lcx.plugins.fot.attention import memory_attention
    from lcx.plugins.fot.cache import add_to_memory
    from lcx.plugins.fot.memory import make_store

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, S, D, M = 1, 4, 2, 5, 7, 16, 12
    q, k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    memory = {(0, h): make_store() for h in range(Hkv)}
    mk = torch.randn(Hkv, M, D, generator=g) * 2
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2) / D)
    add_to_memory(memory, 0, mk, torch.randn(Hkv, M, D, generator=g), torch.arange(M), inv_freq, doc_id=0)
    mask = torch.zeros(1, 1, T, S)
    recorded: list = []
    run = lambda gate, margins=None: memory_attention(q, k, v, mask, memory, torch.zeros(B, T), inv_freq,  # noqa: E731
                                                      D ** -0.5, M, False, 2, gate, None, None, margins)
    run(None, recorded)
    margins = torch.cat(recorded, dim=-1)  # (H, T), two blocks of 2 queries and one of 1
    kv = torch.arange(H) // (H // Hkv)
    stored = torch.stack([memory[(0, h)].keys for h in range(Hkv)])  # un-rotated; the queries' shift is 0
    want = (torch.einsum("htd,hmd->htm", q[0], stored[kv]).amax(-1)
            - torch.einsum("htd,hsd->hts", q[0], k[0, kv]).amax(-1)) * D ** -0.5
    assert margins.shape == (H, T) and torch.allclose(margins, want, atol=1e-5)
    # a gate just above a head's margin shuts its memory: its output is the local keys' alone
    h, t = divmod(int(margins.argmax()), T)
    shut, local_only = run(float(margins[h, t]) + 1e-3), run(1e9)
    assert torch.allclose(shut[0, t, h], local_only[0, t, h]) and not torch.allclose(run(None)[0, t, h], local_only[0, t, h])


def test_gate_auto_calibrates_on_probes_once_caches_it_and_an_explicit_gate_wins(folder, probes, capsys):
    from lcx.plugins.fot.calibrate import GATE_PROBE
    from lcx.plugins.fot.method import GATE_RULE

    model, _ = load_model(str(folder))
    opts = {"gate": "auto", "local": 128, "chunk": 64, "sinks": 0}
    with lcx.attach(model, ["fot"], fot=opts) as run:
        gate = run.method("fot").gate
    entry = json.loads((folder / auto.AUTO_FILE).read_text())["entries"]["fot.gate"]
    found = entry["value"]
    assert entry["inputs"]["length"] == 256 and entry["inputs"]["fot"]["memory_layers"] == "1"  # measured with auto's layers
    assert len(found["probes"]) == len(GATE_PROBE["depths"]) * GATE_PROBE["keys"]
    answered = [p for p in found["probes"] if p["answered"]]  # a random model seldom writes the key: often none
    assert found["answered"] == len(answered)
    fits = [g for g in GATE_PROBE["gates"]
            if answered and all(p["weakest_token_open_pairs"][str(g)] >= GATE_PROBE["min_open"] for p in answered)]
    want = max(fits) if fits else ("off" if answered else None)  # answered, no gate keeps its heads: off
    assert found["gate"] == want
    assert gate == (want if want is not None else GATE_RULE)  # none answered: auto's fallback
    err = capsys.readouterr().err
    assert "fot.gate=auto: measuring it on this model" in err and "fot: gate " in err
    with lcx.attach(model, ["fot"], fot=opts):  # cached: not measured again
        assert "measuring" not in capsys.readouterr().err
    with lcx.attach(model, ["fot"], fot={**opts, "gate": 1.5}) as run:
        assert run.method("fot").gate == 1.5


def test_gate_auto_is_the_default_and_where_nothing_is_calibrated_reads_by_the_fallback_gate():
    from lcx.plugins.fot.method import GATE_RULE, FoT

    assert FoT.from_options().gate == "auto" and FoT.from_options().gate_logit == GATE_RULE == -1.0  # no folder


def test_a_gate_entry_edited_into_nonsense_is_measured_again(folder, probes, capsys):
    model, _ = load_model(str(folder))
    opts = {"gate": "auto", "local": 128, "chunk": 64, "sinks": 0}
    with lcx.attach(model, ["fot"], fot=opts):
        pass
    path = folder / auto.AUTO_FILE
    data = json.loads(path.read_text())
    data["entries"]["fot.gate"]["value"] = "high"
    path.write_text(json.dumps(data))
    auto._said.clear()
    capsys.readouterr()
    with lcx.attach(model, ["fot"], fot=opts) as run:
        gate = run.method("fot").gate
    err = capsys.readouterr().err
    assert "fot.gate in" in err and "holds 'high', not a value lcx writes; measuring it again" in err
    found = json.loads(path.read_text())["entries"]["fot.gate"]["value"]
    assert isinstance(found, dict) and gate == (found["gate"] if found["gate"] is not None else -1.0)
    if found["gate"] is None:
        assert "gate calibration: fot answered none of its passkey probes; gate -1 (auto's fallback)" in err


def test_an_option_measured_under_other_inputs_keeps_its_earlier_measurements(folder):
    calls: list[int] = []

    def at(n: int) -> int:
        def measure() -> int:
            calls.append(n)
            return 10 * n
        return auto.measured(folder, "fot.gate", {"length": n}, measure, lambda v: f"{v}", log=lambda line: None)

    assert [at(n) for n in range(auto.KEPT + 1)] == [10 * n for n in range(auto.KEPT + 1)]
    assert [at(n) for n in range(1, auto.KEPT + 1)] == [10 * n for n in range(1, auto.KEPT + 1)]  # all cached
    assert calls == list(range(auto.KEPT + 1))
    assert at(0) == 0 and calls[-1] == 0  # the oldest was dropped: measured again
    entry = json.loads((folder / auto.AUTO_FILE).read_text())["entries"]["fot.gate"]
    assert entry["inputs"] == {"length": 0} and len(entry["earlier"]) == auto.KEPT - 1


def test_a_measurement_is_kept_per_dtype_the_model_computes_in(folder, probes):
    """A model loaded in another dtype is measured again, not given the other dtype's values; both are kept."""
    def layers(dtype) -> str:
        model, _ = load_model(str(folder), dtype=dtype)
        with lcx.attach(model, ["fot"]) as run:
            return run.method("fot").memory_layers

    assert layers("bfloat16") == "1" and probes == [512]
    assert layers("float32") == "1" and probes == [512, 512]  # measured again in float32
    entry = json.loads((folder / auto.AUTO_FILE).read_text())["entries"]["fot.memory_layers"]
    assert entry["inputs"]["dtype"] == "float32" and entry["earlier"][0]["inputs"]["dtype"] == "bfloat16"
    assert layers("bfloat16") == "1" and probes == [512, 512]  # each dtype's measurement reused


def test_gate_auto_coming_to_off_drops_gate_sinks_false_and_says_so(folder, probes, monkeypatch, capsys):
    monkeypatch.setattr("lcx.plugins.fot.calibrate.calibrate_gate",
                        lambda *a, **k: {"gate": "off", "answered": 1, "probes": [{}]})
    model, _ = load_model(str(folder))
    with lcx.attach(model, ["fot"], fot={"gate": "auto", "gate_sinks": False, "local": 128}) as run:
        fot = run.method("fot")
        assert fot.gate == "off"
        type(fot).from_options(**fot.to_options())  # the served form rebuilds it from its options
    assert "gate off chosen by calibration" in (err := capsys.readouterr().err)
    assert "gate_sinks=false dropped: it has no effect without a gate" in err
    auto._said.clear()
    with lcx.attach(model, ["fot"], fot={"gate": "auto", "local": 128}):
        assert "gate_sinks" not in capsys.readouterr().err


def test_one_fot_instance_calibrates_each_model_with_the_gate_sinks_asked(tmp_path, probes, monkeypatch):
    """gate=auto coming to off on one model drops gate_sinks=false there only: the same instance attached to
    another model calibrates with the option as given."""
    from lcx.plugins.fot.method import FoT

    seen = []

    def calibrate(model, tokenizer, options, length, probe):
        seen.append(options["gate_sinks"])
        return {"gate": "off" if len(seen) == 1 else 0.5, "answered": 1, "probes": [{}]}

    monkeypatch.setattr("lcx.plugins.fot.calibrate.calibrate_gate", calibrate)
    fot = FoT.from_options(gate="auto", gate_sinks="false", local=128)
    for name in ("a", "b"):
        model, _ = load_model(str(make_tiny_model_dir(tmp_path / name, max_position_embeddings=512, seed=len(seen))))
        with lcx.attach(model, [fot]):
            pass
    assert seen == [False, False] and (fot.gate, fot.gate_sinks) == (0.5, False)
