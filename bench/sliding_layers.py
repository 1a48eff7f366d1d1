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
from pathlib import Path

from ab import alternate, patched, record, timed_generate  # bench/ab.py (scripts here run as `python bench/NAME.py`)
from books import book_tokens
from lcx.adapters import families
from lcx.io import token_counts
from lcx.models import load_model
from lcx.session import parse_options

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
    times, answers, ratios = alternate(
        {"window": lambda: patched([families], "sliding_windows", own),
         "local": lambda: patched([families], "sliding_windows", lambda m, f: [None] * len(windows))},
        lambda: timed_generate(model, [args.method], options, ids, NEW), args.rounds,
        label=lambda name: f"sliding layers keep their {name}")
    result = record("sliding_layers", args.model, model, tokens, NEW, options, times, ratios, method=args.method,
                    sliding_windows=sorted({w for w in windows if w}), sliding_layers=sum(1 for w in windows if w),
                    layers=len(windows), answers={k: tok.decode(v[-NEW:]) for k, v in answers.items()},
                    same_tokens=answers["window"] == answers["local"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("speedup_per_round", "speedup_median", "answers")}))


if __name__ == "__main__":
    main()
