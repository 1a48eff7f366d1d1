"""kNN search over a large memory: FAISS approximate vs exact, torch vs FAISS exact.

Keys are 64-dimensional (SmolLM2's head_dim), drawn from a mixture of Gaussians
(attention keys are clustered; pure Gaussian noise is the worst case for any
index, reported with --random).  For each approximate index the benchmark sweeps
its search knob and reports the fastest setting whose recall@k against exact
search is >= 0.95.  All variants search the same queries in one run.

    .venv/bin/python bench/knn.py [--n 1000000] [--queries 256] [--k 32] [--hnsw] [--gpu --out FILE]

--gpu adds exact search on a CUDA GPU: the torch store with its keys there and faiss-gpu (lcx[gpu]).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from lcx.plugins.fot.memory import StoreConfig, make_store, recall_at_k

OUT = Path(__file__).parent / "results" / "knn.json"


def data(n: int, q: int, d: int, random: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if random:
        return torch.randn(n, d, generator=g), torch.randn(q, d, generator=g)
    centers = torch.randn(4096, d, generator=g) * 2
    keys = centers[torch.randint(0, 4096, (n,), generator=g)] + torch.randn(n, d, generator=g)
    queries = centers[torch.randint(0, 4096, (q,), generator=g)] + torch.randn(q, d, generator=g)
    return keys, queries


def timed_search(store, queries: torch.Tensor, k: int, repeat: int = 3) -> tuple[float, torch.Tensor]:
    best, idx = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        _, idx = store.search(queries, k)
        if idx.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, idx.cpu()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=256)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--random", action="store_true", help="pure Gaussian keys (worst case)")
    ap.add_argument("--hnsw", action="store_true", help="also build an HNSW index (minutes at 1M on 2 cores)")
    ap.add_argument("--gpu", action="store_true", help="also search on a CUDA GPU: torch exact and faiss-gpu")
    ap.add_argument("--out", type=Path, default=OUT, help=f"where the JSON goes (default {OUT})")
    args = ap.parse_args()

    keys, queries = data(args.n, args.queries, args.dim, args.random)
    values = torch.zeros(args.n, 1)
    pos = torch.arange(args.n)
    rows = []

    def build(kind: str, device: str = "cpu", **cfg):
        t0 = time.perf_counter()
        s = make_store(StoreConfig(kind=kind, **cfg))
        s.add(keys.to(device), values.to(device), pos)
        return s, time.perf_counter() - t0

    exact_torch, bt = build("torch")
    t_torch, ref = timed_search(exact_torch, queries, args.k)
    rows.append({"index": "torch exact", "build_s": bt, "search_s": t_torch, "recall": 1.0})
    flat, bt = build("faiss-flat")
    t_flat, idx = timed_search(flat, queries, args.k)
    rows.append({"index": "faiss flat (exact)", "build_s": bt, "search_s": t_flat, "recall": recall_at_k(ref, idx)})
    del exact_torch
    gpu = {}
    if args.gpu:  # exact search on the GPU: torch with its keys there, and FAISS's flat GPU index
        on_gpu, bt = build("torch", "cuda")
        gpu["torch_cuda_s"], idx = timed_search(on_gpu, queries.cuda(), args.k)
        rows.append({"index": "torch exact (cuda)", "build_s": bt, "search_s": gpu["torch_cuda_s"],
                     "recall": recall_at_k(ref, idx)})
        del on_gpu
        fg, bt = build("faiss-gpu")
        gpu["faiss_gpu_s"], idx = timed_search(fg, queries, args.k)
        rows.append({"index": "faiss gpu flat (exact)", "build_s": bt, "search_s": gpu["faiss_gpu_s"],
                     "recall": recall_at_k(ref, idx)})
        gpu["device"] = torch.cuda.get_device_name()
        gpu["faiss_flat_cpu_over_faiss_gpu"] = t_flat / gpu["faiss_gpu_s"]
        del fg

    nlist = int(4 * np.sqrt(args.n))
    ivf, bt = build("faiss-ivf", nlist=nlist)
    for nprobe in (1, 2, 4, 8, 16, 32, 64, 128):
        ivf.index.nprobe = nprobe
        t, idx = timed_search(ivf, queries, args.k)
        rows.append({"index": f"faiss ivf nlist={nlist} nprobe={nprobe}", "build_s": bt, "search_s": t,
                     "recall": recall_at_k(ref, idx)})
    if args.hnsw:
        hnsw, bt = build("faiss-hnsw", hnsw_m=32, ef_construction=128)
        for ef in (16, 32, 64, 128, 256):
            hnsw.index.hnsw.efSearch = ef
            t, idx = timed_search(hnsw, queries, args.k)
            rows.append({"index": f"faiss hnsw M=32 ef={ef}", "build_s": bt, "search_s": t,
                         "recall": recall_at_k(ref, idx)})

    ok = [r for r in rows if r["index"].startswith("faiss ivf") or r["index"].startswith("faiss hnsw")]
    ok = [r for r in ok if r["recall"] >= 0.95]
    best = min(ok, key=lambda r: r["search_s"]) if ok else None
    summary = {
        "n": args.n, "queries": args.queries, "k": args.k, "dim": args.dim, "data": "random" if args.random else "clustered",
        "torch_over_faiss_flat": t_torch / t_flat,
        "best_approximate": best and best["index"],
        "approx_speedup_over_faiss_flat": best and t_flat / best["search_s"],
        "approx_recall": best and best["recall"],
        "goal": "approximate >= 5x faster than exact at recall@k >= 0.95",
        "pass": bool(best and t_flat / best["search_s"] >= 5),
        "cpu_threads": torch.get_num_threads(),
        **({"gpu": gpu} if gpu else {}),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    for r in rows:
        print(f"{r['index']:<40} build {r['build_s']:7.1f}s  search {1000 * r['search_s']:9.1f} ms  recall@{args.k} {r['recall']:.3f}")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
