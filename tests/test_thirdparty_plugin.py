"""A third-party method package works end to end; runtime plugins register, conflict and unregister cleanly.

The package test pip-installs a throwaway package with ``pip install --target`` into a temporary folder
and exposes it to subprocesses through ``PYTHONPATH``.  That is a real install (pip builds the wheel and
writes ``*.dist-info/entry_points.txt``), but it never touches the shared virtual environment, so lcx
processes other people run at the same time never see the test plugin.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import lcx
from lcx import hookspecs
from lcx.cli import main
from lcx.composition import attached_run
from tests.conftest import tiny_model
from tests.helpers import MethodsPlugin as Plugin, make_tiny_model_dir

REPO = Path(__file__).resolve().parents[1]
DIST = "lcx-hello-method"
MODULE = "lcx_hello_method"

HELLO_MODULE = '''
"""lcx-hello-method: a third-party lcx method (test fixture)."""
import sys
from dataclasses import dataclass

import lcx

CALLS = {"attention": 0}


@dataclass
class Hello(lcx.Method):
    name = "hello"
    description = "third-party test method: counts attention calls"

    greeting: str = lcx.option("hi", "printed to stderr on the first attention call")

    @lcx.hookimpl
    def lcx_attention(self, run, module, query, key, value, attention_mask, kwargs):
        if CALLS["attention"] == 0:
            print(f"hello[{self.greeting}]: attention stage called", file=sys.stderr, flush=True)
        CALLS["attention"] += 1
        return None  # let the base implementation compute the layer


class _Plugin:
    @lcx.hookimpl
    def lcx_register_methods(self, register):
        register(Hello)


plugin = _Plugin()
'''

PYPROJECT = f'''
[build-system]
requires = ["setuptools>=69"]
build-backend = "setuptools.build_meta"

[project]
name = "{DIST}"
version = "0.0.1"

[project.entry-points."lcx.methods"]
hello = "{MODULE}:plugin"

[tool.setuptools]
py-modules = ["{MODULE}"]
'''

RUN_API = f'''
import json, sys
import lcx
from lcx.models import load_model
from lcx.registry import registry
import {MODULE} as hello

model, tok = load_model(sys.argv[1])
ids = tok("hello world", return_tensors="pt")["input_ids"]
with lcx.attach(model, ["hello"], greeting="hey") as run:
    new = lcx.generate(run, ids, max_new_tokens=2)
    method = run.methods[0]
during = hello.CALLS["attention"]
model(ids)  # detached: the method must not fire any more
print(json.dumps({{"calls": during, "calls_after_detach": hello.CALLS["attention"], "new": list(new.shape),
                  "greeting": method.greeting, "plugin": registry().plugin_of("hello"),
                  "layers": model.config.num_hidden_layers}}))
'''


def _lcx_cmd() -> list[str]:
    script = Path(sys.executable).with_name("lcx")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lcx.cli"]


@pytest.fixture(scope="module")
def hello_site(tmp_path_factory) -> Path:
    """Source tree ``lcx_hello_method/`` pip-installed (no deps, no build isolation) into a private folder."""
    root = tmp_path_factory.mktemp("thirdparty")
    src = root / "lcx_hello_method"
    src.mkdir()
    (src / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (src / f"{MODULE}.py").write_text(textwrap.dedent(HELLO_MODULE))
    site = root / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-input", "--no-deps",
         "--no-build-isolation", "--no-compile", "--target", str(site), str(src)],
        capture_output=True, text=True, cwd=root,
    )
    assert proc.returncode == 0, proc.stderr
    eps = next(site.glob("lcx_hello_method-0.0.1.dist-info")) / "entry_points.txt"
    assert "[lcx.methods]" in eps.read_text() and f"hello = {MODULE}:plugin" in eps.read_text()
    return site


@pytest.fixture(scope="module")
def subprocess_results(hello_site, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every subprocess of this module, started at once (each one imports torch: ~4 s of CPU)."""
    tiny = make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=256)
    base = {k: v for k, v in os.environ.items() if k != "LCX_PLUGINS"}
    base["PYTHONPATH"] = os.pathsep.join([str(hello_site), *filter(None, [os.environ.get("PYTHONPATH")])])
    base["HF_HUB_OFFLINE"] = "1"
    lcx_ = _lcx_cmd()
    jobs = {  # kept few: on 2 CPUs each costs seconds
        "methods": (lcx_ + ["methods", "--json"], {}),
        "plugins": (lcx_ + ["plugins", "--json"], {}),
        "methods_none": (lcx_ + ["methods", "--json"], {"LCX_PLUGINS": ""}),
        "plugins_allow": (lcx_ + ["plugins", "--json"], {"LCX_PLUGINS": " hello , someone-else "}),
        "api": ([sys.executable, "-c", RUN_API, str(tiny)], {}),
    }
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    cwd=tiny.parent, env={**base, **extra})
             for name, (cmd, extra) in jobs.items()}
    out = {}
    try:
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=300)
            out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def _json(results, name: str):
    r = results[name]
    assert r.returncode == 0, f"{name}: exit {r.returncode}\n{r.stderr}"
    return json.loads(r.stdout)


@pytest.mark.slow
def test_installed_method_is_listed_with_its_plugin_and_source(subprocess_results):
    methods = {m["name"]: m for m in _json(subprocess_results, "methods")}
    assert {"hello", "vanilla"} <= set(methods)
    hello = methods["hello"]
    assert hello["plugin"] == "hello"  # the entry-point name
    assert hello["stages"] == ["attention"]
    assert hello["description"] == "third-party test method: counts attention calls"
    assert hello["options"] == [{"name": "greeting", "default": "hi",
                                 "help": "printed to stderr on the first attention call"}]
    plugins = {p["name"]: p for p in _json(subprocess_results, "plugins")}
    assert plugins["hello"] == {"name": "hello", "source": f"entry point {DIST} 0.0.1", "methods": ["hello"]}
    assert plugins["lcx.plugins.vanilla"]["source"] == "builtin"


@pytest.mark.slow
def test_allowlist_controls_third_party_plugins(subprocess_results):
    none = {m["name"]: m for m in _json(subprocess_results, "methods_none")}
    assert "hello" not in none and "vanilla" in none  # LCX_PLUGINS="" loads no third-party plugin; builtins stay
    allowed = {p["name"]: p for p in _json(subprocess_results, "plugins_allow")}
    assert allowed["hello"]["methods"] == ["hello"]  # listed by entry-point name, spaces tolerated


@pytest.mark.slow
def test_installed_method_runs_through_the_api(subprocess_results):
    out = _json(subprocess_results, "api")
    assert out["plugin"] == "hello" and out["greeting"] == "hey" and out["new"] == [1, 2]
    # prefill + one decode step at least, every layer each time
    assert out["calls"] >= 2 * out["layers"] and out["calls"] % out["layers"] == 0
    assert out["calls_after_detach"] == out["calls"]
    assert "hello[hey]: attention stage called" in subprocess_results["api"].stderr


# ---------------------------------------------------------------------- in process, no pip
@dataclasses.dataclass
class Greet(lcx.Method):
    name = "greet"
    description = "runtime test method"
    prefix: str = lcx.option(">", "unused; shows that options reach the instance")

    @lcx.hookimpl
    def lcx_plan(self, run, input_ids, attention_mask, max_new_tokens):
        run.state.setdefault("greet_calls", []).append((self.prefix, int(input_ids.shape[1]), max_new_tokens))
        return lcx.Plan.whole(input_ids, attention_mask)


def _method_with(stage: str, name: str) -> type[lcx.Method]:
    """A throwaway method implementing only ``stage``, with the hookspec's exact signature."""
    params = list(inspect.signature(getattr(hookspecs, stage)).parameters)
    ns: dict = {}
    exec(f"def {stage}(self, {', '.join(params)}):\n    return None", ns)
    return dataclasses.make_dataclass(name.replace("-", "_").title(), [], bases=(lcx.Method,),
                                      namespace={"name": name, stage: lcx.hookimpl(ns[stage])})


def _listed(*args: str) -> list[dict]:
    r = CliRunner().invoke(main, [*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_runtime_plugin_method_is_attachable_and_unregisters(isolated_registry):
    reg = isolated_registry
    model = tiny_model("llama")
    reg.add_plugin(Plugin(Greet), name="greet-plugin")
    try:
        assert reg.get("greet") is Greet and reg.plugin_of("greet") == "greet-plugin"
        assert {"name": "greet-plugin", "source": "runtime", "methods": ["greet"]} in _listed("plugins")
        assert "greet" in {m["name"] for m in _listed("methods")}
        x = torch.randint(3, 200, (1, 9))
        with lcx.attach(model, ["greet"], prefix="!") as run:
            new = lcx.generate(run, x, max_new_tokens=2)
            assert run.state["greet_calls"] == [("!", 9, 2)]
            assert run.describe() == {"methods": [{"name": "greet", "options": {"prefix": "!"}}], "dtype": "float32"}
        assert new.shape == (1, 2) and attached_run(model) is None
    finally:
        reg.remove_plugin("greet-plugin")
    assert "greet" not in reg.methods and "greet-plugin" not in {p.name for p in reg.plugins()}
    assert "greet" not in {m["name"] for m in _listed("methods")}
    with pytest.raises(lcx.LcxError, match=r"unknown method 'greet'; installed methods: .*vanilla"):
        lcx.attach(model, ["greet"])


class NotAMethod:
    name = "impostor"


@dataclasses.dataclass
class Nameless(lcx.Method):
    pass


@pytest.mark.parametrize("bad", [dict, NotAMethod, Nameless, Greet()],
                         ids=["dict", "plain-class", "no-name", "instance"])
def test_registering_a_non_method_names_the_plugin(isolated_registry, bad):
    with pytest.raises(lcx.LcxError, match=r"plugin 'bad-plugin' registered .*not a named lcx\.Method subclass; "
                                           r"subclass lcx\.Method and set its `name`"):
        isolated_registry.add_plugin(Plugin(bad), name="bad-plugin")


def test_failed_registration_leaves_no_trace(isolated_registry):
    reg = isolated_registry
    with pytest.raises(lcx.LcxError):
        reg.add_plugin(Plugin(Greet, dict), name="half-bad")
    assert "greet" not in reg.methods
    assert "half-bad" not in {p.name for p in reg.plugins()}


def test_two_plugins_registering_one_name_are_both_named(isolated_registry):
    reg = isolated_registry
    reg.add_plugin(Plugin(Greet), name="pkg-a")
    other = _method_with("lcx_loss", "greet")
    with pytest.raises(lcx.LcxError, match="plugin 'pkg-b' registers method 'greet', already registered by plugin "
                                           "'pkg-a'; rename one of them"):
        reg.add_plugin(Plugin(other), name="pkg-b")
    assert reg.get("greet") is Greet and reg.plugin_of("greet") == "pkg-a"
    # a third-party method may not take a builtin's name either
    with pytest.raises(lcx.LcxError, match="'pkg-c' registers method 'vanilla', already registered by plugin "
                                           "'lcx.plugins.vanilla'"):
        reg.add_plugin(Plugin(_method_with("lcx_plan", "vanilla")), name="pkg-c")


@pytest.mark.parametrize("stage", sorted(hookspecs.EXCLUSIVE_STAGES))
def test_two_methods_on_an_exclusive_stage_are_refused(isolated_registry, stage):
    label = hookspecs.EXCLUSIVE_STAGES[stage]
    isolated_registry.add_plugin(Plugin(_method_with(stage, "ping"), _method_with(stage, "pong")), name="pingpong")
    model = tiny_model("llama")
    with pytest.raises(lcx.ConflictError) as e:
        lcx.attach(model, ["pong", "ping"])
    msg = str(e.value)
    assert "'ping'" in msg and "'pong'" in msg and f"the {label} stage ({stage})" in msg
    assert "choose one" in msg
    # the refusal leaves the model untouched; each method alone attaches
    assert attached_run(model) is None and model.config._attn_implementation == "sdpa"
    for name in ("ping", "pong"):
        with lcx.attach(model, [name]) as run:
            assert run.implements(stage) == [name]


@pytest.mark.parametrize("stage", sorted(set(hookspecs.STAGES) - set(hookspecs.EXCLUSIVE_STAGES)))
def test_two_methods_on_a_collected_stage_combine(isolated_registry, stage):
    isolated_registry.add_plugin(Plugin(_method_with(stage, "ping"), _method_with(stage, "pong")), name="pingpong")
    with lcx.attach(tiny_model("llama"), ["ping", "pong"]) as run:
        assert sorted(run.implements(stage)) == ["ping", "pong"]
