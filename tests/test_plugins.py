"""Plugins: third-party methods install as packages; composition refuses conflicts; allowlist works."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import lcx
from lcx.registry import registry
from tests.conftest import tiny_model

HELLO_PLUGIN = '''
from dataclasses import dataclass
import lcx

CALLS = {"plan": 0}

@dataclass
class Hello(lcx.Method):
    name = "hello"
    description = "a third-party test method"
    greeting: str = lcx.option("hi", "what to say")

    @lcx.hookimpl
    def lcx_plan(self, run, input_ids, attention_mask, max_new_tokens):
        CALLS["plan"] += 1
        return lcx.Plan.whole(input_ids, attention_mask)

@lcx.hookimpl
def lcx_register_methods(register):
    register(Hello)
'''

RUN_HELLO = '''
import sys, torch, lcx
sys.path.insert(0, sys.argv[1])
from tests.conftest import tiny_model
import lcx_hello
model = tiny_model("llama")
with lcx.attach(model, ["hello"], greeting="hey") as run:
    out = lcx.generate(run, torch.randint(3, 200, (1, 10)), max_new_tokens=2)
print("PLAN_CALLS", lcx_hello.CALLS["plan"], tuple(out.shape), run.methods[0].greeting)
'''


@pytest.fixture(scope="module")
def installed_hello(tmp_path_factory):
    """A throwaway third-party package with an `lcx.methods` entry point, pip-installed into this venv."""
    src = tmp_path_factory.mktemp("pkg")
    (src / "lcx_hello.py").write_text(HELLO_PLUGIN)
    (src / "pyproject.toml").write_text(textwrap.dedent('''
        [build-system]
        requires = ["setuptools>=69"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "lcx-hello"
        version = "0.0.1"
        [project.entry-points."lcx.methods"]
        hello = "lcx_hello"
        [tool.setuptools]
        py-modules = ["lcx_hello"]
    '''))
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", str(src)], check=True, capture_output=True)
    try:
        yield src
    finally:
        subprocess.run([*pip, "uninstall", "-y", "lcx-hello"], check=True, capture_output=True)


def _lcx_json(*args: str, env: dict | None = None) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "lcx.cli", *args, "--json"], check=True, capture_output=True,
                         text=True, env={**os.environ, **(env or {})})
    return json.loads(out.stdout)


@pytest.mark.slow
def test_third_party_method_is_listed_allowlisted_and_runs(installed_hello):
    env = {k: v for k, v in os.environ.items() if k != "LCX_PLUGINS"}
    methods = {m["name"]: m for m in _lcx_json("methods", env=env)}
    assert methods["hello"]["plugin"] == "hello" and methods["hello"]["stages"] == ["chunking"]
    plugins = {p["name"]: p for p in _lcx_json("plugins", env=env)}
    assert plugins["hello"]["source"].startswith("entry point lcx-hello 0.0.1")
    assert "hello" not in {m["name"] for m in _lcx_json("methods", env={"LCX_PLUGINS": ""})}
    assert "hello" in {m["name"] for m in _lcx_json("methods", env={"LCX_PLUGINS": "hello"})}
    assert "hello" not in {m["name"] for m in _lcx_json("methods", env={"LCX_PLUGINS": "other"})}

    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", RUN_HELLO, str(repo)], check=True, capture_output=True, text=True,
                         cwd=repo, env={**env, "PYTHONPATH": str(repo)})
    assert "PLAN_CALLS 1 (1, 2) hey" in out.stdout


# ---------------------------------------------------------------------- in-process registration
@dataclasses.dataclass
class CountingAttention(lcx.Method):
    name = "counting"
    calls: int = 0

    @lcx.hookimpl
    def lcx_attention(self, run, module, query, key, value, attention_mask, kwargs):
        self.calls += 1
        return None  # fall through to the base implementation


@dataclasses.dataclass
class OtherAttention(lcx.Method):
    name = "other"

    @lcx.hookimpl
    def lcx_attention(self, run, module, query, key, value, attention_mask, kwargs):
        return None


class _Plugin:
    def __init__(self, *classes):
        self.classes = classes

    @lcx.hookimpl
    def lcx_register_methods(self, register):
        for c in self.classes:
            register(c)


def test_runtime_plugin_registers_and_unregisters(isolated_registry):
    reg = isolated_registry
    reg.add_plugin(_Plugin(CountingAttention), name="counting-plugin")
    try:
        model = tiny_model("llama")
        x = torch.randint(3, 200, (1, 12))
        ref = model(x).logits
        with lcx.attach(model, ["counting"]) as run:
            out = model(x).logits
            assert run.methods[0].calls == model.config.num_hidden_layers
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
    finally:
        reg.remove_plugin("counting-plugin")
    with pytest.raises(lcx.LcxError, match="unknown method 'counting'"):
        lcx.attach(tiny_model("llama"), ["counting"])


def test_bad_registrations_name_the_plugin(isolated_registry):
    with pytest.raises(lcx.LcxError, match="plugin 'broken' registered .*not a named lcx.Method"):
        isolated_registry.add_plugin(_Plugin(dict), name="broken")
    isolated_registry.add_plugin(_Plugin(CountingAttention), name="first")
    with pytest.raises(lcx.LcxError, match="'second' registers method 'counting', already registered by plugin 'first'"):
        isolated_registry.add_plugin(_Plugin(dataclasses.make_dataclass("X", [], bases=(CountingAttention,))), name="second")


def test_two_methods_claiming_attention_are_refused(llama):
    with pytest.raises(lcx.ConflictError, match="'counting' and 'other' both claim the attention stage"):
        lcx.attach(llama, [CountingAttention(), OtherAttention()])
    assert llama.config._attn_implementation == "sdpa"


def test_builtin_methods_are_plugins_too():
    reg = registry()
    assert {"vanilla", "rope", "streaming"} <= set(reg.methods)
    assert reg.plugin_of("streaming") == "lcx.plugins.streaming"
