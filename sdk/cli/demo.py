"""`lcx demo`: the README's main demo."""

from __future__ import annotations

import click

from lcx.cli.base import CONTEXT, _device, _dtype, _echo_json, device_option, main


@main.command("demo", context_settings=CONTEXT)
@click.option("--model", "-m", default="smollm2-135m", show_default=True, metavar="NAME|DIR")
@click.option("--length", type=click.IntRange(1), default=None,
              help="Prompt length in tokens (default: 2x the model's window).")
@click.option("--depth", type=click.FloatRange(0, 1), default=0.5, show_default=True,
              help="Where the passkey sits in the prompt: 0 = its start, 1 = its end.")
@click.option("--method", "methods", multiple=True, help="Methods to compare (default: every installed method).")
@click.option("--option", "-o", "options", multiple=True, metavar="METHOD.KEY=VALUE",
              help="An option for one method's row, e.g. -o fot.local=1024 (see `lcx methods -v`); rows without "
                   "options run the method's defaults.")
@click.option("--adapter", "adapters", multiple=True, metavar="METHOD=DIR",
              help="Run one method's row over a trained adapter (`lcx train --out DIR`), with the options it was "
                   "trained with under any -o given, e.g. --adapter focusllm=results/focusllm/adapter-recall-local.")
@device_option
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON (no table, no progress lines).")
def demo_cmd(model, length, depth, methods, options, adapters, as_json) -> None:
    """Passkey at 2x the model's window with each installed method: found?, time, peak memory.

    \b
    Examples (the second is what `make demo` runs: fot in the passkey configuration results/fot measured on
    SmolLM2-135M, focusllm over the candidate adapter results/focusllm trained, with the options it was measured
    with; fot's memory layers are measured on the model the first time and cached beside it):
      lcx demo                                       # every method at its defaults
      lcx demo -o fot.local=1024 -o fot.chunk=256 -o fot.sinks=0 -o fot.positions=first -o fot.gate=off \\
        --adapter focusllm=results/focusllm/adapter-recall-local -o focusllm.topk=4 -o focusllm.overlap=64
    """
    from lcx.demo import print_table, run_demo
    from lcx.errors import LcxError
    from lcx.session import parse_options

    by_method = {}
    for given in adapters:
        name, eq, folder = given.partition("=")
        if not eq or not name.strip() or not folder.strip():
            raise LcxError(f"--adapter {given!r} is not METHOD=DIR; e.g. --adapter focusllm=results/focusllm/adapter")
        if name.strip() in by_method:
            raise LcxError(f"--adapter gives {name.strip()!r} two adapters ({by_method[name.strip()]!r} and "
                           f"{folder.strip()!r}); give one")
        by_method[name.strip()] = folder.strip()
    rows = run_demo(model, length=length, depth=depth, methods=list(methods) or None, progress=not as_json,
                    options=parse_options(options), dtype=_dtype(), device=_device(), adapters=by_method)
    if as_json:
        _echo_json(rows)
    else:
        print_table(rows)

