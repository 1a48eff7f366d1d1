"""Generation variants of focusllm compared on development prompts: passkey prompts the committed test grids
never hold (other depths, keys drawn with another seed), so an option chosen here is not chosen on the
grid it is then measured on.

Every variant reads the same prompt in one session: the chunks are decoded once per prompt (the chunk memo of
``lcx eval passkey`` hands them to each later variant, and the filler chunks to each later prompt), and each
variant sets the method's generation options (``topk``, ``refresh``) before its greedy generation, which is
``lcx eval passkey``'s own (``_grid_generator``).  Resumable: finished (prompt, variant) rows are kept in
OUT.jsonl.

    .venv/bin/python results/focusllm/dev/probe.py --length 128K --out results/focusllm/dev/dev-128k \\
        --variant topk4=topk:4 --variant topk2=topk:2 --variant topk8=topk:8 --variant topk4-r0=topk:4,refresh:0
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from lcx.cli.evaluation import _grid_generator
from lcx.evals.passkey import passkey_found, prompt_and_needle
from lcx.io import token_counts
from lcx.session import open_session, parse_options

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
ADAPTER = ROOT / "results/focusllm/adapter-recall-local"
GRID_DEPTHS = {0.1, 0.3, 0.5, 0.7, 0.9}  # the committed grids' depths (seed 0): never read here


def dev_keys(depths: list[float], samples: int, seed: int) -> dict[tuple[float, int], int]:
    rng = random.Random(seed)
    return {(d, i): rng.randint(10000, 99999) for d in depths for i in range(samples)}


def parse_variant(text: str) -> tuple[str, dict[str, int]]:
    """``name=opt:value,opt:value`` -> (name, {opt: value})."""
    name, _, opts = text.partition("=")
    if not name or not opts:
        raise SystemExit(f"--variant wants NAME=OPT:VALUE[,OPT:VALUE], got {text!r}")
    return name, {k: int(v) for k, v in (o.split(":") for o in opts.split(","))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", required=True)
    ap.add_argument("--depths", default="0.2,0.4,0.6,0.8")
    ap.add_argument("--samples", type=int, default=2, help="keys per depth")
    ap.add_argument("--seed", type=int, default=1, help="key draw (the test grids use 0)")
    ap.add_argument("-o", "--option", action="append", default=["focusllm.overlap=64", "focusllm.topk=4", "focusllm.chunk=2048"],
                    help="session options (the grids' by default); variants change topk/refresh on top")
    ap.add_argument("--variant", action="append", required=True, help="NAME=OPT:VALUE[,OPT:VALUE] (topk, refresh)")
    ap.add_argument("--out", type=Path, required=True, help="OUT.jsonl (one row per prompt and variant) and OUT.json")
    args = ap.parse_args()
    n = token_counts(args.length)[0]
    depths = [float(d) for d in args.depths.split(",")]
    if args.seed == 0 and GRID_DEPTHS & set(depths):
        raise SystemExit("seed 0 at a grid depth is a test-grid prompt; use another --seed or other --depths")
    variants = dict(map(parse_variant, args.variant))
    keys = dev_keys(depths, args.samples, args.seed)
    journal = args.out.with_suffix(".jsonl")
    journal.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["depth"], r["key"], r["variant"]): r for r in map(json.loads, journal.read_text().splitlines())} \
        if journal.exists() else {}
    s = open_session("smollm2-135m", [], parse_options(tuple(args.option)), ADAPTER)
    (m,) = [m for m in s.run.methods if m.name == "focusllm"]
    base = {k: getattr(m, k) for k in ("topk", "refresh")}
    if not base["topk"]:
        raise SystemExit("start the session with -o focusllm.topk=K > 0: its attention stage is installed only then")
    gen = _grid_generator(s.run)
    rows = list(done.values())
    try:
        for (d, i), key in keys.items():
            ids, shared = prompt_and_needle(s.tokenizer, n, d, key)
            for name, opts in variants.items():
                if (d, key, name) in done:
                    continue
                for k, v in {**base, **opts}.items():
                    setattr(m, k, v)
                t0 = time.perf_counter()
                new = gen(ids[None], 8, shared)
                text = s.tokenizer.decode(new[0], skip_special_tokens=True)
                row = {"length": n, "depth": d, "index": i, "key": key, "variant": name, "options": opts,
                       "output": text, "found": passkey_found(key, text),
                       "seconds": round(time.perf_counter() - t0, 1)}
                rows.append(row)
                with journal.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(row, flush=True)
    finally:
        s.close()
    summary = {"length": n, "seed": args.seed, "depths": depths, "samples": args.samples, "options": args.option,
               "adapter": str(ADAPTER.relative_to(ROOT)),
               # every variant the journal holds (one dropped after a few prompts keeps its count)
               "found": {v: f"{sum(r['found'] for r in rows if r['variant'] == v)}/"
                            f"{sum(r['variant'] == v for r in rows)}" for v in dict.fromkeys(r["variant"] for r in rows)},
               "rows": sorted(rows, key=lambda r: (r["depth"], r["index"], r["variant"]))}
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))


if __name__ == "__main__":
    main()
