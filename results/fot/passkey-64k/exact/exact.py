"""The two 64K samples fot missed with faiss-ivf (depth 0.5, keys 86465 and 76150), again with exact search.

Same prompts (lcx.evals.passkey.prompt_and_needle), same fot configuration as `run.sh passkey64` but
`backend=torch` (exact top-32): is the miss the approximate search's or the method's?  The two prompts
share their filler up to the needle, so the second starts from a copy of the first's memory there
(PrefixReuse, as the grid does).  Writes exact.json beside this file.

    .venv/bin/python results/fot/passkey-64k/exact/exact.py
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import lcx
from lcx.evals.passkey import prompt_and_needle
from lcx.generation import PrefixReuse, generate
from lcx.models import load_model

MISSED = [(65536, 0.5, 86465), (65536, 0.5, 76150)]  # from ../compare-passkey.fot.samples.jsonl
FOT = {"local": 1024, "chunk": 256, "memory_layers": "6,7,8,14,15,17,18,19,20,21,22,23", "backend": "torch",
       # fot's defaults before issue 52 (these results were made with them)
       "sinks": 0, "positions": "first", "fixed_distance": 0, "gate": "off"}


def main() -> None:
    model, tok = load_model("smollm2-135m")
    reuse, rows = PrefixReuse(), []
    with lcx.attach(model, ["fot"], fot=FOT) as run:
        for n, depth, key in MISSED:
            ids, shared = prompt_and_needle(tok, n, depth, key)
            t0 = time.perf_counter()
            new = generate(run, ids[None], max_new_tokens=8, reuse=reuse, shared=shared)
            text = tok.decode(new[0], skip_special_tokens=True)
            rows.append({"length": n, "tokens": int(ids.shape[0]), "depth": depth, "key": key, "output": text,
                         "found": str(key) in re.sub(r"\s+", "", text), "seconds": round(time.perf_counter() - t0, 1)})
            print(rows[-1], flush=True)
    out = Path(__file__).with_name("exact.json")
    out.write_text(json.dumps({"fot_options": FOT, "command": "python results/fot/passkey-64k/exact/exact.py",
                               "samples": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
