"""`lcx export --for vllm`: what plain vLLM loads must equal what lcx's Hugging Face path runs.

No vLLM engine here (tests/serve/ starts them): these check the exported folder with
transformers, and every refusal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

import lcx
from lcx.adapters.peft_bridge import random_adapter
from lcx.cli import main
from lcx.errors import LcxError
from lcx.integrations.vllm import export_for_vllm
from tests.helpers import make_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny")


def _adapter(model_dir: Path, out: Path, seed: int = 1, methods=({"name": "smt", "options": {}},), **lora) -> Path:
    return random_adapter(AutoModelForCausalLM.from_pretrained(str(model_dir)), out, seed, methods=list(methods), **lora)


def test_rope_export_equals_the_rope_method(model_dir, tmp_path):
    exp = export_for_vllm(str(model_dir), ["rope"], {"rope": {"type": "yarn", "factor": "4"}}, out=tmp_path / "x")
    cfg = json.loads((exp.model_dir / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == "yarn" and cfg["rope_parameters"]["factor"] == 4.0
    assert exp.max_model_len == 4 * 128 and exp.window == 128
    ids = torch.randint(3, 100, (1, 300), generator=torch.Generator().manual_seed(0))
    exported = AutoModelForCausalLM.from_pretrained(str(exp.model_dir)).eval()
    base = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    with lcx.attach(base, ["rope"], type="yarn", factor=4.0), torch.no_grad():
        want = base(ids).logits
    with torch.no_grad():
        got = exported(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (exp.model_dir / "model.safetensors").is_symlink()  # weights linked, never copied
    assert json.loads((exp.model_dir / "lcx.json").read_text())["methods"][0]["name"] == "rope"


def test_adapters_export_as_plain_lora_with_their_methods(model_dir, tmp_path):
    a1 = _adapter(model_dir, tmp_path / "a1", seed=1)
    a2 = _adapter(model_dir, tmp_path / "a2", seed=2)
    exp = export_for_vllm(str(model_dir), adapters={"first": a1, "second": a2}, out=tmp_path / "x")
    assert sorted(exp.adapters) == ["first", "second"] and exp.max_lora_rank == 8
    assert [m["name"] for m in exp.methods] == ["smt"]  # from the adapters' sidecars
    for name, src in (("first", a1), ("second", a2)):
        cfg = json.loads((exp.adapters[name] / "adapter_config.json").read_text())
        assert cfg["base_model_name_or_path"] == str(exp.model_dir)
        assert sorted(cfg["target_modules"]) == ["k_proj", "q_proj"]
        assert (exp.adapters[name] / "adapter_model.safetensors").read_bytes() == \
            (src / "adapter_model.safetensors").read_bytes()
    manifest = json.loads((exp.out / "lcx-export.json").read_text())
    assert manifest["adapters"]["first"] == str(exp.adapters["first"])


def test_beyond_the_window_raises_the_rotary_table_only_with_a_note(model_dir, tmp_path):
    notes = []
    exp = export_for_vllm(str(model_dir), adapters={"a": _adapter(model_dir, tmp_path / "a")}, out=tmp_path / "x",
                          max_model_len=512, log=notes.append)
    assert json.loads((exp.model_dir / "config.json").read_text())["max_position_embeddings"] == 512
    assert exp.max_model_len == 512 and "beyond the model's trained window (128)" in notes[0]
    with pytest.raises(LcxError, match=r"exceeds what the stretched rope covers \(256\)"):
        export_for_vllm(str(model_dir), ["rope"], {"rope": {"factor": "2"}}, out=tmp_path / "y", max_model_len=300)


def test_a_method_without_a_serving_kind_is_refused_by_name(model_dir, tmp_path, monkeypatch):
    """Every in-tree method is servable; a method that says it is not (a third-party one, here focusllm
    made so) is refused with its reason, by --method or through an adapter trained with it."""
    from lcx.plugins.focusllm import FocusLLM

    monkeypatch.setattr(FocusLLM, "serving", "")
    monkeypatch.setattr(FocusLLM, "not_served_because", "no reason")
    with pytest.raises(LcxError, match=r"method 'focusllm' \(--method\) cannot be served through vLLM yet \(no reason\)"):
        export_for_vllm(str(model_dir), ["focusllm"], out=tmp_path / "x")
    assert not (tmp_path / "x").exists()
    a = _adapter(model_dir, tmp_path / "a", methods=({"name": "focusllm", "options": {}},))
    with pytest.raises(LcxError, match=r"method 'focusllm' \(a\) cannot be served"):
        export_for_vllm(str(model_dir), adapters={"a": a}, out=tmp_path / "x")


def test_focusllm_is_served_with_its_prompts_candidates_and_its_adapters_in_the_middleware(model_dir, tmp_path):
    """Served focusllm keeps the prompt's candidates (refresh=0: refused otherwise, before anything is
    written); its adapters (candidate projections, which vLLM's LoRA would apply to every token) are applied
    by lcx's request middleware: served as names of the base model, mapped to their adapter for it."""
    from lcx.integrations.vllm import KV_CONNECTOR, served_methods, vllm_command

    with pytest.raises(LcxError, match=r"serve it with -o focusllm.refresh=0"):
        export_for_vllm(str(model_dir), ["focusllm"], out=tmp_path / "x")
    assert not (tmp_path / "x").exists()
    a = _adapter(model_dir, tmp_path / "a", methods=({"name": "focusllm", "options": {}},))
    opts = {"focusllm": {"refresh": "0", "chunk": "64", "local": "32", "fragment": "16"}}
    exp = export_for_vllm(str(model_dir), ["focusllm"], opts, adapters={"cand": a}, out=tmp_path / "x")
    # its state (the candidates' keys/values) lives in vLLM's own KV cache: no lcx-held state caps concurrency
    assert [m["name"] for m in exp.methods] == ["focusllm"] and exp.max_concurrent == 0
    assert exp.adapters == {} and list(exp.middleware_adapters) == ["cand"]
    cmd = vllm_command(exp, "127.0.0.1", 8000, "m", "float32", None)
    # vLLM's own model code and attention, lcx's KV connector loading the candidates, prefix caching on (the
    # middleware salts each placeholder request: tests/test_vllm_requests.py)
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1]) == KV_CONNECTOR
    assert "--model-impl" not in cmd and "--logits-processors" not in cmd and "--enable-prefix-caching" in cmd
    assert cmd[cmd.index("--served-model-name") + 1:][:2] == ["m", "cand"] and "--enable-lora" not in cmd
    table = served_methods(exp, "m")
    assert "adapter" not in table["m"][0] and table["cand"][0]["adapter"] == str(exp.middleware_adapters["cand"])
    assert (exp.middleware_adapters["cand"] / "adapter_model.safetensors").exists()


def test_a_focusllm_adapters_recorded_chunk_is_served_only_when_its_training_was_given_it(model_dir, tmp_path):
    """The chunk a sidecar records is the default of the day it was trained (training never reads it): the
    server takes today's (auto) instead, as lcx generate does, unless lcx train was given the chunk."""
    opts = {"focusllm": {"refresh": "0", "local": "32", "fragment": "16"}}
    recorded = ({"name": "focusllm", "options": {"chunk": 64, "local": 32, "fragment": 16, "refresh": 0}},)
    served = {}
    for name, methods, given in (("plain", ({"name": "focusllm", "options": {}},), None), ("recorded", recorded, None),
                                 ("given", recorded, {"focusllm": {"chunk": "64"}})):
        a = _adapter(model_dir, tmp_path / name, methods=methods)
        if given is not None:  # as lcx train writes it: the options the user gave (as typed), beside the resolved ones
            side = json.loads((a / "lcx.json").read_text())
            (a / "lcx.json").write_text(json.dumps({**side, "training": {"options": given}}))
        exp = export_for_vllm(str(model_dir), ["focusllm"], opts, adapters={"a": a}, out=tmp_path / f"x-{name}")
        served[name] = exp.methods[0]["options"]["chunk"]
    assert served["plain"] == served["recorded"] == "auto" and served["given"] == 64


@pytest.mark.parametrize("lora, what", [
    ({"modules_to_save": ["o_proj"]}, "modules_to_save"),
])
def test_adapters_vllm_cannot_load_are_refused(model_dir, tmp_path, lora, what):
    a = _adapter(model_dir, tmp_path / "a", **lora)
    with pytest.raises(LcxError, match=rf"uses {what}.*vLLM's LoRA loader refuses"):
        export_for_vllm(str(model_dir), adapters={"a": a}, out=tmp_path / "x")


def test_dora_and_bias_in_the_config_are_refused(model_dir, tmp_path):
    a = _adapter(model_dir, tmp_path / "a")
    cfg_path = a / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(LcxError, match="uses DoRA"):
        export_for_vllm(str(model_dir), adapters={"a": a}, out=tmp_path / "x")
    cfg_path.write_text(json.dumps({**cfg, "bias": "all"}))
    with pytest.raises(LcxError, match="trains biases"):
        export_for_vllm(str(model_dir), adapters={"a": a}, out=tmp_path / "x")
    cfg_path.write_text("{not json")
    with pytest.raises(LcxError, match=r"adapter_config.json' is corrupted"):
        export_for_vllm(str(model_dir), adapters={"a": a}, out=tmp_path / "x")


def test_adapter_for_another_base_is_refused(model_dir, tmp_path):
    other = make_tiny_model_dir(tmp_path / "other", seed=7)
    a = _adapter(other, tmp_path / "a")
    with pytest.raises(LcxError, match="trained for another base model"):
        export_for_vllm(str(model_dir), adapters={"a": a}, out=tmp_path / "x")


def test_adapters_with_different_rope_cannot_share_a_server(model_dir, tmp_path):
    a = _adapter(model_dir, tmp_path / "a", methods=({"name": "rope", "options": {"factor": 2.0}},))
    b = _adapter(model_dir, tmp_path / "b", methods=({"name": "rope", "options": {"factor": 4.0}},))
    with pytest.raises(LcxError, match="different rope options; serve them from two servers"):
        export_for_vllm(str(model_dir), adapters={"a": a, "b": b}, out=tmp_path / "x")


def test_cli_export_json_and_errors(model_dir, tmp_path):
    a = _adapter(model_dir, tmp_path / "a")
    r = CliRunner().invoke(main, ["export", "--for", "vllm", "-m", str(model_dir), "--adapter", f"mine={a}",
                                  "--out", str(tmp_path / "x"), "--json"])
    assert r.exit_code == 0, r.output
    assert list(json.loads(r.output)["adapters"]) == ["mine"]
    r = CliRunner().invoke(main, ["export", "-m", str(model_dir), "--adapter", str(a), "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "exists and is not empty; pass --overwrite" in r.output
    r = CliRunner().invoke(main, ["export", "-m", str(model_dir), "--out", str(tmp_path / "x"), "--overwrite"])
    assert r.exit_code == 0 and not (tmp_path / "x" / "adapters").exists()  # an earlier export is replaced whole
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    r = CliRunner().invoke(main, ["export", "-m", str(model_dir), "--out", str(mine), "--overwrite"])
    assert r.exit_code == 2 and "holds no lcx export (lcx-export.json); --overwrite replaces an earlier export only" in r.output
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]  # kept as it was
    r = CliRunner().invoke(main, ["export", "-m", str(model_dir), "--adapter", f"a={a}", "--adapter", f"a={a}",
                                  "--out", str(tmp_path / "y")])
    assert r.exit_code == 2 and "two adapters are named 'a'" in r.output
    r = CliRunner().invoke(main, ["export", "-m", str(model_dir), "--method", "rope", "-o", "rope.factor=x",
                                  "--out", str(tmp_path / "z")])
    assert r.exit_code == 2 and "rope.factor" not in r.output and "'x'" in r.output
    r = CliRunner().invoke(main, ["export", "-m", str(model_dir), "--method", "rope", "--max-model-len", "512",
                                  "--out", str(tmp_path / "r")])  # factor=auto: 512 / the window
    assert r.exit_code == 0 and "serve it: VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 python -m lcx.integrations.vllm serve" in r.output
    r = CliRunner().invoke(main, ["export", "-m", str(model_dir), "--method", "vanilla", "--out", str(tmp_path / "v")])
    assert r.exit_code == 0 and "serve it with `lcx serve MODEL --method vanilla ...`" in r.output  # not `vllm serve`


def test_options_for_an_unselected_method_are_refused(model_dir, tmp_path):
    with pytest.raises(LcxError, match="options for method 'rope', which is not selected \\(none\\); add --method rope"):
        export_for_vllm(str(model_dir), [], {"rope": {"factor": "4"}}, out=tmp_path / "x")
    with pytest.raises(LcxError, match="option 'factor' belongs to none of the selected methods"):
        export_for_vllm(str(model_dir), [], {"factor": "4"}, out=tmp_path / "x")


def test_user_options_override_the_adapters(model_dir, tmp_path):
    a = _adapter(model_dir, tmp_path / "a", methods=({"name": "rope", "options": {"factor": 2.0}},))
    exp = export_for_vllm(str(model_dir), [], {"rope": {"factor": "3"}}, adapters={"a": a}, out=tmp_path / "x")
    assert exp.methods == [{"name": "rope", "options": {"type": "yarn", "factor": 3.0}}] and exp.max_model_len == 384


# ---------------------------------------------------------------------- the vLLM plugin (no engine started)
def _sidecar(model_dir: Path, tmp_path: Path, sidecar: dict) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    for f in model_dir.iterdir():
        (d / f.name).symlink_to(f.resolve())
    (d / "lcx.json").write_text(json.dumps(sidecar))
    return d


def test_the_plugin_is_a_vllm_entry_point_and_registers_once(caplog):
    from importlib.metadata import entry_points

    from vllm.transformers_utils.config import get_config_parser

    from lcx.integrations import vllm as plugin

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "lcx"]
    assert ep.value == "lcx.integrations.vllm:register" and ep.load() is plugin.register
    plugin.register()
    first = type(get_config_parser("lcx"))
    plugin.register()  # vLLM calls it in every process: a second call changes nothing
    assert type(get_config_parser("lcx")) is first and "overwritten" not in caplog.text


def test_the_lcx_config_format_applies_the_sidecar_as_export_bakes_it(model_dir, tmp_path):
    from vllm.transformers_utils.config import get_config_parser

    from lcx.integrations.vllm import register

    register()
    rope = {"name": "rope", "options": {"type": "yarn", "factor": 4}}
    d = _sidecar(model_dir, tmp_path, {"methods": [rope]})
    config_dict, config = get_config_parser("lcx").parse(d, trust_remote_code=False)
    baked = json.loads((export_for_vllm(str(model_dir), ["rope"], {"rope": rope["options"]}, out=tmp_path / "x")
                        .model_dir / "config.json").read_text())
    assert config_dict["rope_parameters"] == baked["rope_parameters"] == config.rope_parameters
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 4.0
    # an exported folder's sidecar says its config.json is baked: parsing it does not stretch twice
    config_dict, _ = get_config_parser("lcx").parse(tmp_path / "x" / "model", trust_remote_code=False)
    assert config_dict["rope_parameters"] == baked["rope_parameters"]


@pytest.mark.parametrize("sidecar,needle", [
    ({"methods": [{"name": "focusllm", "options": {"refresh": 0}}]}, "method 'focusllm' runs inside vLLM's attention"),
    ({"methods": [{"name": "fot"}]}, "method 'fot' runs inside vLLM's attention with engine settings `lcx serve` "
                                     "passes; serve it with `lcx serve MODEL --method fot`"),
    ({"methods": [{"name": "vanilla"}]}, "method 'vanilla' rewrites each prompt in lcx's request middleware, which "
                                         "plain `vllm serve` does not run; serve it with `lcx serve MODEL --method vanilla`"),
    ({"methods": [{"name": "rope", "options": {"factor": "lots"}}]}, "factor"),
    ({"methods": "rope"}, "'methods' must be a list"),
    ({"methods": [{"name": "warp"}]}, "warp"),
    ({"methods": [{"name": "rope", "opts": {"factor": 8}}]}, "keys \"name\" and \"options\" \\(an object\\) only"),
    ({"methods": [{"name": "rope", "options": "factor=8"}]}, "keys \"name\" and \"options\" \\(an object\\) only"),
    ({"methods": [{"name": "rope"}, {"name": "rope"}]}, "method 'rope' is named twice"),
    ({"methods": [{"name": "fot"}], "baked": True}, "method 'fot' runs inside vLLM's attention"),
])
def test_the_lcx_config_format_refuses_what_it_cannot_serve(model_dir, tmp_path, sidecar, needle):
    from vllm.transformers_utils.config import get_config_parser

    from lcx.integrations.vllm import register

    register()
    d = _sidecar(model_dir, tmp_path, sidecar)
    with pytest.raises(LcxError, match=needle) as e:
        get_config_parser("lcx").parse(d, trust_remote_code=False)
    assert str(d / "lcx.json") in str(e.value)
    (d / "lcx.json").unlink()
    with pytest.raises(LcxError, match="lcx.json' does not exist"):
        get_config_parser("lcx").parse(d, trust_remote_code=False)


def test_attention_methods_serve_through_the_transformers_backend_with_prompt_lengths(model_dir, tmp_path, monkeypatch):
    from lcx.integrations.vllm import vllm_command, vllm_env
    from lcx.integrations.vllm.attention import PROMPT_LENGTHS_FQCN
    from lcx.integrations.vllm.middleware import MODEL_ENV

    exp = export_for_vllm(str(model_dir), ["fot"], {"fot": {"k": 8}}, out=tmp_path / "x", max_model_len=512)
    cmd = vllm_command(exp, "127.0.0.1", 8000, "m", "float32", None)
    # prefix caching on: the served attention rebuilds a cached prefix's state (tests/test_vllm_attention.py)
    assert cmd[cmd.index("--model-impl") + 1] == "transformers" and "--enable-prefix-caching" in cmd
    assert cmd[cmd.index("--logits-processors") + 1] == PROMPT_LENGTHS_FQCN
    assert json.loads(vllm_env(exp, 1.0)[MODEL_ENV])["attention"]["options"]["k"] == 8
    # torch.compile's graphs would not call lcx's attention function: eager only, a compile request refused
    assert "--enforce-eager" in cmd
    with pytest.raises(LcxError, match="--no-enforce-eager: fot answers vLLM's attention .* leave the flag out"):
        vllm_command(exp, "127.0.0.1", 8000, "m", "float32", None, extra=("--no-enforce-eager",))
    plain = export_for_vllm(str(model_dir), ["rope"], out=tmp_path / "y", overwrite=True, max_model_len=512)
    assert "--model-impl" not in vllm_command(plain, "127.0.0.1", 8000, "m", "float32", None)
    assert vllm_command(plain, "127.0.0.1", 8000, "m", "float32", None, extra=("--no-enforce-eager",))[-1] == \
        "--no-enforce-eager"  # vLLM's own model code compiles as it is: the user's choice
    # refused when exporting, before anything is written
    with pytest.raises(LcxError, match="fot mode=multi is not how a server shares a memory .* with --memory PATH"):
        export_for_vllm(str(model_dir), ["fot"], {"fot": {"mode": "multi"}}, out=tmp_path / "z")
    with pytest.raises(LcxError, match="each replace vLLM's attention; serve one"):
        export_for_vllm(str(model_dir), ["fot", "streaming"], out=tmp_path / "w")
    assert not (tmp_path / "z").exists() and not (tmp_path / "w").exists()
    focus = export_for_vllm(str(model_dir), ["focusllm"], {"focusllm": {"refresh": "0", "chunk": "64", "local": "32",
                                                                          "fragment": "16", "topk": "3"}}, out=tmp_path / "f")
    env = vllm_env(focus, 1.0)
    spool = json.loads(env[MODEL_ENV])["spool"]  # where the middleware leaves candidates
    assert spool and Path(spool).is_dir() and Path(spool).parent == focus.out
    from lcx.integrations.vllm.attention import served_from_env

    monkeypatch.setenv(MODEL_ENV, env[MODEL_ENV])
    served = served_from_env()()  # what vLLM's worker builds: the served attention reads the 3 best candidates
    assert served.name == "focusllm" and served.topk == 3
    cmd = vllm_command(focus, "127.0.0.1", 8000, "m", "float32", None)  # only lcx's attention can pick them
    assert cmd[cmd.index("--model-impl") + 1] == "transformers" and "--kv-transfer-config" not in cmd
    assert "--no-enable-prefix-caching" in cmd  # every request's placeholders are the same ids
    plain = export_for_vllm(str(model_dir), ["focusllm"], {"focusllm": {"refresh": "0", "chunk": "64", "local": "32",
                                                                          "fragment": "16"}}, out=tmp_path / "g")
    monkeypatch.setenv(MODEL_ENV, vllm_env(plain, 1.0)[MODEL_ENV])
    assert served_from_env() is None  # without topk vLLM's own attention reads the candidates


def test_a_served_document_memory_is_checked_before_the_server_starts(model_dir, tmp_path, monkeypatch):
    """...and loaded only where vLLM runs the model (its API server and engine core load lcx's plugin too)."""
    import lcx.plugins.fot.memory as fot_memory
    from lcx.integrations.vllm import attention, vllm_env
    from lcx.integrations.vllm.attention import served_from_env
    from lcx.integrations.vllm.middleware import MODEL_ENV

    doc = tmp_path / "doc.txt"
    doc.write_text("the pass key is 4821. remember it. " * 10)
    r = CliRunner().invoke(main, ["memory", "build", "-m", str(model_dir), "-o", "local=16", "-o", "memory_layers=1",
                                  "--out", str(tmp_path / "mem"), str(doc)])
    assert r.exit_code == 0, r.output
    notes: list[str] = []
    exp = export_for_vllm(str(model_dir), ["fot"], {"fot": {"local": 16, "memory_layers": "1"}}, out=tmp_path / "x",
                          memory=tmp_path / "mem", log=notes.append)
    assert exp.memory == str((tmp_path / "mem").resolve()) and json.loads((tmp_path / "x" / "lcx-export.json").read_text())["memory"]
    assert not any("was built with" in n for n in notes), notes
    # served under other options than it was built with: the server says so (and serves it)
    export_for_vllm(str(model_dir), ["fot"], {"fot": {"local": 32, "memory_layers": "1"}}, out=tmp_path / "z",
                    memory=tmp_path / "mem", log=notes.append)
    assert any("was built with fot local=16, chunk=16, and is read with local=32, chunk=32" in n for n in notes), notes
    # local=0 on both sides: the model's window, which the server's instance is not yet attached to
    r = CliRunner().invoke(main, ["memory", "build", "-m", str(model_dir), "-o", "memory_layers=1",
                                  "--out", str(tmp_path / "mem-window"), str(doc)])
    assert r.exit_code == 0, r.output
    notes.clear()
    export_for_vllm(str(model_dir), ["fot"], {"fot": {"memory_layers": "1"}}, out=tmp_path / "w",
                    memory=tmp_path / "mem-window", log=notes.append)
    assert not any("was built with" in n for n in notes), notes
    loads = []
    load = fot_memory.load_memory
    monkeypatch.setattr(fot_memory, "load_memory", lambda *a, **k: loads.append(a) or load(*a, **k))
    monkeypatch.setenv(MODEL_ENV, vllm_env(exp, 1.0)[MODEL_ENV])
    build = served_from_env()  # what vLLM's plugin does in each of its processes
    assert not loads
    monkeypatch.setattr(attention, "_BUILD", build)
    monkeypatch.setattr(attention, "SERVED", None)
    attention.PromptLengths(None, torch.device("cpu"), False)  # what vLLM's model runner makes at its start
    assert len(loads) == 1 and attention.SERVED.name == "fot" and attention.SERVED.shared
    with pytest.raises(LcxError, match=r"needs a method that reads document memories \(fot\); add --method fot"):
        export_for_vllm(str(model_dir), ["streaming"], out=tmp_path / "y", memory=tmp_path / "mem")
    with pytest.raises(LcxError, match="is not an lcx memory folder"):
        export_for_vllm(str(model_dir), ["fot"], out=tmp_path / "y", memory=tmp_path)
    with pytest.raises(LcxError, match=r"holds memory layers 1, and fot here reads layers 0 .*fot.memory_layers=1"):
        export_for_vllm(str(model_dir), ["fot"], {"fot": {"local": 16, "memory_layers": "0"}}, out=tmp_path / "y",
                        memory=tmp_path / "mem")
    other = make_tiny_model_dir(tmp_path / "other", seed=1)
    with pytest.raises(LcxError, match=r"was built with another model \(embedding_sha256"):
        export_for_vllm(str(other), ["fot"], out=tmp_path / "y", memory=tmp_path / "mem")
    tensors = tmp_path / "mem" / "memory.safetensors"  # truncated: refused here, not by vLLM's worker after its start
    tensors.write_bytes(tensors.read_bytes()[:-8])
    with pytest.raises(LcxError, match=r"--memory: memory file .* is corrupted or truncated"):
        export_for_vllm(str(model_dir), ["fot"], {"fot": {"local": 16, "memory_layers": "1"}}, out=tmp_path / "y",
                        memory=tmp_path / "mem")
    assert not (tmp_path / "y").exists()


def test_the_state_of_served_memory_methods_bounds_the_requests_run_at_once(model_dir, tmp_path, monkeypatch):
    """streaming/fot keep per-request state outside vLLM's KV cache: --state-gib / the per-request bound is
    vLLM's --max-num-seqs, so no number of requests grows the server past it; fot's memory-entry cap holds."""
    from lcx.integrations.vllm import vllm_command
    from lcx.integrations.vllm.attention import WINDOW_SLACK, output_bytes, served_class, served_method

    config = json.loads((model_dir / "config.json").read_text())
    window = config["max_position_embeddings"]

    def request_state_bytes(spec, config, window, max_model_len):  # what lcx serve asks the method's served class
        return served_class(spec).request_bytes(served_method(spec), config, window, max_model_len)

    per = config["num_key_value_heads"] * (config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]) * 8
    spec = {"name": "streaming", "options": {"sinks": 4, "chunk": 16}}
    # sinks 4 (+ 4 rows kept free before the window for them) + recent (window - 4 - 16) and one update of 16
    # in a window buffer with its spare rows
    recent = 2 * 4 + int((window - 4) * (1 + WINDOW_SLACK)) + 16
    assert request_state_bytes(spec, config, window, 4096) == config["num_hidden_layers"] * recent * per
    fot = {"name": "fot", "options": {"local": 32, "chunk": 8, "sinks": 4, "memory_layers": "1"}}
    local = int(32 * (1 + WINDOW_SLACK)) + 4  # a pool slot of local 32 (pools grow by a quarter at most), the sinks
    memory = 4096 + int(4096 * WINDOW_SLACK)  # every token of the request in a HeadsStore, with its spare rows
    assert request_state_bytes(fot, config, window, 4096) == (config["num_hidden_layers"] * local + memory) * per
    exp = export_for_vllm(str(model_dir), ["fot"], {"fot": fot["options"]}, out=tmp_path / "x", max_model_len=4096,
                          state_gib=0.02)
    # room for one update's memory attention: at least its chunk of 8 queries of each head searched against
    # 4,096 entries in float32
    step = served_class(fot).step_bytes(served_method(fot), config, window, 4096, None)
    assert step >= 4 * 8 * config["num_attention_heads"] // config["num_key_value_heads"] * 4096
    step += output_bytes(config, 4096)  # and a step's outputs: vLLM's batch holds a whole prompt
    step += 3 * 4096 * per  # and a layer's prefix from vLLM's prefix cache, gathered to be replayed
    assert exp.max_concurrent == int((0.02 * 2**30 - step) // ((config["num_hidden_layers"] * local + memory) * per)) > 1
    cmd = vllm_command(exp, "127.0.0.1", 8000, "m", "float32", None)
    assert cmd[cmd.index("--max-num-seqs") + 1] == str(exp.max_concurrent)
    assert "--max-num-seqs" not in vllm_command(export_for_vllm(str(model_dir), ["rope"], out=tmp_path / "r", max_model_len=512),
                                                "127.0.0.1", 8000, "m", "float32", None)
    with pytest.raises(LcxError, match=r"holds up to .* GiB of state and up to .* GiB more for a moment in a step, "
                                        r"over --state-gib 1e-05; raise --state-gib"):
        export_for_vllm(str(model_dir), ["fot"], out=tmp_path / "y", max_model_len=4096, state_gib=0.00001)
    monkeypatch.setenv("LCX_MAX_MEMORY_ENTRIES", "1000")
    with pytest.raises(LcxError, match=r"could hold 4,096 entries .* over the limit of 1,000; lower --max-model-len"):
        export_for_vllm(str(model_dir), ["fot"], out=tmp_path / "y", max_model_len=4096)
    assert not (tmp_path / "y").exists()


def test_a_server_started_by_a_process_dies_with_it(tmp_path):
    """`lcx serve` and ServerProcess start their child with `die_with_parent`: a SIGKILLed parent
    (no cleanup runs) must not leave a server behind."""
    import os
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from lcx.integrations.vllm import die_with_parent\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True,\n"
        "                     preexec_fn=die_with_parent)\n"
        f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
        "time.sleep(120)\n")])
    deadline = time.time() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    child = int(pid_file.read_text())
    os.kill(child, 0)  # running
    parent.kill()
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        try:  # reaped by init once it exits; a zombie still answers kill(0)
            if open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(child, 9)
    raise AssertionError("the child outlived its SIGKILLed parent")


def test_lcx_serve_never_replaces_a_folder_that_is_not_an_export(tmp_path):
    """`lcx serve --export-dir DIR` replaces DIR with its export: a folder holding anything but an earlier
    export (its lcx-export.json) is refused before anything is written, and kept as it was."""
    d = tmp_path / "work"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    r = CliRunner().invoke(main, ["serve", "smollm2-135m", "--export-dir", str(d)])
    assert r.exit_code != 0 and "is not empty and holds no lcx export (lcx-export.json)" in r.output
    assert [p.name for p in d.iterdir()] == ["notes.txt"] and (d / "notes.txt").read_text() == "mine"
    f = tmp_path / "file"
    f.write_text("x")
    r = CliRunner().invoke(main, ["serve", "smollm2-135m", "--export-dir", str(f)])
    assert r.exit_code == 2 and "is a file" in r.output and f.read_text() == "x"


def test_a_server_that_asks_for_an_api_key_is_ready():
    """`lcx serve ... -- --api-key K`: vLLM answers the readiness poll with 401 once it is up (its key check
    guards /v1): that counts as ready, not as a server still starting."""
    import subprocess
    import sys
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from lcx.integrations.vllm import wait_ready

    class Locked(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(401)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Locked)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert wait_ready(f"http://127.0.0.1:{server.server_port}/v1/models", proc, 20) < 10
    finally:
        proc.kill()
        server.shutdown()


def test_a_server_launched_without_waiting_reports_its_failed_start_when_waited_on(tmp_path):
    """ServerProcess(wait=False) returns at once (the caller works while vLLM starts); ``wait_ready`` then
    raises with the log's tail when the server could not start."""
    from lcx.integrations.vllm import ServerProcess

    s = ServerProcess("no-such-org/no-such-model", [], tmp_path / "serve.log", wait=False)
    assert s.ready == {}
    with pytest.raises(LcxError, match=r"lcx serve failed \(status 2\); log tail:\n.*no-such-org/no-such-model"):
        s.wait_ready()
    assert s.close() == 2


def test_a_method_named_twice_is_refused_not_applied_twice(model_dir, tmp_path):
    """rope named twice baked factor 8 x 8 = 64 (attach refuses it; the export did not)."""
    with pytest.raises(LcxError, match="method 'rope' is named twice"):
        export_for_vllm(str(model_dir), ["rope", "rope"], {"rope": {"factor": 8}}, out=tmp_path / "x")


def test_an_export_leaves_a_users_tmp_folder_alone_and_nothing_behind_on_failure(model_dir, tmp_path):
    """The export wrote into OUT.tmp after emptying it: a user's folder of that name lost its files."""
    (tmp_path / "x.tmp").mkdir()
    (tmp_path / "x.tmp" / "notes.txt").write_text("mine")
    export_for_vllm(str(model_dir), ["rope"], {"rope": {"factor": 4}}, out=tmp_path / "x")
    assert (tmp_path / "x.tmp" / "notes.txt").read_text() == "mine" and (tmp_path / "x" / "model" / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x", "x.tmp"]  # no temporary folder left


def test_adapter_checks_of_lcx_generate_apply_to_the_export(model_dir, tmp_path):
    """An smt adapter under focusllm (its LoRA would act at candidate positions only) was accepted at start,
    then every request naming it failed; a fot adapter served with another positions mode than trained too."""
    smt = _adapter(model_dir, tmp_path / "s")
    with pytest.raises(LcxError, match="trained with smt, not focusllm"):
        export_for_vllm(str(model_dir), ["focusllm"], {"focusllm": {"refresh": 0}}, {"s": smt}, out=tmp_path / "x")
    fot = _adapter(model_dir, tmp_path / "f", methods=({"name": "fot", "options": {"positions": "none"}},))
    with pytest.raises(LcxError, match="trained with fot positions=none"):
        export_for_vllm(str(model_dir), ["fot"], {"fot": {"positions": "first"}}, {"f": fot}, out=tmp_path / "y")


def test_an_adapter_is_served_on_a_bfloat16_copy_of_its_base(model_dir, tmp_path):
    """The export compared the float32 fingerprint only: a bf16-saved copy of the same model was refused as
    another base model (lcx generate accepts it)."""
    copy = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(str(model_dir)).to(torch.bfloat16).save_pretrained(str(copy))
    for f in model_dir.iterdir():
        if f.suffix in (".json", ".txt", ".model") and f.name != "config.json" and not (copy / f.name).exists():
            (copy / f.name).write_bytes(f.read_bytes())
    export_for_vllm(str(copy), adapters={"a": _adapter(model_dir, tmp_path / "a")}, out=tmp_path / "x")


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path):
    """Another server on the port answered the readiness poll (a false ready line) and a second `lcx serve` of
    the same model and address replaced the running one's export before vLLM failed to bind."""
    import socket

    from lcx.integrations.vllm import check_port_free

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(LcxError, match=f"cannot serve on 127.0.0.1:{port}: .*choose another --port"):
            check_port_free("127.0.0.1", port)
        r = CliRunner().invoke(main, ["serve", "smollm2-135m", "--port", str(port), "--export-dir", str(tmp_path / "e")])
        assert r.exit_code == 2 and "choose another --port" in r.output and not (tmp_path / "e").exists()
    check_port_free("127.0.0.1", port)  # closed: free again
