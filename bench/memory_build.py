"""`lcx memory build` throughput: in this process vs 1 and 2 Ray workers, on this machine's CPUs.

Every configuration runs the same command on the same documents (--docs slices of the shared books, --tokens
each), alternating round after round in one run; a run's time is the command's wall time, model loading and Ray's
start-up included (what a user waits for), and "indexing" is the wall time less that of the same command on a
one-token document set (the fixed cost).

    .venv/bin/python bench/memory_build.py [--model smollm2-135m] [--docs 4] [--tokens 8192] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import environment  # bench/provenance.py (scripts here run as `python bench/NAME.py`)

REPO = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "results"
CONFIGS = {"in-process": ["--workers", "0"], "ray-1-worker": ["--workers", "1"], "ray-2-workers": ["--workers", "2"]}
# fot at its defaults before issue 52, pinned (memory_build.json measured them); -o still overrides
FOT_BEFORE = ("fot.local=2048", "fot.chunk=0", "fot.sinks=0", "fot.positions=first", "fot.fixed_distance=0",
              "fot.gate=off")


def documents(tokenizer, folder: Path, n: int, tokens: int) -> list[Path]:
    sys.path.insert(0, str(REPO / "bench"))
    from books import book_tokens

    ids = book_tokens(tokenizer, n * tokens)[0]
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = folder / f"doc{i}.txt"
        p.write_text(tokenizer.decode(ids[i * tokens:(i + 1) * tokens]))
        paths.append(p)
    return paths


def timed(args, config: list[str], docs: list[Path], out: Path) -> float:
    lcx = Path(sys.executable).with_name("lcx")
    cmd = [str(lcx), "memory", "build", "-m", args.model, "--dtype", args.dtype, *args.option, *config,
           "--out", str(out), "--overwrite", "--json", *map(str, docs)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    dt = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per document")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--option", "-o", action="append", default=[], help="passed on as -o (fot options)")
    ap.add_argument("--out", type=Path, default=OUT / "memory_build.json")
    args = ap.parse_args()
    args.option = [x for o in (*FOT_BEFORE, *args.option) for x in ("-o", o)]
    from lcx.models import load_model

    _, tok = load_model(args.model)
    runs: dict[str, dict[str, list[float]]] = {c: {"total": [], "fixed": []} for c in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        docs = documents(tok, tmp / "docs", args.docs, args.tokens)
        one = tmp / "one.txt"
        one.write_text("a")
        for r in range(args.rounds):
            order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
            for c in order:
                runs[c]["fixed"].append(timed(args, CONFIGS[c], [one], tmp / "mem"))
                runs[c]["total"].append(timed(args, CONFIGS[c], docs, tmp / "mem"))
                print(f"round {r} {c}: {runs[c]['total'][-1]:.1f} s ({runs[c]['fixed'][-1]:.1f} s fixed)", flush=True)
    tokens = args.docs * args.tokens
    table = {}
    for c, v in runs.items():
        total, fixed = statistics.median(v["total"]), statistics.median(v["fixed"])
        table[c] = {"seconds": round(total, 2), "fixed_seconds": round(fixed, 2),
                    "tokens_per_second": round(tokens / total, 1),
                    "indexing_tokens_per_second": round(tokens / max(total - fixed, 1e-9), 1)}
    result = {"what": "lcx memory build wall time: in this process vs Ray workers (median over rounds)",
              **environment(), "tokens": tokens,
              "settings": {k: str(v) for k, v in vars(args).items() if k != "out"}, "results": table, "runs": runs,
              "two_workers_over_in_process": round(table["ray-2-workers"]["indexing_tokens_per_second"]
                                                   / table["in-process"]["indexing_tokens_per_second"], 3)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("\n| build | wall (s) | fixed (s) | tokens/s | indexing tokens/s |\n|---|---|---|---|---|")
    for c, v in table.items():
        print(f"| {c} | {v['seconds']} | {v['fixed_seconds']} | {v['tokens_per_second']} | "
              f"{v['indexing_tokens_per_second']} |")
    print(f"\n-> {args.out}")


if __name__ == "__main__":
    main()
