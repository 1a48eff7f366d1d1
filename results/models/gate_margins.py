"""How far fot's best memory key scores above the best local key (its gate's margin), per layer and head: at the
answer of held passkeys (the needle 4.9K-7.4K tokens back, in memory) and on ordinary text.  A gate G lets a
query head read memory only where this margin is >= G, so the two distributions say which gates keep the needle
and how much of ordinary text they still let memory touch (issue 52).

    .venv/bin/python results/models/gate_margins.py -m qwen2.5-0.5b --memory-layers 3,5,6,... \
        --out results/models/qwen2.5-0.5b/gate-margins-float32.json

fot runs with its gate off (every query reads its k best memory keys); the margins are recorded, not used.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import lcx
from lcx.evals.passkey import Haystack, passkey_found, prompt_and_needle
from lcx.generation import generate
from lcx.models import load_model
from lcx.plugins.fot.method import FoT

ANSWER = 8  # new tokens a needle's answer is read from (the key and what follows it)
GATES = [-2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 6.0]
BOOKS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "books"


def take(fot: FoT) -> dict[int, torch.Tensor]:
    """layer -> (H, Q) margins fot recorded since the last take (its ``record_margins`` seam); cleared."""
    out = {i: torch.cat(v, dim=-1) for i, v in fot.record_margins.items()}
    fot.record_margins = {}
    return out


def passes(margins: dict[int, torch.Tensor], gate: float) -> dict:
    """Of each query, how many (layer, head) pairs a gate lets read memory; the fraction over all pairs."""
    stacked = torch.stack([m for _, m in sorted(margins.items())])  # (L, H, Q)
    open_ = stacked >= gate
    return {"pairs_open_fraction": round(float(open_.float().mean()), 5),
            "queries_with_an_open_pair": round(float(open_.any(0).any(0).float().mean()), 4),
            "min_open_pairs_per_query": int(open_.sum((0, 1)).min())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--memory-layers", required=True, help="fot.memory_layers (the model's auto choice)")
    ap.add_argument("--local", type=int, default=4096)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--depths", default="0.1,0.25,0.4")
    ap.add_argument("--keys", default="12345,67890", help="needle keys, one sample each per depth")
    ap.add_argument("--text", nargs="+", default=[str(BOOKS / "wells_invisible_man.txt"),
                                                 str(BOOKS / "doyle_hound_of_the_baskervilles.txt")],
                    help="ordinary-text books: the first LENGTH tokens of each, its queries past the local window")
    ap.add_argument("--haystack", default=str(BOOKS), help="the needles' text: files or a folder (prose), or filler "
                                                          "(the repeated passkey filler, for models that cannot read prose)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    model, tok = load_model(args.model, dtype=args.dtype)
    opts = {"local": args.local, "memory_layers": args.memory_layers, "gate": "off"}
    hay = None if args.haystack == "filler" else Haystack([args.haystack])
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "fot": opts, "dtype": args.dtype,
              "haystack": args.haystack,
              "gates": GATES, "needles": [], "text": []}
    with lcx.attach(model, ["fot"], fot=opts) as run:
        fot = run.method("fot")
        fot.record_margins = {}
        for depth in map(float, args.depths.split(",")):
            for key in map(int, args.keys.split(",")):
                ids, _ = prompt_and_needle(tok, args.length, depth, key, hay)
                new = generate(run, ids[None], max_new_tokens=ANSWER)
                text = tok.decode(new[0])
                # the queries that produced the answer: the prompt's last one and the decode steps after it
                steps = {i: v[:, -new.shape[1]:] for i, v in take(fot).items()}
                row = {"depth": depth, "key": key, "answer": text, "found": passkey_found(key, text),
                       "best_margin_per_token": [round(float(x), 3) for x in
                                                 torch.stack(list(steps.values())).amax((0, 1))],
                       "by_gate": {str(g): passes(steps, g) for g in GATES}}
                result["needles"].append(row)
                print(json.dumps(row), flush=True)
        for path in args.text:
            ids = Haystack([path]).fill(tok, args.length)
            ids = torch.tensor([t for s in ids for t in s])[None]
            generate(run, ids, max_new_tokens=1)
            m = take(fot)
            row = {"text": Path(path).name, "queries": int(next(iter(m.values())).shape[-1]),
                   "margin_quantiles": {q: round(float(torch.stack(list(m.values())).float().quantile(float(q))), 3)
                                        for q in ("0.5", "0.9", "0.99", "0.999")},
                   "by_gate": {str(g): passes(m, g) for g in GATES}}
            result["text"].append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
