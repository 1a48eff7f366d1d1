"""How close lcx's up-front memory estimate comes to what a request really adds to the process's peak resident
memory, on the catalog's real models, every path, several requests each (the measurement of
tests/test_real_models.py's bound, repeated to show its spread).

    .venv/bin/python bench/memory_estimate.py [--repeats 3] [--tokens 5120]   # writes bench/results/memory_estimate.json
    .venv/bin/python bench/memory_estimate.py --heap bounded  # LCX_BOUNDED_HEAP=1: the request's live tensors
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch

import lcx
from lcx.evals.passkey import prompt_and_needle
from lcx.limits import check_request, trim_heap
from lcx.models import load_model

# fot at its defaults before issue 52, pinned (memory_estimate*.json measured them); -o fot.KEY=VALUE overrides
FOT_BEFORE = ("fot.local=2048", "fot.chunk=0", "fot.sinks=0", "fot.positions=first", "fot.fixed_distance=0",
              "fot.gate=off")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=5120)
    ap.add_argument("--models", default="gemma3-270m,qwen2.5-0.5b")
    ap.add_argument("--methods", default="none,vanilla,rope,streaming,fot,focusllm")
    ap.add_argument("-o", "--option", action="append", default=[], metavar="METHOD.KEY=VALUE",
                    help="a method's option, e.g. -o fot.memory_layers=3,5,6 (repeatable)")
    ap.add_argument("--heap", choices=["glibc", "bounded"], default="glibc",
                    help="glibc: its own policy (the default); bounded: as LCX_BOUNDED_HEAP=1 sets it")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory_estimate.json"))
    a = ap.parse_args()
    os.environ["LCX_BOUNDED_HEAP"] = "1" if a.heap == "bounded" else "0"  # read by the first request's check
    options: dict[str, dict[str, str]] = {}
    for o in (*FOT_BEFORE, *a.option):
        key, _, value = o.partition("=")
        method, _, k = key.partition(".")
        if not (k and value):
            ap.error(f"-o {o}: expected METHOD.KEY=VALUE, e.g. -o fot.memory_layers=3,5,6")
        options.setdefault(method, {})[k] = value
    rows = []
    for name in a.models.split(","):
        model, tok = load_model(name, dtype="float32")
        ids, _ = prompt_and_needle(tok, a.tokens, 0.5, 48213)
        for method in a.methods.split(","):
            with lcx.attach(model, [] if method == "none" else [method], **options.get(method, {})) as run:
                est = check_request(run, ids.shape[0], 4)
                lcx.generate(run, ids[None], max_new_tokens=4)  # warm-up: the first forward of a shape
                for i in range(a.repeats):
                    gc.collect()
                    trim_heap()
                    before = rss()
                    with open("/proc/self/clear_refs", "w") as f:
                        f.write("5")
                    t0 = time.perf_counter()
                    lcx.generate(run, ids[None], max_new_tokens=4)
                    seconds = time.perf_counter() - t0
                    grew = peak() - before
                    row = {"model": name, "method": method, "repeat": i, "heap": a.heap,
                           "threads": torch.get_num_threads(), "seconds": seconds,
                           "grew_mib": grew / 2**20, "kv_mib": est["kv_bytes"] / 2**20,
                           "forward_mib": est["forward_bytes"] / 2**20,
                           "ratio": grew / (est["kv_bytes"] + est["forward_bytes"])}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        del model, run
        gc.collect()
    Path(a.out).write_text(json.dumps({"tokens": a.tokens, "heap": a.heap, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
