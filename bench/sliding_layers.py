"""A method on a model with sliding-window layers (Gemma 3): those layers keeping their window of past keys against
keeping the method's whole window (fot's local one, streaming's recent one), side by side in one run.

    .venv/bin/python bench/sliding_layers.py                      # fot on Gemma 3 270M, 16K tokens of the books, bf16
    .venv/bin/python bench/sliding_layers.py --method streaming --tokens 4K --rounds 1

Each round reads the same prompt both ways (the first one flips every round) and times the prefill and the first
new tokens.  The keys a sliding-window layer drops are masked out in either way, so in float32 the logits agree
(tests/test_fot.py); in bfloat16 attention over fewer keys rounds otherwise, and the answers (recorded) may part
at a near tie.  Writes bench/results/sliding_layers-METHOD.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import lcx
from books import book_tokens  # bench/books.py (scripts here run as `python bench/NAME.py`)
from lcx.adapters import families
from lcx.generation import generate
from lcx.io import token_counts
from lcx.models import dtype_name, load_model
from lcx.session import parse_options
from provenance import git_commit

OUT = Path(__file__).parent / "results"
DEFAULT = {"fot": ["local=4096", "chunk=1024"], "streaming": []}  # results/ruler's options on Gemma 3
NEW = 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tokens", default="16K", help="prompt length (K suffix allowed)")
    ap.add_argument("--method", choices=sorted(DEFAULT), default="fot")
    ap.add_argument("-o", "--option", action="append", default=None,
                    help=f"method option KEY=VALUE (default: {DEFAULT})")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="default: bench/results/sliding_layers-METHOD.json")
    args = ap.parse_args()
    (tokens,) = token_counts(args.tokens)
    options = parse_options(args.option or DEFAULT[args.method])
    out = args.out or OUT / f"sliding_layers-{args.method}.json"
    model, tok = load_model(args.model, dtype=args.dtype)
    windows = families.sliding_windows(model, families.family_of(model))
    if not any(windows):
        raise SystemExit(f"{args.model} has no sliding-window layer: nothing to compare")
    ids = book_tokens(tok, tokens)
    own = families.sliding_windows

    def prefill(keep_window: bool) -> tuple[float, list[int]]:
        families.sliding_windows = own if keep_window else (lambda m, f: [None] * len(windows))
        try:
            with lcx.attach(model, [args.method], **options) as run:
                t = time.perf_counter()
                out = generate(run, ids, max_new_tokens=NEW, progress=False)
                return time.perf_counter() - t, out[0].tolist()
        finally:
            families.sliding_windows = own

    times: dict[str, list[float]] = {"window": [], "local": []}
    answers: dict[str, list[int]] = {}
    for r in range(args.rounds):
        for keep in ((True, False) if r % 2 == 0 else (False, True)):
            name = "window" if keep else "local"
            s, answers[name] = prefill(keep)
            times[name].append(s)
            print(f"round {r + 1}: sliding layers keep their {name}: {s:.1f} s", flush=True)
    ratios = [b / a for a, b in zip(times["window"], times["local"])]
    result = {"benchmark": "sliding_layers", "method": args.method, "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "commit": git_commit(), "model": args.model, "dtype": dtype_name(model.dtype), "tokens": tokens,
              "new_tokens": NEW, "options": options, "sliding_windows": sorted({w for w in windows if w}),
              "sliding_layers": sum(1 for w in windows if w), "layers": len(windows),
              "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
              "seconds": times, "speedup_per_round": ratios, "speedup_median": statistics.median(ratios),
              "answers": {k: tok.decode(v[-NEW:]) for k, v in answers.items()},
              "same_tokens": answers["window"] == answers["local"]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("speedup_per_round", "speedup_median", "answers")}))


if __name__ == "__main__":
    main()
