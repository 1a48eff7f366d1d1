"""The host never branches on a method's name: no built-in method is named in the code of sdk/ or integrations/
(outside the registry's list of built-in plugins and the default method it names).  Prose may name methods (docstrings, help and error texts are
not checked unless they are exactly a name); code may not: a string equal to a name, an identifier spelled as
one, an import of a method's plugin."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lcx.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
CORE = ("sdk", "integrations")


def builtin_names() -> set[str]:
    return set(Registry(load_entrypoints=False).methods)


def _builtin_list(tree: ast.AST) -> set[int]:
    """ids of the nodes inside the registry's ``BUILTIN_PLUGINS`` and ``DEFAULT_METHOD`` assignments: the one
    allowed place."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in ("BUILTIN_PLUGINS", "DEFAULT_METHOD") for t in targets):
                skip |= {id(n) for n in ast.walk(node)}
    return skip


def name_uses(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each use of a method name as code in ``source``."""
    tree = ast.parse(source)
    skip = _builtin_list(tree)
    plugin_modules = tuple(f"lcx.plugins.{n}" for n in names)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        what = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in names or node.value.startswith(plugin_modules):
                what = f"string {node.value!r}"
        elif isinstance(node, ast.Name) and node.id in names:
            what = f"identifier {node.id}"
        elif isinstance(node, ast.Attribute) and node.attr in names:
            what = f"attribute .{node.attr}"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in names:
            what = f"definition {node.name}"
        elif isinstance(node, ast.arg) and node.arg in names:
            what = f"argument {node.arg}"
        elif isinstance(node, ast.keyword) and node.arg in names:
            what = f"keyword {node.arg}="
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(plugin_modules):
            what = f"import from {node.module}"
        elif isinstance(node, ast.Import) and any(a.name.startswith(plugin_modules) for a in node.names):
            what = "import " + ", ".join(a.name for a in node.names)
        if what:
            found.append((getattr(node, "lineno", 0), what))
    return sorted(found)


def test_no_builtin_method_is_named_in_core_or_integrations_code():
    names = builtin_names()
    assert {"fot", "streaming", "focusllm", "rope", "smt", "vanilla"} <= names
    files = sorted(p for d in CORE for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 30
    uses = [f"{p.relative_to(ROOT)}:{line}: {what}" for p in files for line, what in name_uses(p.read_text(), names)]
    assert not uses, "method names in core code (ask the method instead):\n" + "\n".join(uses)


@pytest.mark.parametrize("code, hit", [
    ('if spec["name"] == "fot":\n    pass\n', "string 'fot'"),
    ("fot = run.method(name)\n", "identifier fot"),
    ("from lcx.plugins.fot.distraction import measure\n", "import from lcx.plugins.fot.distraction"),
    ("import lcx.plugins.streaming\n", "import lcx.plugins.streaming"),
    ("x = {'streaming': 1}\n", "string 'streaming'"),
    ("run.focusllm.reset()\n", "attribute .focusllm"),
    ("open_session(model, methods=('fot',))\n", "string 'fot'"),
])
def test_the_check_finds_a_name_used_as_code(code, hit):
    assert [what for _, what in name_uses(code, builtin_names())] == [hit]


def test_the_check_leaves_prose_and_the_builtin_list_alone():
    code = ('"""fot and streaming are methods."""\n'
            'BUILTIN_PLUGINS = ("lcx.plugins.fot", "lcx.plugins.rope")\n'
            'def f(x):\n    """Serve fot."""\n    raise ValueError(f"method {x!r}: e.g. -o fot.local=1024")\n')
    assert name_uses(code, builtin_names()) == []
