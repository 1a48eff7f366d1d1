"""fot's commands, added to the `lcx` command line by the plugin (``lcx_register_commands``):
`lcx memory build` (index documents once into a reusable memory, fot multi-document mode) and
`lcx analyze distraction` (FoT's distraction measure, ``distraction.py``)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import click

from lcx.cli.base import (
    CONTEXT, OUT_DIR, _device, _dtype, _echo_json, _open, _positive_ints, _with_limits, device_option, limit_options,
    method_options, model_option, text_field_option,
)
from lcx.cli.evaluation import _ppl_documents
from lcx.errors import LcxError


@click.command("build", context_settings=CONTEXT)
@model_option
@click.option("--method", "methods", multiple=True, default=("fot",), show_default=True, help="The memory method.")
@click.option("--option", "-o", "options", multiple=True, metavar="KEY=VALUE", help="Method option (fot).")
@click.option("--adapter", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              help="Index with this adapter applied (e.g. a crossbatch-trained fot adapter): its projections make "
                   "the memory's keys and values, as they do when `lcx generate --adapter` reads them.")
@click.option("--out", required=True, type=OUT_DIR, help="Folder for memory.safetensors + memory.json.")
@click.option("--overwrite", is_flag=True, help="Replace an existing memory folder, or an unfinished build in it.")
@click.option("--workers", type=click.IntRange(0), default=0, show_default=True,
              help="Ray workers indexing documents in parallel, each loading the model and taking one CPU "
                   "(pip install 'lcx[dist]'; the cluster: -o fot.ray_address, $RAY_ADDRESS, else a local Ray); "
                   "0 indexes in this process.")
@limit_options
@device_option
@text_field_option
@click.option("--json", "as_json", is_flag=True, help="Print what was indexed as JSON (no progress bars).")
@click.argument("docs", nargs=-1, required=True, type=click.Path(path_type=Path))
def memory_build(model, methods, options, adapter, out, overwrite, workers, text_field, as_json, docs):
    """Index DOCS (text files or folders) into a kNN memory saved to --out.

    Each finished document is kept under OUT/.build, so a build that is killed resumes where it stopped
    when its command is run again (--overwrite starts over).  With -o fot.backend=ray -o fot.shards=N the
    memory is written sharded, a file per Ray actor.

    \b
    Example:
      lcx memory build -m smollm2-135m --out out/mem ../shared/data/books/wells_invisible_man.txt
      lcx generate -m smollm2-135m --method fot --memory out/mem -p "Who is Griffin?"
      lcx memory build -m smollm2-135m --workers 2 --out out/mem-books ../shared/data/books
      lcx memory build -m smollm2-135m --adapter out/fot-xb --out out/mem-xb BOOKS...   # read with --adapter out/fot-xb
    """
    from lcx.adapters.peft_bridge import adapter_digest, base_identity
    from lcx.data import iter_documents
    from lcx.io import recover
    from lcx.plugins.fot import build
    from lcx.plugins.fot.memory import MEMORY_META, ray_installed, save_memory
    from lcx.session import open_session, parse_options

    if list(methods) != ["fot"]:
        raise LcxError(f"memory build supports the fot method, got {', '.join(methods)}")
    if workers and not ray_installed():
        raise LcxError(f"--workers {workers} runs on Ray: pip install 'lcx[dist]', or pass --workers 0 to index here")
    if out.is_dir():
        recover(out, drop_staging=True)  # a save the last build was killed in: finished, or dropped
        if (out / MEMORY_META).exists():
            shutil.rmtree(out / build.BUILD_DIR, ignore_errors=True)  # killed after its memory was saved
    if (out / MEMORY_META).exists() and not overwrite:
        raise LcxError(f"memory folder {str(out)!r} exists; pass --overwrite to replace it")
    if out.exists() and any(p.name != build.BUILD_DIR for p in out.iterdir()) and not overwrite:
        raise LcxError(f"folder {str(out)!r} is not empty; pass --overwrite to build a memory into it anyway")
    documents = list(iter_documents([str(p) for p in docs], text_field))
    if not documents:
        raise LcxError(f"no documents in {', '.join(map(str, docs))}; give text files, folders of them or .jsonl "
                       f"files with a {text_field!r} field")
    blank = [d["source"] for d in documents if not d["text"].strip()]
    if blank:
        raise LcxError(f"{len(blank)} document(s) have no text: {', '.join(map(repr, blank[:3]))}"
                       f"{' ...' if len(blank) > 3 else ''}; leave them out")
    s = _with_limits(open_session(model, ["fot"], parse_options(options), adapter, device=_device(),
                                  dtype=_dtype()))
    note = (lambda m: None) if as_json else (lambda m: click.echo(m, err=True))
    try:
        fot = s.run.method("fot")
        lengths = [len(s.tokenizer(d["text"], add_special_tokens=False)["input_ids"]) for d in documents]
        build.check_fits(s.run, fot, sum(lengths))
        built_with = {"path": str(adapter), "sha256": adapter_digest(adapter)} if adapter else None
        journal = build.Journal(out, build.identity(s, fot, documents, built_with))
        if overwrite:
            journal.remove()
        journal.open(note)
        build.index_documents(s, fot, documents, lengths, journal, workers, model=model, adapter=adapter,
                              device=_device(), progress=not as_json)
        stores = build.assemble(journal, len(documents), fot.store_config())
        listed = [{"doc_id": i, "source": d["source"], "tokens": journal.done[i]["tokens"]}
                  for i, d in enumerate(documents)]
        save_memory(stores, out, {"model": base_identity(s.model), "method": s.run.describe()["methods"][0],
                                  "adapter": built_with, "documents": listed, "dtype": s.run.dtype})
        journal.remove()
    finally:
        s.close()
    entries = len(next(iter(stores.values()))) if stores else 0
    if as_json:
        _echo_json({"out": str(out), "documents": listed, "entries_per_layer_and_head": entries,
                    "memory_layers": sorted({layer for layer, _ in stores}), "workers": workers})
        return
    click.echo(f"indexed {len(listed)} document(s), {entries} entries per layer and head, into {out}")


@click.command("distraction", context_settings=CONTEXT)
@model_option
@method_options
@click.option("--data", "-d", multiple=True, required=True, metavar="PATH",
              help="Documents, one per batch row (files, folders, .jsonl); at least max(--ds) of them.")
@text_field_option
@click.option("--ds", callback=lambda c, p, v: _positive_ints(v), default="1,2,4,8", show_default=True,
              help="Numbers of documents visible to the memory layer.")
@click.option("--batches", type=click.IntRange(1), default=3, show_default=True,
              help="Batches per d, each from another place in every document.")
@click.option("--max-docs", type=click.IntRange(1), default=None, help="Use at most this many documents.")
@click.option("--label", default=None, help="Name of this model in the plot (default: model, + adapter).")
@click.option("--out", type=OUT_DIR, default=Path("out/distraction"), show_default=True,
              help="Folder for distraction.json and distraction.png.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (no table, no progress bars).")
def analyze_distraction(model, methods, options, adapter, trust_remote_code, data, text_field, ds, batches, max_docs,
                        label, out, as_json):
    """FoT's distraction measure: share of a memory layer's attention on its own document's previous
    context when d documents' previous contexts are visible (chance: 1/d).

    Runs fot's crossbatch attention (memory layers, local, positions from -o fot options).  Results
    accumulate in OUT/distraction.json by --label, so a model before and after crossbatch training
    land in one plot:

    \b
      lcx analyze distraction -m smollm2-135m -d ../shared/data/books -o local=256 --label base
      lcx analyze distraction -m smollm2-135m --adapter out/fot-xb -d ../shared/data/books --label crossbatch
    """
    from lcx.io import accumulated_runs, write_json
    from lcx.plugins.fot import distraction

    if methods and tuple(methods) != ("fot",):
        raise LcxError(f"analyze distraction measures fot's memory layers; drop --method {' '.join(methods)}")
    stack = methods or (() if adapter else ("fot",))  # else the adapter's methods
    if adapter and not methods:
        from lcx.adapters.peft_bridge import read_sidecar
        from lcx.session import adapter_methods

        has_fot = any(m["name"] == "fot" for m in adapter_methods(read_sidecar(adapter)))
    else:
        has_fot = "fot" in stack
    if has_fot and not any(o.split("=")[0].removeprefix("fot.") in ("gate", "gate_sinks") for o in options):
        # crossbatch attention never reads the gate: no calibration for it (gate_sinks, moot then, as an adapter's)
        options = (*options, "fot.gate=off", "fot.gate_sinks=true")
    s = _open(model, stack, options, adapter, trust_remote_code)
    try:
        if "fot" not in [m.name for m in s.run.methods]:
            raise LcxError(f"adapter {str(adapter)!r} was not trained with fot; add --method fot")
        docs = _ppl_documents(data, s.tokenizer, max_docs, text_field)
        result = distraction.measure(s.run, docs, ds, batches, progress=not as_json)
        result.update(model=model, adapter=str(adapter) if adapter else None, **s.run.describe())
    finally:
        s.close()
    label = label or (f"{model} + {Path(adapter).name}" if adapter else model)
    path = out / "distraction.json"
    command = "lcx " + " ".join(sys.argv[1:])
    with accumulated_runs(path) as runs:
        runs[label] = {"command": command, **result}  # each run keeps the command that measured it
        js = write_json({"command": command, "runs": runs}, path)
        png = distraction.plot(runs, out / "distraction.png", "FoT distraction: attention on the relevant context")
    if as_json:
        _echo_json({"json": str(js), "plot": str(png), "label": label, "positive_share": result["positive_share"]})
    else:
        for d, v in result["positive_share"].items():
            click.echo(f"d={d:>3}: positive share {v:.3f} (chance {1 / int(d):.3f})")
        click.echo(f"wrote {js} and {png}")
