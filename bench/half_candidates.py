"""fot's exact kNN search, float32 against half-precision candidates, by the number of queries a search asks.

The half path (``top_inner_products`` with a ``select_dtype``) converts every memory key to the half dtype per
call and takes a few spare candidates; the product it saves grows with queries x keys.  This sweeps the
queries per search (a decode step asks a few per KV head; a prefill block, hundreds to thousands) and the
memory's size, and reports where the half path pays, against the rule fot's search applies (``half_pays``).
Both paths run side by side in one process.  ``--model`` times both paths on every search of a real fot
prefill instead (each call once, the order alternating), among the model's other work.

    .venv/bin/python bench/half_candidates.py [--dtype bfloat16] [--out bench/results/half_candidates.json]
    .venv/bin/python bench/half_candidates.py --model qwen2.5-0.5b --tokens 16K \
        --out bench/results/half_candidates-qwen.json
    python bench/half_candidates.py --device cuda --dtype float16 --out bench/results/half_candidates-cuda.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lcx.plugins.fot import memory
from provenance import environment  # bench/provenance.py (scripts here run as `python bench/NAME.py`)

# qwen_fot64's configuration (bench/fot_profile.py's default): local 4K, chunk 1K, 18 memory layers, gate 1
FOT = ["local=4096", "chunk=1024", "memory_layers=3,5,6,7,9,10,11,12,13,14,15,16,17,18,19,20,21,22", "gate=1"]

OUT = Path(__file__).parent / "results" / "half_candidates.json"


def rule() -> dict:
    return {"min_queries": memory.HALF_MIN_QUERIES, "min_keys": memory.HALF_MIN_KEYS,
            "min_scores": memory.HALF_MIN_SCORES, "any_keys": memory.HALF_ANY_KEYS}


def best_of(fn, device: torch.device, budget: float = 0.5) -> float:
    """The best time of ``fn`` over ``budget`` seconds of calls, each from cold caches, as in a prefill, where
    every search follows a layer's other work."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    evict = torch.empty(64 << 20, dtype=torch.uint8, device=device)  # larger than the last-level cache
    fn()  # warm-up
    sync()
    best, spent = float("inf"), 0.0
    for _ in range(200):  # an eviction costs more than a small call: cap the calls, not only their time
        if spent >= budget:
            break
        evict.add_(1)
        sync()
        t = time.perf_counter()
        fn()
        sync()
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="float16: on a GPU")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda")
    ap.add_argument("--queries", default="1,2,4,16,64,256,1792", help="queries per search (1,792: Qwen2.5's 7 query "
                    "heads per KV head x a 256-query block)")
    ap.add_argument("--keys", default="2048,4096,8192,12288,16384,24576,32768,65536", help="memory entries")
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--model", default=None, help="time both paths on every search of this model's fot prefill")
    ap.add_argument("--tokens", default="16K", help="--model: the prompt's length (K suffix allowed)")
    ap.add_argument("-o", "--option", action="append", default=None, help=f"--model: fot KEY=VALUE (default: {FOT})")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    half, dev = getattr(torch, a.dtype), torch.device(a.device)
    if a.model and a.device != "cpu":
        raise SystemExit("--model runs its prefill on the CPU: leave --device out")
    if not memory._fast_half(half, dev):
        raise SystemExit(f"{a.dtype} products are not fast on {a.device} here, so fot never takes the half path: "
                         "try --dtype bfloat16 on a CPU with avx512_bf16 or AMX, or --device cuda")
    if a.model:
        return in_situ(a)
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in (int(x) for x in a.keys.split(",")):
        keys = torch.randn(n, a.dim, generator=g).to(dev)
        for q in (int(x) for x in a.queries.split(",")):
            queries = torch.randn(q, a.dim, generator=g).to(dev)
            # the half path forced, below the thresholds too: this is what sets them
            f32 = best_of(lambda: memory.top_inner_products(queries, keys, a.k), dev)
            h = best_of(lambda: memory.top_inner_products(queries, keys, a.k, half, pays=lambda q, n: True), dev)
            taken = memory.half_pays(q, n)
            rows.append({"keys": n, "queries": q, "float32_ms": f32 * 1e3, "half_ms": h * 1e3, "speedup": f32 / h,
                         "half_by_default": taken})
            print(f"keys {n:>6}  queries {q:>5}  float32 {f32 * 1e3:8.3f} ms  {a.dtype} candidates "
                  f"{h * 1e3:8.3f} ms  {f32 / h:5.2f}x  {'half' if taken else 'float32'} by default", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"benchmark": "half_candidates", **environment(), "device": a.device,
                                 "dtype": a.dtype, "k": a.k, "dim": a.dim,
                                 "rule": rule(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {a.out}")


def in_situ(a) -> None:
    """Both paths timed on each search of one fot prefill (the answer it goes on with: the float32 one)."""
    import lcx
    from lcx.generation import make_plan, prefill
    from lcx.io import token_counts
    from lcx.session import parse_options

    from books import book_tokens  # bench/books.py
    from loading import bench_model

    model, tok = bench_model(a.model, None, False, a.dtype)
    n_tokens = token_counts(a.tokens)[0]
    ids = book_tokens(tok, n_tokens)
    exact, calls = memory.top_inner_products, []

    def both(queries, keys, k, select_dtype=None, pays=None):
        timed = []
        for half in ((False, True) if len(calls) % 2 else (True, False)):
            t = time.perf_counter()
            out = exact(queries, keys, k, select_dtype if half else None, pays=lambda q, n: True)
            timed.append((half, time.perf_counter() - t, out))
        f32, h = (next(t for half, t, _ in timed if half == want) for want in (False, True))
        calls.append({"queries": queries.shape[0], "keys": keys.shape[0], "float32_s": f32, "half_s": h})
        return next(out for half, _, out in timed if not half)

    memory.top_inner_products = both
    try:
        with lcx.attach(model, ["fot"], fot=parse_options(a.option or FOT)) as r:
            prefill(r, make_plan(r, ids, None, 0), include_last=True)
    finally:
        memory.top_inner_products = exact
    rows = []
    for lo, hi in ((0, 2048), (2048, 4096), (4096, 8192), (8192, 16384), (16384, 1 << 40)):
        part = [c for c in calls if lo <= c["keys"] < hi]
        if part:
            f32, h = sum(c["float32_s"] for c in part), sum(c["half_s"] for c in part)
            rows.append({"keys_from": lo, "keys_below": hi, "searches": len(part), "float32_s": f32, "half_s": h,
                         "speedup": f32 / h, "rule_sends_half": sum(memory.half_pays(c["queries"], c["keys"])
                                                                    for c in part)})
            print(f"keys {lo:>6}-{min(hi, 1 << 20):<7}  {len(part):>5} searches  float32 {f32:7.2f} s  {a.dtype} "
                  f"candidates {h:7.2f} s  {f32 / h:5.2f}x  ({rows[-1]['rule_sends_half']} sent to half by the rule)")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"benchmark": "half_candidates in situ", **environment(), "model": a.model,
                                 "dtype": a.dtype, "tokens": n_tokens, "fot": a.option or FOT, "rule": rule(),
                                 "buckets": rows, "calls": calls}, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
