"""Where does the dictionary lookup lose accuracy as the dictionary grows?  A diagnostic, not a method.

    .venv/bin/python results/fot/dictionary/diagnose.py MODEL --dict-tokens 16K --samples 2 --seed 99 \
        [--definitions-without-memory] [--out FILE.json]

Scores `lcx eval dictionary`'s documents (same generator, seed, fot options: local 256, k 32, memory in
every layer) but, with --definitions-without-memory, every window of definitions is read with fot's
memory attention seeing an empty memory (its keys still go to memory), while the query window reads the
full memory as usual.  In training (512-token documents, two contexts per row) definitions are always the
first context of a row, read without memory; at evaluation every definition window after the first is
read with the memory of all earlier ones.  If accuracy rises with this switch, that mismatch is costing it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import lcx.plugins.fot.method as fot_method
from lcx.evals import dictionary
from lcx.generation import tail_logits
from lcx.io import token_counts
from lcx.plugins.fot.memory import make_store
from lcx.session import open_session, parse_options

OPTIONS = ("fot.w=1", "fot.memory_layers=all", "fot.local=256", "fot.k=32",
           # fot's defaults before issue 52 (these results were made with them)
           "fot.chunk=0", "fot.sinks=0", "fot.positions=first", "fot.fixed_distance=0", "fot.gate=off")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--dict-tokens", default="16K")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--seed", type=int, default=99)
    ap.add_argument("--definitions-without-memory", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    (n,) = token_counts(a.dict_tokens)  # one size, parsed as `lcx eval dictionary --dict-tokens` parses them

    reading_definitions = [False]
    memory_attention = fot_method.memory_attention

    def masked(query, key, value, mask, memory, *args, **kwargs):
        if reading_definitions[0]:
            memory = {k: make_store(store.config) for k, store in memory.items()}
        return memory_attention(query, key, value, mask, memory, *args, **kwargs)

    fot_method.memory_attention = masked
    s = open_session(a.model, ["fot"], parse_options(OPTIONS), None, False, require_tokenizer=False)

    def window_start(module, args, kwargs):  # a window starting inside the dictionary reads definitions
        reading_definitions[0] = a.definitions_without_memory and int(kwargs["position_ids"][0, 0]) < n

    s.model.register_forward_pre_hook(window_start, with_kwargs=True)
    rng = random.Random(a.seed)  # the same documents as `lcx eval dictionary --seed` at this one size
    rows = []
    with s.run as run:
        for _ in range(a.samples):
            doc = dictionary.make_document(rng, n, 256)
            rows.append(dictionary.score(doc, lambda ids, k: tail_logits(run, ids, k), 256))
            print(rows[-1], file=sys.stderr, flush=True)
    result = {"model": a.model, "dict_tokens": n, "seed": a.seed, "options": OPTIONS,
              "definitions_without_memory": a.definitions_without_memory, "samples": rows,
              "accuracy": sum(r["correct"] for r in rows) / sum(r["queries"] for r in rows),
              "command": " ".join(["python", *sys.argv])}
    text = json.dumps(result, indent=2)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
