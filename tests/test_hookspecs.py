"""The hookspec file is the architecture's table of contents: keep it complete and honest."""

from __future__ import annotations

import inspect

import pluggy

from lcx import hookspecs
from lcx.registry import registry


def _specs():
    return {n: f for n, f in vars(hookspecs).items() if n.startswith("lcx_") and callable(f)}


def test_every_stage_has_a_spec_with_a_docstring():
    specs = _specs()
    assert set(hookspecs.STAGES) | set(hookspecs.DISCOVERY) == set(specs)
    for name, fn in specs.items():
        doc = inspect.getdoc(fn) or ""
        assert len(doc) > 40, f"{name} needs a docstring saying when it runs and what it returns"
    for name in hookspecs.EXCLUSIVE_STAGES:
        assert "EXCLUSIVE" in inspect.getdoc(specs[name]), name


def test_exclusive_stages_are_first_result():
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in hookspecs.EXCLUSIVE_STAGES:
        assert getattr(pm.hook, name).spec.opts["firstresult"], name


def test_builtin_hookimpls_have_no_default_arguments_and_valid_names():
    """pluggy 1.6 and 1.7 treat defaults differently; check_pending catches misspelled hooks."""
    for name, cls in registry().methods.items():
        for attr in dir(cls):
            fn = getattr(cls, attr)
            if hasattr(fn, "lcx_impl"):
                assert attr in _specs(), f"{name}.{attr} is not a hookspec"
                params = inspect.signature(fn).parameters.values()
                assert all(p.default is inspect.Parameter.empty for p in params), f"{name}.{attr} has defaults"


def test_every_question_lcx_asks_a_method_is_listed_with_the_stages():
    """hookspecs.py lists every override point of ``Method`` (attributes and methods a method may set), so that
    one file still names every extension point; the option helpers and introspection are not extension points."""
    import re

    from lcx.method import Method

    not_extension_points = {"name", "description", "options", "from_options", "to_options", "default_options",
                            "before_options", "unrecorded_options", "stages"}
    points = {n for n in vars(Method) if not n.startswith("_")} - not_extension_points
    listed = set(re.findall(r"[a-z_]+", hookspecs.__doc__.split("asked:")[1].split("What lcx shares")[0]))
    assert points and points <= listed, f"Method override points missing from hookspecs.py: {sorted(points - listed)}"


def test_what_lcx_shares_with_a_method_is_a_typed_attribute_of_the_run():
    """The core and the methods share no ``run.state`` keys: what they share is a ``Run`` attribute, listed in
    hookspecs.py; the core never reads ``run.state``."""
    import ast
    from pathlib import Path

    import torch

    import lcx
    from tests.conftest import tiny_model

    shared = ["plan", "memory", "reuse", "scored", "seed", "rank", "train_state"]
    with lcx.attach(tiny_model("llama"), ["vanilla"]) as run:
        assert all(hasattr(run, a) for a in shared) and run.state == {}
        lcx.generate(run, torch.tensor([[5, 6, 7, 8]]), max_new_tokens=1)
        assert run.plan is not None and run.memory is not None and run.state == {}
    assert all(f"``{a}``" in hookspecs.__doc__ for a in shared)
    sdk = Path(hookspecs.__file__).resolve().parent
    for path in sdk.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "state" and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "run" or isinstance(node, ast.Attribute) and node.attr == "state" \
                    and isinstance(node.value, ast.Name) and node.value.id == "run":
                raise AssertionError(f"{path.name}:{node.lineno} reads run.state: share a Run attribute instead")
