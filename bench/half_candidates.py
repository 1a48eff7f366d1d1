"""fot's exact kNN search, float32 against half-precision candidates, by the number of queries a search asks.

The half path (``top_inner_products`` with a ``select_dtype``) converts every memory key to the half dtype per
call and takes a few spare candidates; the product it saves grows with queries x keys.  This sweeps the
queries per search (a decode step asks a few per KV head; a prefill block, hundreds to thousands) and the
memory's size, and reports where the half path pays, against the rule fot's search applies (``half_pays``).
Both paths run side by side in one process.

    .venv/bin/python bench/half_candidates.py [--dtype bfloat16] [--out bench/results/half_candidates.json]
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

OUT = Path(__file__).parent / "results" / "half_candidates.json"


def best_of(fn, device: torch.device, budget: float = 0.5) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # warm-up
    sync()
    best, spent = float("inf"), 0.0
    while spent < budget:
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
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    half, dev = getattr(torch, a.dtype), torch.device(a.device)
    if not memory._fast_half(half, dev):
        raise SystemExit(f"{a.dtype} products are not fast on {a.device} here, so fot never takes the half path: "
                         "try --dtype bfloat16 on a CPU with avx512_bf16 or AMX, or --device cuda")
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
                                 "rule": {"min_keys": memory.HALF_MIN_KEYS, "min_scores": memory.HALF_MIN_SCORES,
                                          "any_keys": memory.HALF_ANY_KEYS}, "rows": rows}, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
