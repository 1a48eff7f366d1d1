"""The method tables of README.md and docs/methods.md list every built-in method, and their "needs" column says
what each method's ``requires`` says (a method that needs RoPE must not read as working on any model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lcx.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
NEEDS = {"rotary": "RoPE", "attention_interface": "attention interface"}


def method_rows(text: str) -> dict[str, str]:
    """{method: its "needs" cell} from a markdown table whose first column is a `method` and last its needs."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`") and cells[0].endswith("`"):
            rows[cells[0].strip("`")] = cells[-1]
    return rows


def test_method_rows_are_read_from_a_table():
    table = "| method | what | needs |\n|---|---|---|\n| `a` | x | RoPE |\n| `b` | y | any model |\n"
    assert method_rows(table) == {"a": "RoPE", "b": "any model"}


@pytest.mark.parametrize("doc", ["README.md", "docs/methods.md"])
def test_method_tables_list_what_each_method_requires(doc):
    rows = method_rows((ROOT / doc).read_text())
    methods = Registry(load_entrypoints=False).methods
    assert set(methods) <= set(rows), f"{doc} has no row for {sorted(set(methods) - set(rows))}"
    for name, cls in methods.items():
        want = sorted(NEEDS.get(r, f"<{r}: add it to NEEDS>") for r in cls.requires)
        got = sorted(p.strip() for p in rows[name].split(",")) if cls.requires else [rows[name]]
        assert got == (want or ["any model"]), f"{doc}: {name} needs {want or 'nothing'}, the table says {rows[name]!r}"
