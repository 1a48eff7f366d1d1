"""Multi-document memory on SmolLM2-135M, training-free: does a memory of documents A and B
answer a question about A with A's fact and about B with B's?

Two one-sentence documents ("The pass key of the red door is K_A ...", "... blue door is K_B ...")
go into one fot multi-document memory (each encoded on its own, as `lcx memory build` does);
the prompt holds only the question.  Reference: both documents in context, no memory.

    .venv/bin/python results/fot/multidoc/multidoc.py   # ~2 min on 2 cores; writes multidoc.json here

With ``--adapter DIR`` (e.g. results/fot/crossbatch/adapter, a crossbatch-trained fot LoRA) the same
questions are asked of the model with that adapter, in every variant; the results go to
multidoc-<adapter folder's parent>.json.

``--task kinds``: A holds a pass key and B the name of a city, so each question needs one document's
fact and no binding of like facts to their document; a "memory, no documents" row shows what the
model answers without them.  Writes multidoc-kinds.json.
"""

import argparse
import json
from pathlib import Path

import torch

import lcx
from lcx.evals.passkey import FILLER, INSTRUCTION
from lcx.generation import generate
from lcx.models import load_model

KEYS = {"red": 58203, "blue": 46917}
DOC = "The pass key of the {c} door is {k}. Remember it. {k} is the pass key of the {c} door."
QUESTION = "\nWhat is the pass key of the {c} door? The pass key of the {c} door is"
_FILL = lambda n: (" " + FILLER) * n  # noqa: E731
_haystack = lambda fact: INSTRUCTION + "\n" + _FILL(10) + " " + fact + _FILL(10)  # noqa: E731
_PROMPT = INSTRUCTION + "\n" + _FILL(5) + "\n"
# task "doors": like facts, one per document; task "kinds": a different kind of fact per document
TASKS = {
    "doors": {c: (DOC.format(c=c, k=k), QUESTION.format(c=c), str(k)) for c, k in KEYS.items()},
    # passkey-style: each fact inside filler after the passkey instruction; the prompt is the instruction,
    # a little filler and the question (a bare question, with no context to attend from, ignores memory)
    "kinds": {
        "A (pass key)": (_haystack("The pass key is 58203. Remember it. 58203 is the pass key."),
                         _PROMPT + "What is the pass key? The pass key is", "58203"),
        "B (city)": (_haystack("The secret city is called Quenmoor. Remember it. Quenmoor is the name of the secret city."),
                     _PROMPT + "What is the secret city called? The secret city is called", "Quenmoor"),
    },
}
LAYERS = "6,7,8,14,15,17,18,19,20,21,22,23"  # results/fot/retrieval
# fot's defaults before issue 52 (these results were made with them); a variant's own options override them
FOT_BEFORE = dict(sinks=0, positions="first", fixed_distance=0, gate="off")
VARIANTS = {
    "in context (no memory)": None,
    "memory, retrieval layers": dict(memory_layers=LAYERS),
    "memory, retrieval layers, blue indexed first": dict(memory_layers=LAYERS, order="reversed"),
    "memory, all layers": dict(memory_layers="all"),
    "memory, all layers, blue indexed first": dict(memory_layers="all", order="reversed"),
    "memory, all layers, dense": dict(memory_layers="all", dense=True),
    "memory, all layers, positions=none": dict(memory_layers="all", positions="none"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", type=Path, help="an lcx adapter folder to load onto the model")
    ap.add_argument("--task", choices=sorted(TASKS), default="doors")
    args = ap.parse_args()
    task = TASKS[args.task]
    variants = dict(VARIANTS)
    if args.task == "kinds":  # "blue" is document B here
        variants = {k.replace("blue indexed first", "B indexed first"): v for k, v in variants.items()}
        variants["memory, no documents (control)"] = dict(memory_layers=LAYERS, docs=0)
    model, tok = load_model("smollm2-135m")
    if args.adapter:
        from lcx.adapters.peft_bridge import load_adapter

        model = load_adapter(model, args.adapter)[0]
    enc = lambda s: tok(s, return_tensors="pt")["input_ids"]  # noqa: E731
    docs = [doc for doc, _, _ in task.values()]
    rows = []
    for name, opts in variants.items():
        answers = {}
        for label, (_, q, _) in task.items():
            if opts is None:
                with lcx.attach(model, []) as run:
                    out = generate(run, enc(docs[0] + "\n" + docs[1] + q), max_new_tokens=6)
            else:
                o = dict(opts)
                order = docs[::-1] if o.pop("order", None) == "reversed" else docs
                order = order[: o.pop("docs", len(order))]
                fot_options = {**FOT_BEFORE, **dict(local=1024, chunk=256, mode="multi", **o)}
                with lcx.attach(model, ["fot"], fot=fot_options) as run:
                    for i, d in enumerate(order):
                        run.method("fot").ingest(run, enc(d), i)
                    out = generate(run, enc(q), max_new_tokens=6)
            answers[label] = tok.decode(out[0], skip_special_tokens=True)
        correct = {c: want in answers[c].replace(" ", "") for c, (_, _, want) in task.items()}
        rows.append({"variant": name, "options": opts, "answers": answers, "correct": correct})
        print(f"{name:48s} " + "  ".join(f"{c} -> {a!r:16s}" for c, a in answers.items()) + f" {correct}")
    stem = "multidoc" + (f"-{args.adapter.resolve().parent.name}" if args.adapter else "") + \
        ("" if args.task == "doors" else f"-{args.task}")
    out = Path(__file__).with_name(f"{stem}.json")
    out.write_text(json.dumps({"model": "smollm2-135m", "adapter": str(args.adapter) if args.adapter else None,
                               "task": args.task, "documents": docs,
                               "questions": {c: q for c, (_, q, _) in task.items()},
                               "expected": {c: w for c, (_, _, w) in task.items()},
                               "torch": torch.__version__, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
