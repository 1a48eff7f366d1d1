"""`lcx memory`: the group of document-memory commands; plugins add them (``lcx_register_commands``), e.g.
`lcx memory build` of the fot plugin (plugins/fot/commands.py)."""

from __future__ import annotations

from lcx.cli.base import CONTEXT, LcxGroup, main


@main.group("memory", cls=LcxGroup, context_settings=CONTEXT)
def memory_grp() -> None:
    """Build document memories once, query them many times (fot multi-document mode)."""
