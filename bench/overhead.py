"""Overhead of attaching lcx with no method: forward time of SmolLM2 at 2K tokens.

Untouched and attached forwards alternate in one run (this machine is noisy), so
their ratio is meaningful even when absolute times drift.  Goal: ratio <= 1.03.

    .venv/bin/python bench/overhead.py [--model smollm2-135m] [--tokens 2048] [--rounds 12]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

import lcx
from lcx.models import load_model
from provenance import environment  # bench/provenance.py (scripts here run as `python bench/NAME.py`)
from dtype import random_prompt

OUT = Path(__file__).parent / "results" / "overhead.json"


def timed_forward(model, ids) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        model(ids, logits_to_keep=1)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()

    model, _ = load_model(args.model)
    ids = random_prompt(args.tokens)
    for _ in range(args.warmup):
        timed_forward(model, ids)
        with lcx.attach(model):
            timed_forward(model, ids)
    plain, attached = [], []
    for r in range(args.rounds):
        # alternate which one goes first, so drift does not favour either
        order = ("plain", "attached") if r % 2 == 0 else ("attached", "plain")
        for kind in order:
            if kind == "plain":
                plain.append(timed_forward(model, ids))
            else:
                with lcx.attach(model):
                    attached.append(timed_forward(model, ids))
    # Pairs run back to back, so the per-round ratio cancels the machine's drift; report its median.
    ratios = [a / p for a, p in zip(attached, plain)]
    ratio = statistics.median(ratios)
    boot = random.Random(0)
    meds = sorted(statistics.median(boot.choices(ratios, k=len(ratios))) for _ in range(2000))
    ci = (meds[50], meds[1949])  # 95% bootstrap interval of the median ratio
    result = {
        "benchmark": "overhead", "model": args.model, "tokens": args.tokens, "rounds": args.rounds,
        **environment(), "plain_median_s": round(statistics.median(plain), 4), "attached_median_s": round(statistics.median(attached), 4),
        "plain_s": [round(x, 4) for x in plain], "attached_s": [round(x, 4) for x in attached],
        "ratio_attached_over_plain": round(ratio, 4), "ratio_of_medians": round(statistics.median(attached) / statistics.median(plain), 4),
        "ratio_95ci": [round(ci[0], 4), round(ci[1], 4)],
        "goal": "<= 1.03 (median of per-round ratios)", "pass": ratio <= 1.03,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    print(f"forward @ {args.tokens} tokens: untouched {result['plain_median_s']:.3f}s, "
          f"attached (no method) {result['attached_median_s']:.3f}s, ratio {ratio:.3f} "
          f"(95% CI {ci[0]:.3f}-{ci[1]:.3f}; goal <= 1.03)")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
