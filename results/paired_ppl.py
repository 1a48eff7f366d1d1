"""Paired perplexity table: each stack's runs against truncation's (vanilla) on the very same scored spans.

    .venv/bin/python results/paired_ppl.py FOLDER [FOLDER...]     # writes FOLDER/paired.md

FOLDER holds one folder per stack (FOLDER/STACK/compare-ppl.json: `lcx eval compare ppl --samples N`), one of
them vanilla. Per stack and context: perplexity over all spans, its ratio to truncation's, how many spans it
scores worse, and the spread of the per-span ratios, which says whether a 1% difference is more than which
spans were drawn.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ORDER = ["vanilla", "streaming", "fot", "fot-k2"]


def per_span(path: Path) -> tuple[dict[tuple[str, int, int], tuple[float, int]], tuple]:
    """{(document, context, end): (nll_sum, count)} of a finished one-stack run, and what must match vanilla's."""
    d = json.loads(path.read_text())
    if len(d["stacks"]) != 1 or d.get("unfinished"):
        raise SystemExit(f"{path}: expected one finished stack, found {sorted(d['stacks'])} "
                         f"(unfinished: {d.get('unfinished')}); rerun that stack alone")
    (stack,) = d["stacks"].values()
    same = (d["model"], stack["dtype"], stack["config"], stack["prefix_tokens"])
    return {(s["document"], s["context"], s["end"]): (s["nll_sum"], s["count"]) for s in stack["samples"]}, same


def table(folder: Path) -> str:
    loaded = {p.parent.name: per_span(p) for p in folder.glob("*/compare-ppl.json")}
    if "vanilla" not in loaded or not loaded["vanilla"][0]:
        raise SystemExit(f"{folder}: no vanilla run with spans to compare against (FOLDER/vanilla/compare-ppl.json)")
    for name, (_, same) in loaded.items():
        if same != loaded["vanilla"][1]:
            raise SystemExit(f"{folder}/{name}: another model, dtype or protocol than vanilla's; rerun it alike")
    runs = {name: spans for name, (spans, _) in loaded.items()}
    base = runs["vanilla"]
    contexts = sorted({k[1] for k in base})
    targets = sorted({c for _, c in base.values()})
    lines = [f"`{folder}`: {len(base) // len(contexts)} spans of {'/'.join(map(str, targets))} scored tokens per "
             "context, each stack against truncation (vanilla) on the same spans", "",
             "| stack | context | ppl | vs truncation | spans worse | per-span ratio (min, median, max) |",
             "|---|---|---|---|---|---|"]
    for name in sorted(runs, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n)):
        if runs[name].keys() != base.keys() or any(runs[name][k][1] != base[k][1] for k in base):
            raise SystemExit(f"{folder}/{name}: other spans than vanilla's; rerun both with the same command")
        for n in contexts:
            keys = [k for k in base if k[1] == n]
            count = sum(base[k][1] for k in keys)
            ppl, ref = (math.exp(sum(r[k][0] for k in keys) / count) for r in (runs[name], base))
            ratios = sorted(math.exp((runs[name][k][0] - base[k][0]) / base[k][1]) for k in keys)
            half = len(ratios) // 2
            mid = ratios[half] if len(ratios) % 2 else (ratios[half - 1] + ratios[half]) / 2
            lines.append(f"| {name} | {n:,} | {ppl:.2f} | {ppl / ref - 1:+.1%} | {sum(r > 1 for r in ratios)}/{len(keys)} | "
                         f"{ratios[0] - 1:+.1%}, {mid - 1:+.1%}, {ratios[-1] - 1:+.1%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    for arg in sys.argv[1:]:
        text = table(Path(arg))
        (Path(arg) / "paired.md").write_text(text)
        print(text)
