"""`lcx memory build`: index documents once into a reusable memory (fot multi-document mode)."""

from __future__ import annotations

from pathlib import Path

import click

from lcx.cli.base import (
    CONTEXT, OUT_DIR, LcxGroup, _device, _dtype, _echo_json, _with_limits, device_option, limit_options, main, model_option,
    text_field_option,
)
from lcx.errors import LcxError


@main.group("memory", cls=LcxGroup, context_settings=CONTEXT)
def memory_grp() -> None:
    """Build document memories once, query them many times (fot multi-document mode)."""


@memory_grp.command("build", context_settings=CONTEXT)
@model_option
@click.option("--method", "methods", multiple=True, default=("fot",), show_default=True, help="The memory method.")
@click.option("--option", "-o", "options", multiple=True, metavar="KEY=VALUE", help="Method option (fot).")
@click.option("--adapter", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              help="Index with this adapter applied (e.g. a crossbatch-trained fot adapter): its projections make "
                   "the memory's keys and values, as they do when `lcx generate --adapter` reads them.")
@click.option("--out", required=True, type=OUT_DIR, help="Folder for memory.safetensors + memory.json.")
@click.option("--overwrite", is_flag=True, help="Replace an existing memory folder.")
@limit_options
@device_option
@text_field_option
@click.option("--json", "as_json", is_flag=True, help="Print what was indexed as JSON (no progress bars).")
@click.argument("docs", nargs=-1, required=True, type=click.Path(path_type=Path))
def memory_build(model, methods, options, adapter, out, overwrite, text_field, as_json, docs):
    """Index DOCS (text files or folders) into a kNN memory saved to --out.

    \b
    Example:
      lcx memory build -m smollm2-135m --out out/mem ../shared/data/books/wells_invisible_man.txt
      lcx generate -m smollm2-135m --method fot --memory out/mem -p "Who is Griffin?"
      lcx memory build -m smollm2-135m --adapter out/fot-xb --out out/mem-xb BOOKS...   # read with --adapter out/fot-xb
    """
    from tqdm.auto import tqdm

    from lcx.adapters.peft_bridge import adapter_digest, base_identity
    from lcx.data import iter_documents
    from lcx.memory import save_memory
    from lcx.session import open_session, parse_options

    if list(methods) != ["fot"]:
        raise LcxError(f"memory build supports the fot method, got {', '.join(methods)}")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise LcxError(f"memory folder {str(out)!r} exists; pass --overwrite to replace it")
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
    try:
        fot = s.run.method("fot")
        listed = []
        for i, d in enumerate(tqdm(documents, desc="indexing", unit="doc", disable=as_json)):
            ids = s.tokenizer(d["text"], add_special_tokens=False, return_tensors="pt")["input_ids"]
            listed.append({"doc_id": i, "source": d["source"], "tokens": fot.ingest(s.run, ids, i, progress=not as_json)})
        stores = fot.stores_for_saving()
        built_with = {"path": str(adapter), "sha256": adapter_digest(adapter)} if adapter else None
        save_memory(stores, out, {"model": base_identity(s.model), "method": s.run.describe()["methods"][0],
                                  "adapter": built_with, "documents": listed, "dtype": s.run.dtype})
    finally:
        s.close()
    entries = len(next(iter(stores.values()))) if stores else 0
    if as_json:
        _echo_json({"out": str(out), "documents": listed, "entries_per_layer_and_head": entries,
                    "memory_layers": sorted({layer for layer, _ in stores})})
        return
    click.echo(f"indexed {len(listed)} document(s), {entries} entries per layer and head, into {out}")
