"""Larger chunks, fewer candidates: a few prompts of the committed 5 x 5 passkey grids, read again with other
focusllm options, side by side with what the grid's journal recorded for the same prompts.

The adapter was trained with chunks of 512-2,048 tokens, so its decoder saw at most ~7 candidates; at 64K the
2,048-token chunks make 31 and at 128K 63.  ``-o focusllm.chunk=7616`` (with overlap 64 and fragment 512 the
largest chunk SmolLM2's 8,192-token window holds) makes 4 at 32K, 9 at 64K and 17 at 128K.  Each candidate
then summarises a chunk as long as the ones vanilla reads within its window (25/25 at 4K).

The keys are drawn exactly as `lcx eval passkey --samples 5` draws them (seed 0, cell by cell), and only the
samples named by --index of each cell are run, so each row is a prompt of the committed grid.  Generation is
`lcx eval passkey`'s own (`_grid_generator`).  Resumable: finished prompts are kept in OUT.jsonl.

    .venv/bin/python results/focusllm/bigchunk/probe.py --length 64K --index 0 \
        --baseline results/focusllm/passkey-recall-local-64k -o focusllm.chunk=7616 -o focusllm.overlap=64
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


def grid_keys(length: int, depths: list[float], samples: int = 5, seed: int = 0) -> dict[tuple[float, int], int]:
    """(depth, sample index) -> key, as `lcx eval passkey` draws them for a one-length grid."""
    rng = random.Random(seed)
    return {(d, i): rng.randint(10000, 99999) for d in depths for i in range(samples)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", required=True)
    ap.add_argument("--index", default="0", help="comma-separated sample indices of each cell (0-4)")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--baseline", type=Path, action="append", default=[],
                    help="a committed grid folder with the same prompts (its passkey.samples.jsonl); repeatable")
    ap.add_argument("-o", "--option", action="append", default=[])
    ap.add_argument("--out", type=Path, required=True, help="OUT.jsonl (one row per prompt) and OUT.json")
    args = ap.parse_args()
    n = token_counts(args.length)[0]
    depths = [float(d) for d in args.depths.split(",")]
    index = [int(i) for i in args.index.split(",")]
    keys = grid_keys(n, [0.1, 0.3, 0.5, 0.7, 0.9])
    base = {}
    for b in args.baseline:
        for line in (b / "passkey.samples.jsonl").read_text().splitlines():
            s = json.loads(line)
            if "key" in s and s["length"] == n:  # scored again: journals older than the strict check hold its verdicts
                found = passkey_found(s["key"], s["output"]) if "output" in s else s["found"]
                base.setdefault((s["depth"], s["key"]), {})[str(b.relative_to(ROOT) if b.is_absolute() else b)] = found
    journal = args.out.with_suffix(".jsonl")
    done = {(r["depth"], r["key"]): r for r in map(json.loads, journal.read_text().splitlines())} if journal.exists() else {}
    s = open_session("smollm2-135m", [], parse_options(tuple(args.option)), ADAPTER)
    gen = _grid_generator(s.run)
    rows = []
    try:
        for d in depths:
            for i in index:
                key = keys[(d, i)]
                if (d, key) in done:
                    rows.append({**done[(d, key)], "baseline_found": base.get((d, key), {})})
                    continue
                ids, shared = prompt_and_needle(s.tokenizer, n, d, key)
                t0 = time.perf_counter()
                new = gen(ids[None], 8, shared)
                text = s.tokenizer.decode(new[0], skip_special_tokens=True)
                row = {"length": n, "depth": d, "index": i, "key": key, "output": text,
                       "found": passkey_found(key, text), "seconds": round(time.perf_counter() - t0, 1),
                       "baseline_found": base.get((d, key), {})}
                chosen = {m.name: m.request_options() for m in s.run.methods if m.request_options()}
                if chosen:  # what an auto option came to for this prompt (focusllm chunk=auto)
                    row["request_options"] = chosen
                rows.append(row)
                with journal.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(row, flush=True)
    finally:
        s.close()
    summary = {"length": n, "options": args.option, "adapter": str(ADAPTER.relative_to(ROOT)), "prompts": len(rows),
               "found": sum(r["found"] for r in rows),
               "baseline_found": {b: sum(r["baseline_found"].get(b, False) for r in rows)
                                  for b in sorted({b for r in rows for b in r["baseline_found"]})},
               "rows": rows}
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))


if __name__ == "__main__":
    main()
