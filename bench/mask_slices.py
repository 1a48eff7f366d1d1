"""The kept keys' mask columns taken as slices of the base mask (lcx.masking.visible_mask) against the gather by
index it replaced, side by side in one run; the values are the same, so the answers must be too.

    .venv/bin/python bench/mask_slices.py                                  # fot at its defaults, SmolLM2, 16K, bf16
    .venv/bin/python bench/mask_slices.py --model gemma3-270m -o local=4096 -o chunk=1024

Each round reads the same prompt both ways (the first one flips every round) and times the prefill and the first
new tokens.  Writes bench/results/mask_slices-MODEL-METHOD.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lcx.plugins.fot.method as fot_method
import lcx.plugins.streaming.method as streaming_method
from ab import alternate, patched, record, timed_generate  # bench/ab.py (scripts here run as `python bench/NAME.py`)
from books import book_tokens
from lcx.io import token_counts
from lcx.masking import kept_positions, visible_mask
from lcx.models import load_model
from lcx.session import parse_options

OUT = Path(__file__).parent / "results"
NEW = 4
USERS = (fot_method, streaming_method)  # the modules that call visible_mask on their kept keys


def gathered_mask(attention_mask, runs, total, q_len, base_impl, dtype, device=None):
    """visible_mask as it was: the columns gathered by index."""
    if attention_mask is not None:
        return attention_mask[..., kept_positions(runs, attention_mask.device)]
    return visible_mask(None, runs, total, q_len, base_impl, dtype, device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", default="16K", help="prompt length (K suffix allowed)")
    ap.add_argument("--method", choices=["fot", "streaming"], default="fot")
    ap.add_argument("-o", "--option", action="append", default=[], help="method option KEY=VALUE (default: none)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="default: bench/results/mask_slices-MODEL-METHOD.json")
    args = ap.parse_args()
    (tokens,) = token_counts(args.tokens)
    options = parse_options(args.option)
    out = args.out or OUT / f"mask_slices-{args.model}-{args.method}.json"
    model, tok = load_model(args.model, dtype=args.dtype)
    ids = book_tokens(tok, tokens)

    times, answers, ratios = alternate(
        {"slices": lambda: patched(USERS, "visible_mask", visible_mask),
         "gather": lambda: patched(USERS, "visible_mask", gathered_mask)},
        lambda: timed_generate(model, [args.method], options, ids, NEW), args.rounds)
    result = record("mask_slices", args.model, model, tokens, NEW, options, times, ratios, method=args.method,
                    answers={k: tok.decode(v[-NEW:]) for k, v in answers.items()},
                    same_tokens=answers["slices"] == answers["gather"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("speedup_per_round", "speedup_median", "same_tokens")}))


if __name__ == "__main__":
    main()
