"""The main demo: a passkey at 2x the model's window, through every installed method.

Honest results, whatever they are: ``none`` is the bare model on the whole
prompt (beyond its trained window), each method row attaches that method alone
with its default options.  Training-only methods (no inference stage, e.g. ``smt``) are left out.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from lcx.composition import attach
from lcx.errors import LcxError
from lcx.evals.passkey import build_prompt_ids
from lcx.generation import generate
from lcx.measure import measure

NO_METHOD = "none"


#: Stages that change what a model computes at inference; a method with none of them (smt: sampling
#: and loss only) is training-only and would just repeat the ``none`` row.
INFERENCE_STAGES = frozenset({"chunking", "memory", "attention", "patching"})


def acts_at_inference(cls) -> bool:
    return bool(INFERENCE_STAGES & set(cls.stages()))


def run_demo(model_name: str = "smollm2-135m", length: int | None = None, depth: float = 0.5,
             methods: list[str] | None = None, seed: int = 0, progress: bool = True) -> list[dict[str, Any]]:
    from lcx.adapters.families import context_window
    from lcx.models import load_model
    from lcx.registry import registry

    model, tok = load_model(model_name)
    window = context_window(model)
    length = length or 2 * window
    key = random.Random(seed).randint(10000, 99999)
    ids = build_prompt_ids(tok, length, depth, key)[None]
    names = methods or [NO_METHOD, *sorted(n for n, cls in registry().methods.items() if acts_at_inference(cls))]
    rows = []
    for name in names:
        if progress:
            print(f"[demo] {name}: passkey {key} at depth {depth} in {ids.shape[1]} tokens ...", flush=True)
        try:
            with attach(model, [] if name == NO_METHOD else [name]) as run, measure() as m:
                new = generate(run, ids, max_new_tokens=8)
        except LcxError as e:  # e.g. default options that do not fit a small model's window: one row, not the end
            rows.append({"method": name, "prompt_tokens": int(ids.shape[1]), "window": window, "key": key,
                         "found": False, "output": f"error: {e}", "seconds": None, "peak_rss_mib": None})
            continue
        text = tok.decode(new[0], skip_special_tokens=True)
        rows.append({
            "method": name, "prompt_tokens": int(ids.shape[1]), "window": window, "key": key,
            "found": str(key) in text.replace(" ", ""), "output": text.strip(),
            "seconds": round(m.result.seconds, 1), "peak_rss_mib": round(m.result.peak_rss_mib),
        })
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    if not rows:
        return
    r0 = rows[0]
    t = Table(title=f"passkey {r0['key']} in {r0['prompt_tokens']} tokens (model window {r0['window']})")
    for col in ("method", "found key?", "output", "time (s)", "peak RSS (MiB)"):
        t.add_column(col)
    for r in rows:
        if r["seconds"] is None:
            t.add_row(r["method"], "-", r["output"][:60], "-", "-")
        else:
            t.add_row(r["method"], "yes" if r["found"] else "no", r["output"][:30], f"{r['seconds']:.1f}",
                      str(r["peak_rss_mib"]))
    Console().print(t)
