"""Does the trained candidate adapter carry a copied span?  Held-out repetition loss, fresh candidates.

On windows of the two evaluation books (wells, doyle: not in the adapter's training books), the loss of
`-o focusllm.fresh=N` training's repetition term (the last N tokens of a span copied from the memory,
each read with every candidate refreshed through the token before it), with no gradient:

- base projections (training-free candidates) and the trained adapter, on the same draws;
- "local only": the model reading the local tokens alone (no memory, no candidates);
- "chunk ceiling": per predicted token, what the candidate of the chunk holding that token's source
  predicts by itself (its own next-token logits, base projections): the information a candidate has.

    .venv/bin/python results/focusllm/fresh-loss/fresh_loss.py          # -> fresh_loss.json (~5 min, 2 cores)
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from lcx.adapters.peft_bridge import add_adapter, load_adapter
from lcx.composition import attach
from lcx.models import load_model

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
BOOKS = ROOT.parent / "shared" / "data" / "books"


def draws(tok, windows: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    rng = random.Random(seed)
    books = [tok((BOOKS / f"{b}.txt").read_text(), add_special_tokens=False)["input_ids"]
             for b in ("wells_invisible_man", "doyle_hound_of_the_baskervilles")]  # tokenized once
    out = []
    for i in range(windows):
        ids = books[i % 2]
        s = rng.randrange(0, len(ids) - seq_len)
        out.append(torch.tensor(ids[s:s + seq_len])[None])
    return out


def term_loss(model, windows, opts: dict, chunk: int, fresh: int):
    """Per window: (draw, loss) of the repetition term with fresh candidates."""
    rows = []
    with attach(model, ["focusllm"], focusllm={**opts, "fresh": fresh, "losses": "repetition",
                                                "train_chunks": str(chunk)}) as run, torch.no_grad():
        for i, win in enumerate(windows):
            run.state["seed"] = 10_000 + i  # the draw (span, sizes) depends on the window's index only
            batch = run.hook.lcx_sample(run=run, batch={"input_ids": win}, step=i)
            d = batch["focusllm"]["repetition"]
            rows.append((d, float(run.hook.lcx_loss(run=run, model=model, batch=batch)[0]["repetition"])))
    return rows


def references(model, win, d) -> tuple[float, float]:
    """Local-only loss and the chunk ceiling for one draw (base weights, no method)."""
    local = win[:, d.start:d.start + d.local]
    t0, N = d.local - d.fresh - 1, d.fresh
    target = local[0, t0 + 1:]
    source = torch.tensor([(d.start + t0 + 1 + j) // d.chunk for j in range(N)])  # chunk holding target j's source
    with torch.no_grad():
        alone = F.cross_entropy(model(input_ids=local).logits[0, t0:-1].float(), target)
        total = 0.0
        for c in source.unique().tolist():
            chunk = win[:, c * d.chunk:min((c + 1) * d.chunk, d.memory)]
            x = torch.cat([chunk, local[:, t0 - d.fragment + 1:-1]], dim=1)  # [chunk ; fragment ; fed tokens]
            logits = model(input_ids=x).logits[0, -N:].float()
            sel = source == c
            total += float(F.cross_entropy(logits[sel], target[sel], reduction="sum"))
        return float(alone), total / N


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", type=Path, default=ROOT / "results" / "focusllm" / "adapter-fresh")
    ap.add_argument("--windows", type=int, default=8, help="held-out windows per chunk size")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--fresh", type=int, default=128)
    ap.add_argument("--chunks", default="512,1024,2048")
    ap.add_argument("--out", type=Path, default=HERE / "fresh_loss.json")
    args = ap.parse_args()
    base, tok = load_model("smollm2-135m")
    base = add_adapter(base, roles=("q", "k", "v", "o"), rank=8).eval()  # untrained (zero) = the base projections
    trained, _ = load_adapter(load_model("smollm2-135m")[0], args.adapter)
    opts = {}  # the defaults: fragment 512
    windows = draws(tok, args.windows, args.seq_len, seed=0)
    table = {}
    for chunk in [int(c) for c in args.chunks.split(",")]:
        b = term_loss(base, windows, opts, chunk, args.fresh)
        t = term_loss(trained, windows, opts, chunk, args.fresh)
        refs = [references(base, w, d) for w, (d, _) in zip(windows, b)]
        mean = lambda xs: round(sum(xs) / len(xs), 3)  # noqa: E731
        table[chunk] = {"base projections": mean([x for _, x in b]), "trained adapter": mean([x for _, x in t]),
                        "local only": mean([r[0] for r in refs]), "chunk ceiling": mean([r[1] for r in refs]),
                        "per window": [{"draw": asdict(d), "base": round(x, 3),
                                        "trained": round(y, 3), "local_only": round(r[0], 3), "ceiling": round(r[1], 3)}
                                       for (d, x), (_, y), r in zip(b, t, refs)]}
        print(chunk, {k: v for k, v in table[chunk].items() if k != "per window"}, flush=True)
    rel = args.adapter.resolve()
    shown = str(rel.relative_to(ROOT)) if rel.is_relative_to(ROOT) else str(rel)
    args.out.write_text(json.dumps({"adapter": shown, "seq_len": args.seq_len, "fresh": args.fresh,
                                    "windows": args.windows, "books": ["wells", "doyle"], "by_chunk": table}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
