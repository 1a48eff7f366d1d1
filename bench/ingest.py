"""FoT ingest cost per token: a long prompt vs a short one, side by side in one run.

Feeds N tokens of the shared books through ``fot`` window by window (what
``lcx memory build`` and a long ``lcx generate`` do) and records the time of every
window, the peak resident memory and the memory's size.  Goal (issue 4): seconds
per token at the longest length <= 1.5 x at the shortest (no quadratic growth).

    .venv/bin/python bench/ingest.py [--lengths 8K,128K] [-o backend=faiss-ivf ...]
    python bench/ingest.py --device cuda --random-weights -o backend=torch ...   # a GPU machine

``--random-weights`` builds the model's architecture from its config.json with random weights (a
speed measurement does not depend on them): for a machine that has the config and tokenizer but not
the weights.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import lcx
from lcx.generation import make_plan, prefill
from lcx.io import pyplot, save_figure, token_counts
from lcx.measure import measure
from lcx.session import parse_options

from books import book_tokens  # bench/books.py (scripts here run as `python bench/NAME.py`)
from loading import bench_model, device_name, gpu_peak, reset_gpu_peak, sync
from provenance import environment

OUT = Path(__file__).parent / "results"
# the training-free configuration of results/fot (memory layers from `lcx analyze retrieval`)
DEFAULT = ["local=1024", "chunk=256", "memory_layers=6,7,8,14,15,17,18,19,20,21,22,23", "backend=faiss-ivf"]
# fot's defaults before issue 52, under any -o (ingest*.json were measured with them)
FOT_BEFORE = ["local=2048", "chunk=0", "sinks=0", "positions=first", "fixed_distance=0", "gate=off"]


def ingest(model, ids: torch.Tensor, options: dict) -> dict:
    times: list[tuple[int, float]] = []
    last = [time.perf_counter()]
    bar = tqdm(total=ids.shape[1], desc=f"ingest {ids.shape[1]}", unit="tok")

    def on_window(s: int, e: int) -> None:
        now = time.perf_counter()
        times.append((e, now - last[0]))
        last[0] = now
        bar.update(e - s)

    reset_gpu_peak(model)

    def on_window_synced(s: int, e: int) -> None:
        sync(model)  # a window's time is its work, not its launch
        on_window(s, e)

    with lcx.attach(model, ["fot"], fot=options) as run, measure() as m:
        cache = prefill(run, make_plan(run, ids, None, 0), include_last=True, on_window=on_window_synced)
        stores = [s for per in cache.lcx_stores.values() for s in per.values()]
        entries = sum(len(s) for s in stores)
        mem_bytes = sum(s.keys.numel() * 4 + s.values.numel() * s.values.element_size() for s in stores if len(s))
    bar.close()
    n = ids.shape[1]
    del cache, stores
    gc.collect()
    return {"tokens": n, "seconds": round(m.result.seconds, 2), "ms_per_token": round(1000 * m.result.seconds / n, 3),
            "peak_rss_mib": round(m.result.peak_rss_mib), "extra_rss_mib": round(m.result.extra_rss_mib),
            "memory_entries": entries, "memory_mib": round(mem_bytes / 2**20),
            **gpu_peak(model),
            "window_seconds": [[e, round(t, 3)] for e, t in times]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="8K,128K", help="token counts, shortest first (K suffix allowed)")
    ap.add_argument("-o", "--option", action="append", default=None, help=f"fot option KEY=VALUE (default: {DEFAULT})")
    ap.add_argument("--device", default=None, help="where the model runs: cpu (default), cuda (or LCX_DEVICE)")
    ap.add_argument("--random-weights", action="store_true",
                    help="the model's architecture with random weights (from its config.json; speed only)")
    ap.add_argument("--out", type=Path, default=OUT / "ingest.json")
    args = ap.parse_args()
    lengths = token_counts(args.lengths)
    options = parse_options(FOT_BEFORE + (args.option or DEFAULT))

    model, tok = bench_model(args.model, args.device, args.random_weights)
    ids = book_tokens(tok, max(lengths))
    ingest(model, ids[:, :2048], options)  # warm-up (first calls, allocator), not reported
    runs = [ingest(model, ids[:, :n], options) for n in lengths]
    ratio = runs[-1]["ms_per_token"] / runs[0]["ms_per_token"]
    result = {
        "benchmark": "fot ingest cost per token", "model": args.model, "fot_options": options,
        **environment(), "device": device_name(model), "random_weights": args.random_weights,
        "runs": runs, "ratio_longest_over_shortest": round(ratio, 3), "goal": "<= 1.5", "pass": ratio <= 1.5,
        "command": "python bench/ingest.py " + " ".join(f"-o {o}" for o in (args.option or DEFAULT)) + f" --lengths {args.lengths}"
                   + (f" --device {args.device}" if args.device else "") + (" --random-weights" if args.random_weights else ""),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    fig, ax = pyplot().subplots(figsize=(7, 3.5))
    for r in runs:
        xs = [e / 1024 for e, _ in r["window_seconds"]]
        prev = [0] + [e for e, _ in r["window_seconds"][:-1]]
        ys = [1000 * t / (e - p) for (e, t), p in zip(r["window_seconds"], prev)]
        ax.plot(xs, ys, lw=0.8, label=f"{r['tokens'] // 1024}K prompt: {r['ms_per_token']} ms/token overall")
    ax.set_xlabel("tokens ingested (K)")
    ax.set_ylabel("ms per token (window)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, args.out.with_suffix(".png"), f"fot ingest cost, {args.model}, ratio {ratio:.2f} (goal <= 1.5)")
    for r in runs:
        print(f"{r['tokens']:>7} tokens: {r['seconds']:8.1f}s  {r['ms_per_token']:.2f} ms/token  "
              f"peak RSS {r['peak_rss_mib']} MiB  memory {r['memory_entries']} entries / {r['memory_mib']} MiB")
    print(f"ratio {ratio:.2f} (goal <= 1.5); wrote {args.out}")


if __name__ == "__main__":
    main()
