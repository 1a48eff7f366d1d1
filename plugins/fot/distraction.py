"""The distraction issue, measured (FoT, Tworkowski et al. 2023, section 3.3 / Figure 3).

A batch holds one document per row, each as two contexts of ``L`` tokens: the previous context
and the current one.  Under crossbatch attention a memory layer's queries in the current context
see, besides their own context, the previous context of their own document (the relevant keys) and
of ``d - 1`` other documents (distractors).  The *positive share* is the attention mass on the
relevant keys divided by the mass on all ``d`` previous contexts; a model that cannot tell them apart
scores about ``1/d``.  Crossbatch training is meant to raise it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from lcx.errors import LcxError
from lcx.generation import model_device
from lcx.io import pyplot, save_figure
from lcx.plugins.fot import crossbatch


def batches(documents: list[tuple[str, list[int]]], local: int, n_batches: int) -> list[torch.Tensor]:
    """``n_batches`` batches (rows = documents) of ``2 * local`` consecutive tokens, taken at
    different, evenly spaced places of every document."""
    need = 2 * local
    short = [name for name, ids in documents if len(ids) < need * n_batches]
    if short:
        raise LcxError(f"document {short[0]!r} is shorter than {need * n_batches} tokens ({n_batches} batches of "
                       f"2 x local); lower --local or --batches")
    out = []
    for b in range(n_batches):
        rows = []
        for _, ids in documents:
            start = b * (len(ids) - need) // max(n_batches - 1, 1) if n_batches > 1 else 0
            rows.append(ids[start:start + need])
        out.append(torch.tensor(rows))
    return out


@torch.no_grad()
def measure(run: Any, documents: list[tuple[str, list[int]]], ds: list[int], n_batches: int,
            progress: bool = True) -> dict[str, Any]:
    fot = run.method("fot")
    n = len(documents)
    if max(ds) > n:
        raise LcxError(f"d={max(ds)} needs at least {max(ds)} documents (one per batch row), got {n}; "
                       f"give more documents or smaller --ds")
    layers = fot.layer_indices(run)
    run.memory = None  # a training-style forward: no inference memory
    device = model_device(run.model)
    data = [ids.to(device) for ids in batches(documents, fot.local, n_batches)]
    per_d: dict[str, dict[str, float]] = {}
    bar = tqdm(total=len(ds) * len(data), desc="distraction", disable=not progress)
    for d in ds:
        lay = crossbatch.layout(fot.local, 1, d)
        share = {i: [] for i in layers}
        for ids in data:
            run.state["crossbatch"], run.state["crossbatch_probe"] = lay, {}
            try:
                run.model(input_ids=ids, position_ids=crossbatch.chunk_positions(ids.shape[0], lay).to(device))
                probe = run.state["crossbatch_probe"]
            finally:
                run.state.pop("crossbatch", None)
                run.state.pop("crossbatch_probe", None)
            for i in layers:
                for rec in probe.get(i, []):
                    if rec["context"] == 1 and rec["negatives"] == d - 1:  # rows that see all d documents
                        r = rec["mass_positive"] / rec["mass_memory"].clamp_min(1e-12)
                        share[i].append(float(r.mean()))  # over heads and queries
            bar.update(1)
        per_d[str(d)] = {str(i): sum(v) / len(v) for i, v in share.items() if v}
    bar.close()
    mean = {d: sum(v.values()) / len(v) for d, v in per_d.items() if v}
    return {"local": fot.local, "memory_layers": layers, "documents": [name for name, _ in documents],
            "batches": n_batches, "ds": ds, "positive_share": mean, "positive_share_by_layer": per_d,
            "chance": {str(d): 1 / d for d in ds}}


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> Path:
    """Positive share vs d, one line per model (and the 1/d of a model that cannot tell)."""
    fig, ax = pyplot().subplots(figsize=(5.5, 3.6))
    for label, r in results.items():
        ds = [int(d) for d in r["positive_share"]]
        ax.plot(ds, list(r["positive_share"].values()), marker="o", label=label)
    ds = sorted({int(d) for r in results.values() for d in r["ds"]})
    ax.plot(ds, [1 / d for d in ds], ls="--", color="grey", label="1/d (no focus)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ds, [str(d) for d in ds])
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("documents visible to the memory layer (d)")
    ax.set_ylabel("attention share on own previous context")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path, title)
