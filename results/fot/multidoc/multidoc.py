"""Multi-document memory on SmolLM2-135M, training-free: does a memory of documents A and B
answer a question about A with A's fact and about B with B's?

Two one-sentence documents ("The pass key of the red door is K_A ...", "... blue door is K_B ...")
go into one fot multi-document memory (each encoded on its own, as `lcx memory build` does);
the prompt holds only the question.  Reference: both documents in context, no memory.

    .venv/bin/python results/fot/multidoc/multidoc.py   # ~2 min on 2 cores; writes multidoc.json here

With ``--adapter DIR`` (e.g. results/fot/crossbatch/adapter, a crossbatch-trained fot LoRA) the same
questions are asked of the model with that adapter, in every variant; the results go to
multidoc-<adapter folder's parent>.json.
"""

import argparse
import json
from pathlib import Path

import torch

import lcx
from lcx.generation import generate
from lcx.models import load_model

KEYS = {"red": 58203, "blue": 46917}
DOC = "The pass key of the {c} door is {k}. Remember it. {k} is the pass key of the {c} door."
QUESTION = "\nWhat is the pass key of the {c} door? The pass key of the {c} door is"
LAYERS = "6,7,8,14,15,17,18,19,20,21,22,23"  # results/fot/retrieval
VARIANTS = {
    "in context (no memory)": None,
    "memory, retrieval layers": dict(memory_layers=LAYERS),
    "memory, retrieval layers, blue indexed first": dict(memory_layers=LAYERS, order="reversed"),
    "memory, all layers": dict(memory_layers="all"),
    "memory, all layers, dense": dict(memory_layers="all", dense=True),
    "memory, all layers, positions=none": dict(memory_layers="all", positions="none"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", type=Path, help="an lcx adapter folder to load onto the model")
    args = ap.parse_args()
    model, tok = load_model("smollm2-135m")
    if args.adapter:
        from lcx.adapters.peft_bridge import load_adapter

        model = load_adapter(model, args.adapter)[0]
    enc = lambda s: tok(s, return_tensors="pt")["input_ids"]  # noqa: E731
    docs = [DOC.format(c=c, k=k) for c, k in KEYS.items()]
    rows = []
    for name, opts in VARIANTS.items():
        answers = {}
        for color in KEYS:
            q = QUESTION.format(c=color)
            if opts is None:
                with lcx.attach(model, []) as run:
                    out = generate(run, enc(docs[0] + "\n" + docs[1] + q), max_new_tokens=6)
            else:
                o = dict(opts)
                order = docs[::-1] if o.pop("order", None) == "reversed" else docs
                with lcx.attach(model, ["fot"], fot=dict(local=1024, chunk=256, mode="multi", **o)) as run:
                    for i, d in enumerate(order):
                        run.method("fot").ingest(run, enc(d), i)
                    out = generate(run, enc(q), max_new_tokens=6)
            answers[color] = tok.decode(out[0], skip_special_tokens=True)
        correct = {c: str(KEYS[c]) in answers[c].replace(" ", "") for c in KEYS}
        rows.append({"variant": name, "options": opts, "answers": answers, "correct": correct})
        print(f"{name:48s} red -> {answers['red']!r:14s} blue -> {answers['blue']!r:14s} {correct}")
    out = Path(__file__).with_name(f"multidoc-{args.adapter.resolve().parent.name}.json" if args.adapter else "multidoc.json")
    out.write_text(json.dumps({"model": "smollm2-135m", "adapter": str(args.adapter) if args.adapter else None, "keys": KEYS,
                               "torch": torch.__version__, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
