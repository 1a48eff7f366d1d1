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
