"""fot's memory sharded over Ray actors against one process: build time, search latency, recall, memory.

The same clustered 64-dimensional keys (bench/knn.py's mixture of Gaussians, generated batch by batch so the
keys are never all held here) go into one configuration at a time: a one-process store of each kind, then a
Ray memory (``make_store(kind="ray", shards=N, shard_kind=kind)``) on 1, 2, 4 ... shards; each is built,
searched and torn down (Ray shut down: its actors end) before the next, so at most one memory is in RAM.

Searches are those fot sends to one (layer, KV head) store (plugins/fot/attention.py): the G query heads of a
KV head for each token, G x 1 in decode and G x ``block`` per prefill block.  Each search is timed with the
values of the entries it found (fot reads them next; a Ray memory fetches them with the search), median over
distinct query batches.  Recall@k is against the one-process exact store (faiss-flat), which is always built
first.  Memory: resident set (RSS) of the process holding the entries: here for one process, each shard actor
(its pid from the actor) for Ray; peaks sampled while building and searching.

    .venv/bin/python bench/ray_memory.py [--n 10000000] [--shards 1,2,4] [--kinds faiss-flat,faiss-ivf]
        [--queries 3,768 --repeats 20,3] [--k 32] [--out FILE]

Each shard searches with the cluster's CPUs divided by the shard count as threads (as RayStore starts them).  Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterator

import psutil
import torch

from lcx.plugins.fot.memory import SHARD_KINDS, StoreConfig, make_store, recall_at_k
from lcx.plugins.fot.method import FoT
from provenance import git_commit, machine as host  # bench/provenance.py (scripts here run as `python bench/NAME.py`)

OUT = Path(__file__).parent / "results" / "ray_memory.json"
GIB = 2**30
FOT = {f.name: f.default for f in fields(FoT)}
#: Query heads per KV head of SmolLM2-135M (9 over 3), the model bench/knn.py's head_dim is taken from: one
#: token's search in one (layer, KV head) store holds this many queries.
HEADS_PER_KV = 3


# ---------------------------------------------------------------------- data
def centers(d: int, seed: int) -> torch.Tensor:
    """The 4096 cluster centres keys and queries are drawn around (as bench/knn.py's ``data``)."""
    return torch.randn(4096, d, generator=torch.Generator().manual_seed(seed)) * 2


def around(c: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` points, each a random centre of ``c`` plus unit Gaussian noise: (n, D) float32."""
    return c[torch.randint(0, c.shape[0], (n,), generator=g)] + torch.randn(n, c.shape[1], generator=g)


def batches(c: torch.Tensor, n: int, batch: int, value_dim: int, seed: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """The memory's ``n`` entries in adds of ``batch``, the same every time: keys (b, D), values (b, Dv) whose
    first column is the entry's index (so a search's values can be checked against its indices), positions."""
    for i, start in enumerate(range(0, n, batch)):
        m = min(batch, n - start)
        keys = around(c, m, torch.Generator().manual_seed(seed * 1_000_003 + i + 1))
        values = torch.zeros(m, value_dim)
        values[:, 0] = torch.arange(start, start + m, dtype=torch.float32)
        yield keys, values, torch.arange(start, start + m)


# ---------------------------------------------------------------------- memory
def rss(pid: int) -> tuple[float, float]:
    """Resident memory of process ``pid`` now and at its peak (VmHWM), GiB."""
    now = psutil.Process(pid).memory_info().rss
    peak = now
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    except OSError:
        pass
    return now / GIB, peak / GIB


class Sampler:
    """The largest sum of the resident memory of some processes, sampled every ``every`` seconds (GiB)."""

    def __init__(self, pids: list[int], every: float = 0.5) -> None:
        self.pids, self.every, self.peak = list(pids), every, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for pid in list(self.pids):
                try:
                    total += psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total / GIB)
            self._stop.wait(self.every)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


# ---------------------------------------------------------------------- one configuration
def search_all(store: Any, queries: dict[int, torch.Tensor], k: int) -> dict[int, dict[str, Any]]:
    """Each batch size's query batches (R, Q, D) searched one by one, with the found entries' values: the
    median and every time, the indices (R, Q, k) and whether the values are those entries'."""
    q0 = next(iter(queries.values()))[0]
    store.search(q0, k)  # warm-up (first calls pay for lazy set-up: Ray's object store, FAISS's threads)
    out = {}
    for q, batch in queries.items():
        times, found = [], []
        for x in batch:
            t0 = time.perf_counter()
            _, idx = store.search(x, k)  # (Q, k)
            v = store.values[idx]  # (Q, k, Dv): what fot reads next
            times.append(time.perf_counter() - t0)
            found.append(idx)
        hit = idx >= 0
        values_ok = bool((v[..., 0][hit] == idx[hit].float()).all())
        out[q] = {"median_s": statistics.median(times), "times_s": times, "idx": torch.stack(found),
                  "values_ok": values_ok}
    return out


def run_one(kind: str, shards: int, args: argparse.Namespace, c: torch.Tensor,
            queries: dict[int, torch.Tensor], ray: Any = None) -> tuple[dict[str, Any], dict[int, torch.Tensor]]:
    """Build one memory (``shards`` = 0: in this process), search it, measure it, tear it down."""
    cfg = dict(nlist=args.nlist, nprobe=args.nprobe)
    config = StoreConfig(kind=kind, **cfg) if not shards else StoreConfig(kind="ray", shards=shards, shard_kind=kind, **cfg)
    sampler = Sampler([os.getpid()])
    t0 = time.perf_counter()
    store = make_store(config)  # Ray: starts the shard actors
    start_s = time.perf_counter() - t0
    pids = store.shards.call("ready", [()] * shards, "asking its pid") if shards else [os.getpid()]
    local = not (shards and args.ray_address)  # a cluster's actors may run elsewhere: no memory figures
    if local and shards:
        sampler.pids += pids
    add_s = 0.0
    for keys, values, pos in batches(c, args.n, args.batch, args.value_dim, args.seed):
        t0 = time.perf_counter()
        store.add(keys, values, pos)
        add_s += time.perf_counter() - t0
    assert len(store) == args.n
    del keys, values, pos  # the last batch: not held while searching
    memory: dict[str, Any] = {"rss_after_build_gib": [rss(p)[0] for p in pids] if local else None}
    found = search_all(store, queries, args.k)
    memory["peak_rss_sampled_gib"] = sampler.stop()  # this process + the shards together
    if local and shards:
        memory["shard_peak_rss_gib"] = [rss(p)[1] for p in pids]
    row = {"store": kind, "shards": shards, "where": "one process" if not shards else f"ray x{shards}",
           "start_s": start_s, "add_s": add_s, **memory,
           "search": {q: {key: f[key] for key in ("median_s", "times_s", "values_ok")} for q, f in found.items()}}
    del store
    gc.collect()
    if shards:
        ray.shutdown()  # the actors end with the job: their memory is freed before the next configuration
    return row, {q: f["idx"] for q, f in found.items()}


def start_ray(args: argparse.Namespace) -> Any:
    import logging

    import ray

    if args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False, logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
    return ray


# ---------------------------------------------------------------------- the run
def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def machine() -> dict[str, Any]:
    import faiss
    import ray

    return {**host(), "torch_threads": torch.get_num_threads(), "faiss_threads": faiss.omp_get_max_threads(),
            "torch": torch.__version__, "faiss": faiss.__version__, "ray": ray.__version__}


def table(rows: list[dict[str, Any]], qs: list[int], k: int) -> str:
    head = f"{'store':<11} {'where':<12} {'start s':>8} {'add s':>8}"
    for q in qs:
        head += f" {f'{q} q ms':>11} {'x 1 proc':>8} {f'recall@{k}':>9}"
    head += f" {'RSS GiB (per shard)':>22}"
    lines = [head]
    for r in rows:
        line = f"{r['store']:<11} {r['where']:<12} {r['start_s']:8.1f} {r['add_s']:8.1f}"
        for q in qs:
            s = r["search"][q]
            line += f" {1000 * s['median_s']:11.1f} {s.get('vs_one_process', 1.0):8.2f} {s['recall']:9.3f}"
        mem = r["rss_after_build_gib"]
        line += f" {'/'.join(f'{m:.2f}' for m in mem) if mem else '-':>22}"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=10_000_000, help="memory entries (keys)")
    ap.add_argument("--shards", type=ints, default=[1, 2, 4], help="Ray shard counts, comma-separated")
    ap.add_argument("--kinds", default="faiss-flat,faiss-ivf",
                    help=f"stores, one process and on each shard, comma-separated: {', '.join(SHARD_KINDS)}")
    ap.add_argument("--queries", type=ints, default=[HEADS_PER_KV, HEADS_PER_KV * FOT["block"]],
                    help="queries per search, comma-separated (default: one decode token's and one prefill "
                         "block's, in one KV head's store of SmolLM2-135M under fot's defaults)")
    ap.add_argument("--repeats", type=ints, default=[20, 3],
                    help="distinct query batches searched per --queries entry (the median is reported)")
    ap.add_argument("--k", type=int, default=FOT["k"], help="entries found per query (default: fot's k)")
    ap.add_argument("--dim", type=int, default=64, help="key dimension (SmolLM2's head_dim)")
    ap.add_argument("--value-dim", type=int, default=1, help="value dimension (values travel back with a search)")
    ap.add_argument("--batch", type=int, default=1_000_000, help="entries per add (Ray: per round of puts)")
    ap.add_argument("--nlist", type=int, default=4096, help="faiss-ivf: inverted lists per store (each shard's too)")
    ap.add_argument("--nprobe", type=int, default=FOT["nprobe"], help="faiss-ivf: lists visited (default: fot's)")
    ap.add_argument("--ray-address", default="", help="a running Ray cluster; default: a local Ray started here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT, help=f"where the JSON goes (default {OUT})")
    args = ap.parse_args()
    kinds = [x for x in args.kinds.split(",") if x]
    bad = [x for x in kinds if x not in SHARD_KINDS]
    if bad:
        ap.error(f"--kinds takes {', '.join(SHARD_KINDS)}; got {', '.join(bad)}")
    if len(args.repeats) != len(args.queries):
        ap.error(f"--repeats needs one count per --queries entry: {len(args.repeats)} counts for "
                 f"{len(args.queries)} entries ({args.queries})")
    if min(args.shards, default=0) < 1 or args.value_dim < 1 or args.n < args.k:
        ap.error(f"--shards must be >= 1 each (got {args.shards}), --value-dim >= 1 (got {args.value_dim}) and "
                 f"--n >= --k (got {args.n} and {args.k})")
    if "torch" in kinds:  # a torch store scores every query against every key at once: (Q, N) float32
        need = max(args.queries) * args.n * 4
        if need > psutil.virtual_memory().available / 2:
            ap.error(f"the torch store would hold a {need / GIB:.0f} GiB score matrix for {max(args.queries)} queries "
                     f"over {args.n} keys; leave torch out of --kinds or lower --queries / --n")

    c = centers(args.dim, args.seed)
    g = torch.Generator().manual_seed(args.seed + 7)
    queries = {q: around(c, r * q, g).view(r, q, args.dim) for q, r in zip(args.queries, args.repeats)}
    report = {"command": " ".join([".venv/bin/python", *sys.argv]), "commit": git_commit(), "machine": machine(),
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "data": "clustered (4096 Gaussian clusters, bench/knn.py)", "rows": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    one: dict[str, dict[int, float]] = {}  # kind -> queries -> one process's median
    ref: dict[int, torch.Tensor] = {}

    def record(row: dict[str, Any], idx: dict[int, torch.Tensor]) -> None:
        for q, s in row["search"].items():
            s["recall"] = recall_at_k(ref[q].reshape(-1, ref[q].shape[-1]), idx[q].reshape(-1, idx[q].shape[-1]))
            if row["shards"]:
                s["vs_one_process"] = s["median_s"] / one[row["store"]][q]
        if not row["shards"]:
            one[row["store"]] = {q: s["median_s"] for q, s in row["search"].items()}
        report["rows"].append(row)
        report["machine"]["loadavg_end"] = os.getloadavg()
        args.out.write_text(json.dumps(report, indent=2))  # after every configuration: a long run keeps its part
        print(table([row], args.queries, args.k).splitlines()[-1], flush=True)

    print(table([], args.queries, args.k), flush=True)
    plan = ["faiss-flat"] + [x for x in kinds if x != "faiss-flat"]  # the exact one first: recall's reference
    for kind in plan:
        print(f"  building {kind} in one process ...", flush=True)
        row, idx = run_one(kind, 0, args, c, queries)
        if kind == "faiss-flat":
            ref = idx
            row["reference"] = True  # built even when --kinds leaves it out
        record(row, idx)
    for kind in kinds:
        for n_shards in args.shards:
            print(f"  building {kind} on {n_shards} Ray shard(s) ...", flush=True)
            ray = start_ray(args)
            row, idx = run_one(kind, n_shards, args, c, queries, ray)
            row["shard_threads"] = None if args.ray_address else max(1, (os.cpu_count() or 1) // n_shards)
            record(row, idx)
    print()
    print(table(report["rows"], args.queries, args.k))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
