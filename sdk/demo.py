"""The main demo: a passkey at 2x the model's window, through every installed method.

Honest results, whatever they are: ``none`` is the bare model on the whole
prompt (beyond its trained window), each method row attaches that method alone
with its default options, or with the ones ``options`` gives it (``{"fot": {"local": 1024}}``; each row
says which), over the adapter ``adapters`` gives it if any (``{"focusllm": "DIR"}``: its trained options under the
given ones).  Training-only methods (no inference stage, e.g. ``smt``) are left out.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from lcx.composition import attach
from lcx.errors import LcxError
from lcx.evals.passkey import NEEDLE, passkey_found, prompt_and_needle
from lcx.generation import generate
from lcx.measure import measure

NO_METHOD = "none"
NEW_TOKENS = 8


#: Stages that change what a model computes at inference; a method with none of them (smt: sampling
#: and loss only) is training-only and would just repeat the ``none`` row.
INFERENCE_STAGES = frozenset({"chunking", "memory", "attention", "patching"})


def acts_at_inference(cls) -> bool:
    return bool(INFERENCE_STAGES & set(cls.stages()))


def run_demo(model_name: str = "smollm2-135m", length: int | None = None, depth: float = 0.5,
             methods: list[str] | None = None, seed: int = 0, progress: bool = True,
             options: dict[str, dict[str, Any]] | None = None, dtype: Any = None,
             device: str | None = None, adapters: dict[str, str] | None = None) -> list[dict[str, Any]]:
    from lcx.adapters.families import context_window
    from lcx.models import dtype_name, load_model
    from lcx.registry import registry

    names = methods or [NO_METHOD, *sorted(n for n, cls in registry().methods.items() if acts_at_inference(cls))]
    unknown = [n for n in names if n != NO_METHOD and n not in registry().methods]
    if unknown:
        raise LcxError(f"no installed method is named {', '.join(map(repr, unknown))}; installed: "
                       f"{', '.join(sorted(registry().methods))} (or {NO_METHOD!r}: the bare model)")
    options = options or {}
    for name, opts in options.items():
        if not isinstance(opts, dict):
            raise LcxError(f"demo option {name}={opts!r} names no method; give METHOD.KEY=VALUE, "
                           f"e.g. -o fot.local=1024")
        _check_row(name, names, "options", "the option")
    adapters = adapters or {}
    for name in adapters:
        if name == NO_METHOD:
            raise LcxError(f"an adapter for {NO_METHOD!r}: that row is the bare model, with no method and no adapter; "
                           f"give the adapter to the method it was trained with (--adapter METHOD=DIR)")
        _check_row(name, names, "an adapter", "the adapter")
    model, tok = load_model(model_name, dtype=dtype, device=device)
    for name, adapter in adapters.items():  # a wrong adapter is refused before the first row's minutes, not after
        try:
            with row_model(model, name, adapter, options.get(name, {})):
                pass
        except LcxError as e:
            raise LcxError(f"--adapter {name}={adapter}: {e}") from None
    dtype_used = dtype_name(model.dtype)
    window = context_window(model)
    length = length or 2 * window
    key = random.Random(seed).randint(10000, 99999)
    ids, start = prompt_and_needle(tok, length, depth, key)
    ids = ids[None]
    span = (start, start + len(tok(" " + NEEDLE.format(key=key) + " ", add_special_tokens=False)["input_ids"]))
    rows = []
    for name in names:
        opts, adapter = options.get(name, {}), adapters.get(name)
        if progress:
            said = " ".join([*(f"{k}={v}" for k, v in opts.items()), *([f"adapter={adapter}"] if adapter else [])])
            said = f" ({said})" if said else ""
            print(f"[demo] {name}{said}: passkey {key} at depth {depth} in {ids.shape[1]} tokens ...", flush=True)
        row = {"method": name, "options": opts, "adapter": adapter, "prompt_tokens": int(ids.shape[1]),
               "window": window, "key": key, "dtype": dtype_used}
        try:
            with row_model(model, name, adapter, opts) as (on, methods, settled), \
                    attach(on, methods, **settled) as run, measure() as m:
                new = generate(run, ids, max_new_tokens=NEW_TOKENS)
        except LcxError as e:  # e.g. default options that do not fit a small model's window: one row, not the end
            rows.append({**row, "found": None, "output": f"error: {e}", "error": str(e), "seconds": None,
                         "peak_rss_mib": None})  # found: None, not False: the method did not run
            continue
        text = tok.decode(new[0], skip_special_tokens=True)
        found = passkey_found(key, text)
        rows.append({**row, "found": found, "output": text.strip(),
                     # every option as the row ran: defaults, an adapter's trained ones, what auto came to
                     "ran_with": {m.name: {**m.to_options(), **m.request_options()} for m in run.methods},
                     "why": explain(run, int(ids.shape[1]), NEW_TOKENS, span, window, found),
                     "seconds": round(m.result.seconds, 1), "peak_rss_mib": round(m.result.peak_rss_mib)})
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


def _check_row(name: str, names: list[str], given: str, drop: str) -> None:
    """Refuse ``given`` (options, an adapter) for a method that is not installed or has no row in this demo."""
    from lcx.registry import registry

    if name not in registry().methods:
        raise LcxError(f"{given} for {name!r}: no installed method has that name (`lcx methods` lists them)")
    if name not in names:
        raise LcxError(f"{given} for {name!r}, which the demo does not run (it runs: {', '.join(names)}); "
                       f"add --method {name} or drop {drop}")


@contextmanager
def row_model(model: Any, name: str, adapter: str | None, opts: dict[str, Any]) -> Iterator[tuple[Any, list[str], dict]]:
    """The model one row attaches to, its methods and their options: over ``adapter`` (loaded for the row, removed
    after it), the options the adapter was trained with under ``opts``."""
    from pathlib import Path

    from lcx.adapters.peft_bridge import SIDECAR, read_sidecar
    from lcx.evals.compare import stack_model
    from lcx.session import trained_methods

    if adapter is None:
        yield model, ([] if name == NO_METHOD else [name]), ({name: opts} if opts else {})
        return
    if (Path(adapter) / SIDECAR).is_file():  # else loading it says what the folder is instead
        trained = list(trained_methods(read_sidecar(adapter)))
        if trained != [name]:
            raise LcxError(f"adapter {adapter!r} was trained with {', '.join(trained) or 'no method'}, not {name} "
                           f"alone; give it to that method's row (--adapter {trained[0] if trained else 'METHOD'}=...) "
                           f"or drop it")
    with stack_model(model, adapter, [], {name: opts}) as (on, methods, settled):
        yield on, methods, settled


def explain(run, tokens: int, new: int, span: tuple[int, int], window: int, found: bool) -> str:
    """One line on why a row found or missed the key: what its methods let the model read (``Method.reach``),
    or for the bare model, where the prompt sits against its trained window."""
    said = [r for r in (m.reach(run, tokens, new, span) for m in run.methods) if r is not None]
    if not said:
        past = tokens + new > window
        said = [(not past, f"reads all {tokens:,} tokens" + (f", past its {window:,}-token window: positions it never "
                                                              "saw" if past else ", inside its window"))]
    read = all(ok for ok, _ in said)
    how = "; ".join(line for _, line in said)
    if found:
        return how if read else f"found anyway: {how}"
    return f"read, but not answered: {how}" if read else how


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    if not rows:
        return
    r0 = rows[0]
    t = Table(title=f"passkey {r0['key']} in {r0['prompt_tokens']} tokens (model window {r0['window']}, "
                    f"{r0.get('dtype', 'float32')})")
    t.add_column("method", overflow="fold")  # a long option (memory_layers=...) wraps instead of being cut
    for col in ("found key?", "output", "time (s)", "peak RSS (MiB)"):
        t.add_column(col)
    for r in rows:
        opts = r.get("options") or {}
        said = [*(f"{k}={v}" for k, v in opts.items()), *([f"adapter={r['adapter']}"] if r.get("adapter") else [])]
        method = r["method"] + "".join(f"\n {line}" for line in said)  # the options and adapter it ran with
        if r["seconds"] is None:
            t.add_row(method, "-", r["output"][:60], "-", "-")
        else:
            t.add_row(method, "yes" if r["found"] else "no", r["output"][:30], f"{r['seconds']:.1f}",
                      str(r["peak_rss_mib"]))
    console = Console()
    console.print(t)
    for r in rows:
        if r.get("why"):
            console.print(f"[bold]{r['method']}[/bold] {'found' if r['found'] else 'missed'} it: {r['why']}",
                          highlight=False)
