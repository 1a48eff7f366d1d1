"""`lcx demo`: the README's main demo."""

from __future__ import annotations

import click

from lcx.cli.base import CONTEXT, _echo_json, main


@main.command("demo", context_settings=CONTEXT)
@click.option("--model", "-m", default="smollm2-135m", show_default=True, metavar="NAME|DIR")
@click.option("--length", type=int, default=None, help="Prompt length in tokens (default: 2x the model's window).")
@click.option("--depth", type=float, default=0.5, show_default=True)
@click.option("--method", "methods", multiple=True, help="Methods to compare (default: every installed method).")
@click.option("--json", "as_json", is_flag=True)
def demo_cmd(model, length, depth, methods, as_json) -> None:
    """Passkey at 2x the model's window with each installed method: found?, time, peak memory."""
    from lcx.demo import print_table, run_demo

    rows = run_demo(model, length=length, depth=depth, methods=list(methods) or None, progress=not as_json)
    if as_json:
        _echo_json(rows)
    else:
        print_table(rows)

