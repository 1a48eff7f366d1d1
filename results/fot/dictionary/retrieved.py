"""Which memory entries win when the dictionary lookup fails at a large size?  A diagnostic, not a method.

    .venv/bin/python results/fot/dictionary/retrieved.py MODEL --dict-tokens 64K --samples 2 --seed 99 \
        [--k 32] [--memory-layers all] [--out FILE.json]

Scores `lcx eval dictionary`'s documents (same generator and seed, fot options local 256, memory in every
layer) and, for the query window, records each layer's and head's kNN search for the four positions that
predict a query's value tokens.  Per value token, right or wrong, it counts what the search ranked first:

    right entry         the definition's token that the prediction should copy (its value token)
    same definition     another token of the right definition
    other, shares S     a token of another definition whose key shares S of the query's 4 key symbols

with that entry's offset in its definition (0 = <k>, 1-4 key, 5 = <v>, 6-9 value), and the rank of the
right entry among the k retrieved (-1: not retrieved).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys

import lcx.plugins.fot.attention as fot_attention
from lcx.evals import dictionary as dct
from lcx.generation import tail_logits
from lcx.io import token_counts
from lcx.session import open_session, parse_options

QUERY_TOKENS = 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--dict-tokens", default="64K")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--seed", type=int, default=99)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--memory-layers", default="all", help="fot.memory_layers: all, or e.g. 1 (the l1 models)")
    ap.add_argument("--out")
    a = ap.parse_args()
    (n,) = token_counts(a.dict_tokens)
    if n % 256:
        sys.exit(f"--dict-tokens must be a multiple of 256 (the query window must be one forward pass), got {n}")
    options = ("fot.w=1", f"fot.memory_layers={a.memory_layers}", "fot.local=256", f"fot.k={a.k}",
               # fot's defaults before issue 52 (these results were made with them)
               "fot.chunk=0", "fot.sinks=0", "fot.positions=first", "fot.fixed_distance=0", "fot.gate=off")

    state: dict = {"layer": 0, "record": False, "found": {}}
    memory_scores = fot_attention._memory_scores

    def recording(qm, stores, k, dense, *rest):  # memory_attention calls it once per memory layer, in layer order
        # (state["layer"] counts memory layers: with --memory-layers 1, "layer 0" is model layer 1)
        if state["record"]:
            state["found"][state["layer"]] = [(store.search(qm[h], k)[1], store.positions)
                                             for h, store in enumerate(stores)]
        state["layer"] += 1
        return memory_scores(qm, stores, k, dense, *rest)

    fot_attention._memory_scores = recording
    s = open_session(a.model, ["fot"], parse_options(options), None, False, require_tokenizer=False)

    def window_start(module, args, kwargs):  # record the query window only: it starts at token n
        state["layer"], state["record"] = 0, int(kwargs["position_ids"][0, 0]) == n

    s.model.register_forward_pre_hook(window_start, with_kwargs=True)
    rng = random.Random(a.seed)  # the same documents as `lcx eval dictionary --seed` at this one size
    first: collections.Counter = collections.Counter()
    rank: collections.Counter = collections.Counter()
    tokens = collections.Counter()
    with s.run as run:
        for _ in range(a.samples):
            doc = dct.make_document(rng, n, QUERY_TOKENS)
            ids = doc.input_ids.tolist()
            pred = tail_logits(run, doc.input_ids[None], QUERY_TOKENS).argmax(-1).tolist()
            labels = doc.labels[-QUERY_TOKENS:].tolist()
            n_def = n // dct.ENTRY
            defined = {tuple(ids[dct.ENTRY * i + 1:dct.ENTRY * i + 5]): i for i in range(n_def)}
            for j in range(doc.n_queries):
                key = tuple(ids[n + dct.ENTRY * j + 1:n + dct.ENTRY * j + 5])
                d = defined[key]
                for t in range(dct.VALUE_LEN):
                    q = dct.ENTRY * j + 5 + t  # the query-window position that predicts value token t + 1
                    ok = "right" if pred[q + 1] == labels[q + 1] else "wrong"
                    tokens[ok] += 1
                    target = dct.ENTRY * d + 6 + t
                    for layer, heads in state["found"].items():
                        for h, (idx, positions) in enumerate(heads):
                            pos = positions[idx[q]].tolist()
                            top, (d1, off) = pos[0], divmod(pos[0], dct.ENTRY)
                            if top == target:
                                what = "right entry"
                            elif d1 == d:
                                what = f"same definition, offset {off}"
                            else:
                                shared = sum(x == y for x, y in zip(ids[dct.ENTRY * d1 + 1:dct.ENTRY * d1 + 5], key))
                                what = f"other, shares {shared}, offset {off}"
                            head = f"layer {layer} head {h}"
                            first[(head, ok, what)] += 1
                            rank[(head, ok, pos.index(target) if target in pos else -1)] += 1
            print(f"document done: {tokens['right']} of {sum(tokens.values())} value tokens right so far",
                  file=sys.stderr, flush=True)
    result: dict = {"model": a.model, "dict_tokens": n, "seed": a.seed, "samples": a.samples, "options": options,
                    "value_tokens": dict(tokens), "ranked_first": {}, "rank_of_right_entry": {},
                    "command": " ".join(["python", *sys.argv])}
    for (head, ok, what), c in sorted(first.items(), key=lambda x: -x[1]):
        result["ranked_first"].setdefault(head, {}).setdefault(ok, {})[what] = c
    for (head, ok, r), c in sorted(rank.items(), key=lambda x: x[0][2]):
        result["rank_of_right_entry"].setdefault(head, {}).setdefault(ok, {})[str(r)] = c
    text = json.dumps(result, indent=2)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
