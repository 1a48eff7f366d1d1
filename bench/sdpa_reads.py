"""One served prompt piece read on its own, both ways lcx's ``sdpa`` can read it, side by side, alternating:
``rows_sdpa`` (the G query heads of a KV head as G x n rows of it) and ``gqa_sdpa`` (SDPA's own GQA), each in
blocks of queries.  ``sdpa`` reads a piece as rows while G x n is at most ``GQA_ROWS``, a longer one by GQA; the
shapes: the pieces served streaming and fot read (512 and 256 or 1,024 queries) and focusllm's longer ones.

    .venv/bin/python bench/sdpa_reads.py [--threads 2] [--repeats 5] [--dtype bfloat16] [--seed 0]
        [--shapes 9/3x512x8192,14/2x2048x4096x64] [--out bench/results/sdpa_reads.json]

A shape is HEADS/KV_HEADS x QUERIES x KEYS [x HEAD_DIM] (head dim 64 unless given); the last QUERIES keys are
the queries themselves, causally, as in a prompt piece.  Each way's time is the median of ``--repeats`` reads
after one untimed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from provenance import write_results  # bench/provenance.py (scripts here run as `python bench/NAME.py`)

OUT = Path(__file__).parent / "results"
#: SmolLM2's (9/3) and Qwen2.5 0.5B's (14/2) heads, pieces of 128 to 2,048 queries against 8,192 keys
SHAPES = ",".join(f"{h}x{n}x8192" for h in ("9/3", "14/2") for n in (128, 256, 512, 768, 1024, 1536, 2048))


def shape(text: str) -> tuple[int, int, int, int, int]:
    """HEADS/KV_HEADS x QUERIES x KEYS [x HEAD_DIM] as five ints."""
    try:
        heads, *rest = text.split("x")
        h, kv = heads.split("/")
        queries, keys, dim = (*rest, 64) if len(rest) == 2 else rest
        dims = int(h), int(kv), int(queries), int(keys), int(dim)
    except ValueError:
        raise SystemExit(f"--shapes {text!r}: give HEADS/KV_HEADS x QUERIES x KEYS [x HEAD_DIM], "
                         "e.g. 14/2x2048x4096 or 4/1x1024x16384x256") from None
    if min(dims) < 1 or dims[0] % dims[1] or dims[2] > dims[3]:
        raise SystemExit(f"--shapes {text!r}: every number at least 1, heads a multiple of KV heads, queries at most keys")
    return dims


def main() -> None:
    from lcx.integrations.vllm.attention import GQA_ROWS, causal_tail, gqa_sdpa, rows_sdpa

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated HEADS/KV_HEADS x QUERIES x KEYS [x HEAD_DIM]")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--repeats", type=int, default=5, help="timed reads per way and shape (after one untimed)")
    ap.add_argument("--seed", type=int, default=0, help="torch seed of the random q/k/v")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="q/k/v's dtype")
    ap.add_argument("--out", type=Path, default=OUT / "sdpa_reads.json")
    args = ap.parse_args()
    shapes = [shape(s.strip()) for s in args.shapes.split(",")]
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype, results = getattr(torch, args.dtype), []
    for heads, kv, n, keys, dim in shapes:
        q = torch.randn(heads, n, dim, dtype=dtype)
        k, v = torch.randn(kv, keys, dim, dtype=dtype), torch.randn(kv, keys, dim, dtype=dtype)
        allowed = causal_tail(n, keys, q.device)
        times = {"rows": [], "gqa": []}
        for i in range(args.repeats + 1):
            for way, read in (("rows", rows_sdpa), ("gqa", gqa_sdpa)):
                t = time.perf_counter()
                read(q, k, v, allowed, dim ** -0.5)
                if i:  # the first read of each way warms its kernels
                    times[way].append(round(time.perf_counter() - t, 4))
        median = {way: statistics.median(ts) for way, ts in times.items()}
        results.append({"heads": heads, "kv_heads": kv, "queries": n, "keys": keys, "head_dim": dim, "seconds": times,
                     "rows_over_gqa": round(median["rows"] / median["gqa"], 3),
                     "lcx_reads": "rows" if heads // kv * n <= GQA_ROWS else "gqa"})
        print(f"{heads}/{kv} heads x {dim}, {n} queries x {keys} keys: rows {median['rows']:.3f} s, "
              f"gqa {median['gqa']:.3f} s, rows/gqa {results[-1]['rows_over_gqa']} (lcx: {results[-1]['lcx_reads']})",
              flush=True)
    write_results(args, results)


if __name__ == "__main__":
    main()
