"""How far fot's bf16 greedy tokens and first-token logits stay from float32's, by where its half candidate step runs.

bench/dtype.py counts, position by position, the greedy tokens a float32 and a bf16 model give after a random
prompt: once the first token differs, every later one tends to.  This runs fot on the same bf16 model with its
half candidate step on every search, on none, and where ``half_pays`` says, beside float32 and the bare model,
and reports for each: the first position where the tokens leave float32's, the largest difference of the first
new token's logits from float32's, both runs' best two first tokens and the margin between them, and, for fot, how
often the searches the half step ran chose float32's exact top-k (each search also scored in float32 beside it).

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
from lcx.models import native_bf16, resolve_device
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


def first_token(logits: torch.Tensor) -> dict:
    """The best two first tokens and the margin between their logits."""
    top = logits.topk(2)
    return {"top2_ids": top.indices.tolist(), "top2_logits": top.values.tolist(),
            "margin": float(top.values[0] - top.values[1])}


EXACT = memory.top_inner_products


class Searches:
    """Stands in for ``memory.top_inner_products`` under one rule; where its half step runs, also scores the search
    in float32 and counts the queries whose top-k rows match exactly (as sets)."""

    def __init__(self, rule) -> None:
        self.rule, self.half_searches, self.queries, self.queries_same = rule, 0, 0, 0
        self.rows, self.rows_same = 0, 0

    def __call__(self, queries, keys, k, select_dtype=None, pays=None):
        values, rows = EXACT(queries, keys, k, select_dtype, pays=self.rule)
        if memory.takes_half_step(queries.shape[0], keys.shape[0], k, select_dtype, keys.device, self.rule):
            _, exact = EXACT(queries, keys, k)
            got, want = rows.sort(dim=-1).values, exact.sort(dim=-1).values
            self.half_searches += 1
            self.queries += queries.shape[0]
            self.queries_same += int((got == want).all(dim=-1).sum())
            self.rows += got.numel()
            self.rows_same += int((got[:, :, None] == want[:, None, :]).any(dim=-1).sum())
        return values, rows

    def summary(self) -> dict:
        return {"half_searches": self.half_searches, "queries": self.queries,
                "queries_same_top_k": self.queries_same / self.queries if self.queries else None,
                "rows_in_float32_top_k": self.rows_same / self.rows if self.rows else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", default="16K")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if resolve_device().type != "cpu":
        raise SystemExit("half_tokens compares where the CPU takes the half step (half_pays is a CPU rule); "
                         "unset LCX_DEVICE to run it on the CPU")
    if not native_bf16(torch.device("cpu")):
        raise SystemExit("half_tokens: this CPU has no native bf16, so fot never takes its half step and the rules "
                         "cannot differ; run it on a CPU with avx512_bf16 or AMX")
    tokens = token_counts(args.tokens)[0]
    options = parse_options(FOT_BEFORE)["fot"]
    ids = random_prompt(tokens)
    fp32, _ = bench_model(args.model, dtype="float32")
    bf16, _ = bench_model(args.model, dtype="bfloat16")
    try:
        rows = measure_all(fp32, bf16, options, ids, args.new)
    finally:
        memory.top_inner_products = EXACT
    result = {"benchmark": "half_tokens", **environment(), "model": args.model, "tokens": tokens,
              "new_tokens": args.new, "options": options, "methods": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


def measure_all(fp32, bf16, options: dict, ids: torch.Tensor, new: int) -> dict:
    """Per method (none, fot): float32's tokens and first tokens, and each bf16 run's against them."""
    rows = {}
    for method in (None, "fot"):
        memory.top_inner_products = EXACT
        ref_tokens, ref_logits = run(fp32, method, options, ids, new)
        ref = first_token(ref_logits)
        rows[method or "none"] = row = {"float32_tokens": ref_tokens, "float32_first": ref,
                                        "float32_margin": ref["margin"]}
        for rule in (RULES if method else ["-"]):
            searches = Searches(RULES.get(rule, memory.half_pays))
            memory.top_inner_products = searches
            toks, logits = run(bf16, method, options, ids, new)
            first = first_difference(toks, ref_tokens)
            row[rule] = {"tokens": toks, "same_tokens": sum(x == y for x, y in zip(toks, ref_tokens)),
                         "first_difference": first, "max_logit_difference": max_difference(logits, ref_logits),
                         "first": first_token(logits), **({"search": searches.summary()} if method else {})}
            r = row[rule]
            print(f"{method or 'none':>5} bf16 {rule:>9}: same {r['same_tokens']:2d}/{new}, first difference at "
                  f"{first}, max |logit - fp32| {r['max_logit_difference']:.3f}, top2 {r['first']['top2_ids']} "
                  f"margin {r['first']['margin']:.3f} (fp32 top2 {ref['top2_ids']} margin {ref['margin']:.3f})"
                  + (f", search {searches.summary()}" if method else ""), flush=True)
    return rows


if __name__ == "__main__":
    main()
