"""How far fot's bf16 greedy tokens and first-token logits stay from float32's, by where its half candidate step runs.

bench/dtype.py counts, position by position, the greedy tokens a float32 and a bf16 model give after a random
prompt: once the first token differs, every later one tends to.  This runs fot on the same bf16 model with its
half candidate step on every search, on none, and where ``half_pays`` says, beside float32 and the bare model,
and reports for each: the first position where the tokens leave float32's, the largest difference of the first
new token's logits from float32's, and float32's margin between its best and second-best first token.

    .venv/bin/python bench/half_tokens.py [--tokens 16K] [--out bench/results/half_tokens.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import LogitsProcessorList

import lcx
from lcx.generation import generate
from lcx.io import token_counts
from lcx.plugins.fot import memory
from lcx.session import parse_options
from loading import bench_model
from provenance import environment  # bench/provenance.py (scripts here run as `python bench/NAME.py`)
from dtype import FOT_BEFORE, random_prompt

OUT = Path(__file__).parent / "results" / "half_tokens.json"
RULES = {"half_pays": memory.half_pays, "always": lambda queries, keys: True, "never": lambda queries, keys: False}


class Scores:
    """A logits processor that keeps each step's float32 logits."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        self.steps.append(scores[0].float().clone())
        return scores


def run(model, method: str | None, options: dict, ids: torch.Tensor, new: int) -> tuple[list[int], torch.Tensor]:
    keep = Scores()
    with lcx.attach(model, [method] if method else [], **({method: options} if method else {})) as attached:
        out = generate(attached, ids, max_new_tokens=new, min_new_tokens=new,
                       logits_processor=LogitsProcessorList([keep]))
    return out[0].tolist(), keep.steps[0]


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| over the tokens both leave finite (generate masks some with -inf)."""
    finite = a.isfinite() & b.isfinite()
    return float((a - b)[finite].abs().max())


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", default="16K")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    tokens = token_counts(args.tokens)[0]
    options = parse_options(FOT_BEFORE)["fot"]
    ids = random_prompt(tokens)
    fp32, _ = bench_model(args.model, dtype="float32")
    bf16, _ = bench_model(args.model, dtype="bfloat16")
    defaults = memory.top_inner_products.__defaults__
    try:
        rows = measure_all(fp32, bf16, options, ids, args.new)
    finally:
        memory.top_inner_products.__defaults__ = defaults
    result = {"benchmark": "half_tokens", **environment(), "model": args.model, "tokens": tokens,
              "new_tokens": args.new, "options": options, "methods": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


def measure_all(fp32, bf16, options: dict, ids: torch.Tensor, new: int) -> dict:
    """Per method (none, fot): float32's tokens and first-token margin, and each bf16 run's against them."""
    rows = {}
    for method in (None, "fot"):
        ref_tokens, ref_logits = run(fp32, method, options, ids, new)
        top2 = ref_logits.topk(2).values
        rows[method or "none"] = row = {"float32_tokens": ref_tokens, "float32_margin": float(top2[0] - top2[1])}
        for rule in (RULES if method else ["-"]):
            memory.top_inner_products.__defaults__ = (None, RULES.get(rule, memory.half_pays))
            toks, logits = run(bf16, method, options, ids, new)
            first = first_difference(toks, ref_tokens)
            row[rule] = {"tokens": toks, "same_tokens": sum(x == y for x, y in zip(toks, ref_tokens)),
                         "first_difference": first, "max_logit_difference": max_difference(logits, ref_logits)}
            print(f"{method or 'none':>5} bf16 {rule:>9}: same {row[rule]['same_tokens']:2d}/{new}, first "
                  f"difference at {first}, max |logit - fp32| {row[rule]['max_logit_difference']:.3f} "
                  f"(fp32 margin {row['float32_margin']:.3f})", flush=True)
    return rows


if __name__ == "__main__":
    main()
