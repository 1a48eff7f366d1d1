"""SMT vs standard training: time and peak memory of one training step vs sequence length (SMT paper, Table 5).

One optimizer step of SmolLM2 with a LoRA adapter on q/k (SMT's trainable state), batch 1, on a
window of N tokens of the shared books, for N in --lengths:

* smt: the real sampling + loss stages of ``lcx.plugins.smt`` (``budget`` tokens fed whatever N is;
  mixed loss with beta, as `lcx train --method smt` runs it);
* standard: the next-token loss over all N tokens.

The variants alternate length by length, round after round, in one run (this machine is noisy).
A standard step whose memory, extrapolated from the two shortest lengths, would not fit in the
machine's available memory is not started and is reported as "out of memory (predicted)".

    .venv/bin/python bench/smt_step.py [--lengths 4K,8K,16K,32K,64K] [--rounds 2] [-o budget=2048]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from pathlib import Path

import psutil
import torch
from tqdm.auto import tqdm

import lcx
from lcx.adapters.peft_bridge import add_adapter
from lcx.io import pyplot, save_figure, token_counts
from lcx.measure import measure
from lcx.models import load_model
from lcx.session import parse_options

from books import book_tokens  # bench/books.py (scripts here run as `python bench/NAME.py`)
from provenance import environment

OUT = Path(__file__).parent / "results"
DEFAULT = ["budget=2048", "window=512", "beta=1"]


def step(run, model, opt, ids: torch.Tensor, variant: str) -> dict:
    gc.collect()
    with measure() as m:
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        if variant == "smt":
            batch = run.hook.lcx_sample(run=run, batch=batch, step=0)
            loss = sum(t for r in run.hook.lcx_loss(run=run, model=model, batch=batch) for t in (r or {}).values())
        else:
            loss = model(input_ids=ids, attention_mask=batch["attention_mask"], labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    fed = int(batch["input_ids"].shape[1]) + (int(batch["smt_plain"].shape[1]) if "smt_plain" in batch else 0)
    return {"seconds": m.result.seconds, "peak_rss_mib": m.result.peak_rss_mib, "extra_rss_mib": m.result.extra_rss_mib,
            "tokens_fed": fed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="4K,8K,16K,32K,64K", help="sequence lengths, shortest first (K suffix allowed)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-o", "--option", action="append", default=None, help=f"smt option KEY=VALUE (default: {DEFAULT})")
    ap.add_argument("--out", type=Path, default=OUT / "smt_step.json")
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from an existing --out JSON")
    args = ap.parse_args()
    if args.plot_only:
        print(f"wrote {plot(json.loads(args.out.read_text()), args.out.with_suffix('.png'))}")
        return
    lengths = token_counts(args.lengths)
    options = parse_options(args.option or DEFAULT)

    model, tok = load_model(args.model)
    model = add_adapter(model, roles=("q", "k"), rank=8)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, foreach=True)
    run = lcx.attach(model, ["smt"], smt=options)
    ids = book_tokens(tok, max(lengths))
    step(run, model, opt, ids[:, :1024], "standard")  # warm-up, not reported

    times: dict[str, dict[int, list[dict]]] = {"smt": {n: [] for n in lengths}, "standard": {n: [] for n in lengths}}
    skipped: dict[int, str] = {}
    bar = tqdm(total=args.rounds * len(lengths) * 2, desc="steps")
    for _ in range(args.rounds):
        for n in lengths:
            for variant in ("smt", "standard"):
                if variant == "standard" and n in skipped:
                    bar.update(1)
                    continue
                if variant == "standard" and len([k for k in lengths if times["standard"][k]]) >= 2 and not times["standard"][n]:
                    need = predicted_mib(times["standard"], n)
                    free = psutil.virtual_memory().available / 2**20
                    if need > 0.8 * free:
                        skipped[n] = f"out of memory (predicted {need / 1024:.1f} GiB > 80% of {free / 1024:.1f} GiB available)"
                        bar.update(1)
                        continue
                times[variant][n].append(step(run, model, opt, ids[:, :n], variant))
                bar.update(1)
                bar.set_postfix(n=n, v=variant, s=f"{times[variant][n][-1]['seconds']:.1f}")
    bar.close()

    rows = []
    for n in lengths:
        row = {"tokens": n}
        for v in ("smt", "standard"):
            if times[v][n]:
                row[v] = {"median_seconds": round(statistics.median(r["seconds"] for r in times[v][n]), 2),
                          "peak_rss_mib": round(max(r["peak_rss_mib"] for r in times[v][n])),
                          "tokens_fed": times[v][n][0]["tokens_fed"], "rounds": [round(r["seconds"], 2) for r in times[v][n]]}
            else:
                row[v] = {"skipped": skipped.get(n, "not run")}
        rows.append(row)
    smt_ratio = rows[-1]["smt"]["median_seconds"] / rows[0]["smt"]["median_seconds"]
    result = {
        "benchmark": "SMT vs standard training step (SMT Table 5)", "model": args.model, "smt_options": options,
        "adapter": "LoRA r=8 on q_proj, k_proj", "batch": 1, **environment(), "rows": rows,
        "smt_ratio_longest_over_shortest": round(smt_ratio, 3), "goal": "<= 1.05", "pass": smt_ratio <= 1.05,
        "command": "python bench/smt_step.py " + " ".join(f"-o {o}" for o in (args.option or DEFAULT))
                   + f" --lengths {args.lengths} --rounds {args.rounds}",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    for r in rows:
        cells = [f"{v} " + (f"{r[v]['median_seconds']:7.1f}s {r[v]['peak_rss_mib']:>6} MiB" if "median_seconds" in r[v]
                            else r[v]["skipped"]) for v in ("smt", "standard")]
        print(f"{r['tokens']:>6} tokens: " + " | ".join(cells))
    print(f"SMT step {lengths[-1]} / {lengths[0]}: {smt_ratio:.3f} (goal <= 1.05); wrote {args.out}")


def plot(result: dict, path: Path) -> Path:
    rows, lengths = result["rows"], [r["tokens"] for r in result["rows"]]
    fig, ax = pyplot().subplots(figsize=(6, 3.6))
    for v, style in (("smt", "o-"), ("standard", "s--")):
        xs = [r["tokens"] for r in rows if "median_seconds" in r[v]]
        ax.plot(xs, [r[v]["median_seconds"] for r in rows if "median_seconds" in r[v]], style, label=v)
    top = ax.get_ylim()[1]
    for r in rows:
        if "skipped" in r["standard"]:
            ax.annotate("standard:\nOOM (pred.)", (r["tokens"], top * 0.85), ha="center", color="C1", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{n // 1024}K" for n in lengths])
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("seconds per training step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left")
    return save_figure(fig, path, f"SMT vs standard training step, {result['model']}: SMT {lengths[-1] // 1024}K / "
                       f"{lengths[0] // 1024}K = {result['smt_ratio_longest_over_shortest']:.2f}")


def predicted_mib(standard: dict[int, list[dict]], n: int) -> float:
    """Peak extra memory of a standard step at n tokens, extrapolated linearly from the measured ones."""
    pts = sorted((k, max(r["extra_rss_mib"] for r in v)) for k, v in standard.items() if v)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    slope = (y1 - y0) / (x1 - x0) if x1 != x0 else y1 / x1
    return y1 + slope * (n - x1)


if __name__ == "__main__":
    main()
