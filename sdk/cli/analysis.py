"""`lcx analyze attention|retrieval`: where long-context attention goes (plugins add analyses to the group, e.g.
fot's `lcx analyze distraction`, plugins/fot/commands.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from lcx.cli.base import (
    CONTEXT, OUT_DIR, LcxGroup, _device, _dtype, _echo_json, _float_list, _token_count, main, device_option,
    model_option, text_field_option,
)
from lcx.cli.evaluation import _ppl_documents
from lcx.errors import LcxError


@main.group("analyze", cls=LcxGroup, context_settings=CONTEXT)
def analyze_grp() -> None:
    """Analyses of what a model attends to."""


@analyze_grp.command("attention", context_settings=CONTEXT)
@model_option
@click.option("--data", "-d", multiple=True, required=True, metavar="PATH", help="Documents (files, folders, .jsonl).")
@text_field_option
@click.option("--length", type=click.IntRange(2), default=4096, show_default=True, help="Tokens per document analysed.")
@click.option("--max-docs", type=click.IntRange(1), default=1, show_default=True)
@click.option("--chunk", type=click.IntRange(1), default=256, show_default=True, help="Queries per recomputation block.")
@click.option("--out", type=OUT_DIR, default=Path("out/attention"), show_default=True,
              help="Folder for attention.json and attention.png.")
@device_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (no table, no progress bars).")
def analyze_attention(model, data, text_field, length, max_docs, chunk, out, as_json):
    """Attention mass by distance, per 1024-token bin and by rank (SMT's Pareto analysis); JSON + plot."""
    from lcx import analyze
    from lcx.models import dtype_name, load_model

    hf_model, tok = load_model(model, device=_device(), dtype=_dtype())
    docs = [(n, ids) for n, ids in _ppl_documents(data, tok, None, text_field) if len(ids) >= length][:max_docs]
    if not docs:
        raise LcxError(f"no document in {list(data)} has {length} tokens; lower --length")
    result = {"model": model, "dtype": dtype_name(hf_model.dtype),
              **analyze.analyze(hf_model, docs, length, chunk=chunk, progress=not as_json)}
    js = analyze.write_json(result, out / "attention.json")
    png = analyze.plot(result, out / "attention.png", f"{model}: attention over {length} tokens")
    if as_json:
        _echo_json({"json": str(js), "plot": str(png), "mass_per_bin": result["mass_per_bin"]})
    else:
        first = next(iter(result["mass_per_bin"].values()))
        click.echo(f"mass in the first 1024-token bin: {first:.1%}; top fraction with 80% of the mass: "
                   f"{result['smallest_top_fraction_with_80pct_mass']:.0%}")
        click.echo(f"wrote {js} and {png}")


@analyze_grp.command("retrieval", context_settings=CONTEXT)
@model_option
@click.option("--length", callback=_token_count, default="4K", show_default=True, metavar="N",
              help="Prompt length in tokens; keep it within the model's window (K suffix allowed).")
@click.option("--depths", callback=_float_list, default="0.2,0.5,0.8", show_default=True, help="Needle depths.")
@click.option("--keys", "n_keys", type=click.IntRange(1), default=1, show_default=True, help="Random keys per depth.")
@click.option("--threshold", type=click.FloatRange(0, 1), default=0.15, show_default=True,
              help="A head (and its layer) is suggested when it puts at least this share of attention on the needle.")
@click.option("--seed", type=int, default=12345, show_default=True, help="Keys differ from the eval's (seed 0).")
@click.option("--out", type=OUT_DIR, default=Path("out/retrieval"), show_default=True,
              help="Folder for retrieval.json and retrieval.png.")
@device_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (no table, no progress bars).")
def analyze_retrieval(model, length, depths, n_keys, threshold, seed, out, as_json):
    """Which layers copy from far context: attention mass on a passkey while the model repeats it.

    The suggested layers are the memory layers a training-free memory method needs, e.g.
    lcx eval passkey --method fot -o memory_layers=<suggested> ...  (and the heads over the threshold, for
    -o fot.memory_heads=...; memory_heads=auto measures them the same way).  Writes OUT/retrieval.{json,png}.
    """
    import random

    from lcx import analyze
    from lcx.models import dtype_name, load_model

    hf_model, tok = load_model(model, device=_device(), dtype=_dtype())
    rng = random.Random(seed)
    keys = [rng.randint(10000, 99999) for _ in range(n_keys)]
    result = {"model": model, "dtype": dtype_name(hf_model.dtype), "command": "lcx " + " ".join(sys.argv[1:]),
              **analyze.retrieval_layers(hf_model, tok, length, depths, keys, threshold, progress=not as_json)}
    js = analyze.write_json(result, out / "retrieval.json")
    png = analyze.plot_retrieval(result, out / "retrieval.png", f"{model}: retrieval by layer and head")
    if as_json:
        _echo_json({"json": str(js), "plot": str(png), "suggested_memory_layers": result["suggested_memory_layers"],
                    "suggested_memory_heads": result["suggested_memory_heads"],
                    "best_head_mass_by_layer": result["best_head_mass_by_layer"]})
    else:
        click.echo(f"suggested memory layers: {result['suggested_memory_layers'] or '(none over the threshold)'}")
        click.echo(f"suggested memory heads:  {result['suggested_memory_heads'] or '(none over the threshold)'}")
        click.echo(f"wrote {js} and {png}")
