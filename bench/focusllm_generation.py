"""FocusLLM generation: exact candidate refresh vs the approximate modes, speed and quality, one run.

For each input (passkey prompts and book passages of ``--length`` tokens) and each ``refresh`` mode
(1 = exact: every new token refreshes every chunk's candidate; N > 1: every N tokens; 0 = never),
greedy-generate ``--new`` tokens and record:

* decode tokens/s: tokens after the first / time after the first (the prompt's candidates excluded);
* agreement with exact mode: share of the generated tokens equal to exact mode's, position by
  position, and the first position where they differ;
* passkey found (passkey inputs).

    .venv/bin/python bench/focusllm_generation.py [--length 8192] [--new 32] [--refresh 1,4,16,0]
    python bench/focusllm_generation.py --device cuda --random-weights   # speeds on a GPU (agreement then
                                                                         # compares random-weight outputs)
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from books import book_tokens  # bench/books.py (scripts here run as `python bench/NAME.py`)
from loading import bench_model, device_name, sync
from provenance import machine

OUT = Path(__file__).parent / "results"


class Clock:
    """A generate() streamer that only timestamps: prompt first, then one call per new token."""

    def __init__(self, model=None) -> None:
        self.times: list[float] = []
        self.model = model

    def put(self, value) -> None:
        if self.model is not None:
            sync(self.model)  # on a GPU, stamp when the token exists, not when its kernels were queued
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--refresh", default="1,4,16,0")
    ap.add_argument("--passkeys", type=int, default=2)
    ap.add_argument("--books", type=int, default=2)
    ap.add_argument("-o", "--option", action="append", default=[], help="focusllm option KEY=VALUE")
    ap.add_argument("--device", default=None, help="where the model runs: cpu (default), cuda (or LCX_DEVICE)")
    ap.add_argument("--random-weights", action="store_true",
                    help="the model's architecture with random weights (from its config.json): speeds only, "
                         "agreement and passkeys then describe random outputs")
    ap.add_argument("--out", type=Path, default=OUT / "focusllm_generation.json")
    args = ap.parse_args()
    import lcx
    from lcx.evals.passkey import build_prompt_ids, passkey_found
    from lcx.session import parse_options

    model, tok = bench_model(args.model, args.device, args.random_weights)
    rng = random.Random(0)
    inputs = [("passkey", k, build_prompt_ids(tok, args.length, rng.random(), k)[None])
              for k in rng.sample(range(10000, 99999), args.passkeys)]
    inputs += [("book", None, book_tokens(tok, args.length, offset=i * args.length)) for i in range(args.books)]
    modes = [int(x) for x in args.refresh.split(",")]
    opts = parse_options(args.option)
    rows = []
    for kind, key, ids in inputs:
        exact = None
        for refresh in sorted(modes, key=lambda r: r != 1):  # exact first: the others compare with it
            clock = Clock(model)
            with lcx.attach(model, ["focusllm"], focusllm={**opts, "refresh": refresh}) as run:
                new = lcx.generate(run, ids, max_new_tokens=args.new, streamer=clock)[0].tolist()
            decode = (len(clock.times) - 2) / (clock.times[-1] - clock.times[1]) if len(clock.times) > 2 else None
            exact = new if refresh == 1 else exact
            same = [a == b for a, b in zip(new, exact)] if exact else []
            row = {"input": kind, "refresh": refresh, "new_tokens": len(new),
                   "decode_tokens_per_s": round(decode, 3) if decode else None,
                   "agreement_with_exact": round(sum(same) / len(same), 3) if same else None,
                   "first_difference": next((i for i, s in enumerate(same) if not s), None),
                   "passkey_found": passkey_found(key, tok.decode(new)) if key else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for refresh in modes:
        mine = [r for r in rows if r["refresh"] == refresh]
        summary[str(refresh)] = {
            "decode_tokens_per_s": round(sum(r["decode_tokens_per_s"] for r in mine) / len(mine), 3),
            "agreement_with_exact": round(sum(r["agreement_with_exact"] for r in mine) / len(mine), 3),
            "passkeys_found": sum(bool(r["passkey_found"]) for r in mine if r["input"] == "passkey"),
        }
    result = {"model": args.model, "random_weights": args.random_weights, "device": device_name(model),
              "length": args.length, "new": args.new, "options": opts, "rows": rows,
              "summary": summary, "machine": machine(), "threads": torch.get_num_threads()}
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=2), f"-> {args.out}")


if __name__ == "__main__":
    main()
