"""Plugins: runtime registration, broken plugins, conflicts (the installed-package path is in
test_thirdparty_plugin.py)."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

import lcx
from lcx.registry import registry
from tests.conftest import tiny_model
from tests.helpers import MethodsPlugin

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


def test_runtime_plugin_registers_and_unregisters(isolated_registry):
    reg = isolated_registry
    reg.add_plugin(MethodsPlugin(CountingAttention), name="counting-plugin")
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
        isolated_registry.add_plugin(MethodsPlugin(dict), name="broken")
    isolated_registry.add_plugin(MethodsPlugin(CountingAttention), name="first")
    with pytest.raises(lcx.LcxError, match="'second' registers method 'counting', already registered by plugin 'first'"):
        isolated_registry.add_plugin(MethodsPlugin(dataclasses.make_dataclass("X", [], bases=(CountingAttention,))), name="second")


def test_two_methods_claiming_attention_are_refused(llama):
    with pytest.raises(lcx.ConflictError, match="'counting' and 'other' both claim the attention stage"):
        lcx.attach(llama, [CountingAttention(), OtherAttention()])
    assert llama.config._attn_implementation == "sdpa"


def test_builtin_methods_are_plugins_too():
    reg = registry()
    assert {"vanilla", "rope", "streaming"} <= set(reg.methods)
    assert reg.plugin_of("streaming") == "lcx.plugins.streaming"


def test_a_broken_installed_plugin_is_skipped_with_a_warning(monkeypatch, capsys):
    """Entry points that fail to load, register a clash, or reuse an entry-point name never break lcx."""
    from lcx import registry as reg

    def ep(name, obj):
        return SimpleNamespace(name=name, value=f"pkg_{name}:plugin", dist=SimpleNamespace(name=f"pkg-{name}", version="1"),
                               load=lambda: obj() if callable(obj) and not isinstance(obj, MethodsPlugin) else obj)

    def boom():
        raise ImportError("missing dependency")

    clash = MethodsPlugin(dataclasses.make_dataclass("V", [], bases=(CountingAttention,), namespace={"name": "vanilla"}))
    eps = [ep("broken", boom), ep("clash", clash), ep("good", MethodsPlugin(OtherAttention)), ep("good", MethodsPlugin(CountingAttention))]
    monkeypatch.delenv(reg.ALLOWLIST_ENV, raising=False)
    monkeypatch.setattr(reg.metadata, "entry_points", lambda group: eps)
    r = reg.Registry()
    err = capsys.readouterr().err
    assert "could not load plugin 'broken'" in err and "missing dependency" in err
    assert "skipped plugin 'clash'" in err and "LCX_PLUGINS" in err
    assert "two plugins use the entry-point name 'good'" in err
    assert r.plugin_of("vanilla") == "lcx.plugins.vanilla" and "other" in r.methods and "counting" not in r.methods
    assert "clash" not in {p.name for p in r.plugins()}


@pytest.mark.parametrize(("given", "expected"), [
    ({"head_fraction": 1, "window": 512}, {"head_fraction": 1.0, "window": 512}),
    ({"window": 512.0}, {"window": 512}),
    ({"window": "512", "head_fraction": "0.5"}, {"window": 512, "head_fraction": 0.5}),
])
def test_option_values_take_their_fields_type_from_strings_and_json_numbers(given, expected):
    """JSON (sidecars, vLLM requests) hands ints for float fields and floats for int fields."""
    opts = registry().get("vanilla").from_options(**given).to_options()
    assert {k: (opts[k], type(opts[k])) for k in expected} == {k: (v, type(v)) for k, v in expected.items()}


@pytest.mark.parametrize(("method", "given", "needle"), [
    ("vanilla", {"window": 2.5}, "option window=2.5 of method 'vanilla' must be a whole number, e.g. window=2"),
    ("vanilla", {"window": True}, "option window=True of method 'vanilla' must be a number, not true or false"),
    ("fot", {"dense": 1}, "option dense=1 of method 'fot' must be true or false"),
])
def test_json_option_values_of_the_wrong_kind_are_refused(method, given, needle):
    with pytest.raises(lcx.LcxError, match=needle.replace("(", r"\(")):
        registry().get(method).from_options(**given)


def test_vanilla_with_its_own_window_runs_on_a_model_whose_config_names_none():
    """bloom's config has no max_position_embeddings: -o vanilla.window=N is all vanilla needs (the model's
    window was asked for anyway, and the error pointed at a --window flag that does not exist)."""
    from transformers import AutoModelForCausalLM, BloomConfig

    from lcx.generation import generate

    model = AutoModelForCausalLM.from_config(BloomConfig(vocab_size=256, hidden_size=32, n_layer=2, n_head=2)).eval()
    with lcx.attach(model, ["vanilla"], window=32) as run:
        assert generate(run, torch.randint(3, 200, (1, 100)), max_new_tokens=4).shape == (1, 4)
    with pytest.raises(lcx.LcxError, match="no max_position_embeddings; set it there.*-o vanilla.window=N"):
        with lcx.attach(model, ["vanilla"]) as run:
            generate(run, torch.randint(3, 200, (1, 100)), max_new_tokens=4)


# ---------------------------------------------------------------------- training tasks and commands
class TasksPlugin:
    """A plugin object registering the given training tasks."""

    def __init__(self, *tasks):
        self.tasks = tasks

    @lcx.hookimpl
    def lcx_register_tasks(self, register):
        for task in self.tasks:
            register(task)


class ExtrasPlugin:
    """A plugin adding a training task (``task:fill[:N]``: rows of token N) and a command to `lcx analyze`."""

    @lcx.hookimpl
    def lcx_register_tasks(self, register):
        from lcx.data import Task

        def make(args):
            value = int(args[0]) if args else 7
            return lambda rng, batch_size, seq_len: {"input_ids": torch.full((batch_size, seq_len), value)}

        register(Task("fill", make, "rows of one token; task:fill:N for token N"))

    @lcx.hookimpl
    def lcx_register_commands(self, cli):
        import click

        @click.command("hello")
        def hello():
            """Say hello."""
            click.echo("hello from a plugin")

        cli.commands["analyze"].add_command(hello)


def test_a_plugin_adds_a_training_task_and_a_command_and_takes_them_back(isolated_registry):
    from click.testing import CliRunner

    from lcx.cli import main
    from lcx.train import synthetic_task

    isolated_registry.add_plugin(ExtrasPlugin(), name="extras")
    try:
        assert synthetic_task(["task:fill:3"])(random.Random(0), 2, 4)["input_ids"].tolist() == [[3] * 4] * 2
        r = CliRunner().invoke(main, ["analyze", "hello"])
        assert (r.exit_code, r.output) == (0, "hello from a plugin\n"), r.output
        assert "hello" in CliRunner().invoke(main, ["analyze", "--help"]).output
    finally:
        isolated_registry.remove_plugin("extras")
    with pytest.raises(lcx.LcxError, match="unknown synthetic task 'fill'; known: task:dictionary"):
        synthetic_task(["task:fill"])
    r = CliRunner().invoke(main, ["analyze", "hello"])
    assert r.exit_code == 2 and "No such command 'hello'" in r.output, r.output
    assert CliRunner().invoke(main, ["analyze", "distraction", "--help"]).exit_code == 0  # the built-ins' stay


def test_bad_task_registrations_name_the_plugin(isolated_registry):
    from lcx.data import Task

    with pytest.raises(lcx.LcxError, match="plugin 'odd' registered 'fill', which is not an lcx.data.Task"):
        isolated_registry.add_plugin(TasksPlugin("fill"), name="odd")
    with pytest.raises(lcx.LcxError, match="plugin 'again' registers training task 'dictionary', already registered "
                                           "by plugin 'lcx.plugins.fot'; rename one"):
        isolated_registry.add_plugin(TasksPlugin(Task("dictionary", lambda args: None)), name="again")
    assert not isolated_registry.pm.has_plugin("odd") and not isolated_registry.pm.has_plugin("again")
