"""Perplexity vs context (the FocusLLM / CEPE protocol).

For each document and each context length N, score the ``target`` tokens
(default 256) that follow N tokens of context: perplexity and next-token
accuracy of those tokens.  Samples are taken at ``samples`` evenly spaced
offsets in each document where N + target tokens fit; the same offsets serve
every N (the target spans end at the same place), so curves compare context
lengths on identical targets.  The first span starts after the longest N asked
for, or after ``room`` tokens when given: two runs asking for different context
lengths score the same text only when they leave the same room.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from lcx.errors import LcxError
from lcx.io import pyplot, save_figure, write_json  # noqa: F401  (write_json: re-exported for the CLI)


@dataclass
class PplConfig:
    contexts: list[int]
    target: int = 256
    samples: int = 1
    room: int = 0  # tokens before the first scored span; 0 = the longest context

    def validate(self) -> None:
        if not self.contexts or any(n <= 0 for n in self.contexts):
            raise LcxError(f"contexts must be positive token counts, got {self.contexts}")
        if self.target <= 0 or self.samples <= 0:
            raise LcxError(f"target and samples must be >= 1 (got target={self.target}, samples={self.samples})")
        if self.room and self.room < max(self.contexts):
            raise LcxError(f"room={self.room} leaves no space for the context of {max(self.contexts)} tokens before the "
                           f"scored span; give --room >= {max(self.contexts)} (or drop it: the default is the longest context)")

    @property
    def longest(self) -> int:
        """Tokens before the first scored span."""
        return self.room or max(self.contexts)


def sample_ends(n_tokens: int, longest: int, target: int, samples: int) -> list[int]:
    """End positions (exclusive) of the scored spans: evenly spaced where the longest context fits."""
    lo = longest + target
    if n_tokens < lo:
        return []
    if samples == 1:
        return [lo]
    step = (n_tokens - lo) / (samples - 1)
    return sorted({lo + int(round(i * step)) for i in range(samples)})


def evaluate(
    score_fn: Callable[[torch.Tensor, int], dict[str, float]],
    documents: list[tuple[str, list[int]]],
    config: PplConfig,
    progress: bool = True,
    prefix: list[int] | None = None,
) -> dict[str, Any]:
    """``documents``: (name, token ids); ``score_fn(ids (1, T), n_target)`` -> nll_sum/correct/count.
    ``prefix``: tokens every span starts with, before its context (the tokenizer's BOS where it adds one:
    Gemma degenerates without it)."""
    prefix = list(prefix or [])
    config.validate()
    longest = config.longest
    work, too_short = [], []
    for name, ids in documents:
        ends = sample_ends(len(ids), longest, config.target, config.samples)
        if not ends:
            too_short.append(name)
            continue
        for end in ends:
            for n in config.contexts:
                work.append((name, ids, end, n))
    if not work:
        raise LcxError(
            f"no document has {longest + config.target} tokens (--room {config.room} + target); use longer documents "
            f"or a smaller --room (at least the longest context, {max(config.contexts)})" if config.room else
            f"no document has {longest + config.target} tokens (longest context + target); "
            "use longer documents or smaller --contexts"
        )
    per_sample = []
    for name, ids, end, n in tqdm(work, desc="ppl", disable=not progress, unit="span"):
        span = torch.tensor(prefix + ids[end - n - config.target:end])[None]
        r = score_fn(span, config.target)
        per_sample.append({"document": name, "context": n, "end": end, **r,
                           "ppl": math.exp(r["nll_sum"] / r["count"]), "accuracy": r["correct"] / r["count"]})
    summary = summarize(per_sample, config.contexts)
    # what was read and what was not: a --max-docs 20 run may score fewer, and says so
    summary.update(documents_scored=len(documents) - len(too_short), documents_too_short=too_short)
    return {"config": asdict(config), "prefix_tokens": prefix, "samples": per_sample, "summary": summary}


def summarize(samples: list[dict[str, Any]], contexts: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"ppl": {}, "accuracy": {}, "by_document": {}}
    for n in contexts:
        rows = [s for s in samples if s["context"] == n]
        nll = sum(s["nll_sum"] for s in rows)
        cnt = sum(s["count"] for s in rows)
        out["ppl"][str(n)] = math.exp(nll / cnt)
        out["accuracy"][str(n)] = sum(s["correct"] for s in rows) / cnt
        for doc in sorted({s["document"] for s in rows}):
            d = [s for s in rows if s["document"] == doc]
            out["by_document"].setdefault(doc, {})[str(n)] = math.exp(sum(s["nll_sum"] for s in d) / sum(s["count"] for s in d))
    return out


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> Path:
    """Perplexity and accuracy vs context, one line per method stack."""
    fig, (a1, a2) = pyplot().subplots(1, 2, figsize=(10, 3.8))
    targets = set()
    for label, res in results.items():
        xs = sorted(int(n) for n in res["summary"]["ppl"])  # in context order, however --contexts listed them
        a1.plot(xs, [res["summary"]["ppl"][str(n)] for n in xs], marker="o", label=label)
        a2.plot(xs, [res["summary"]["accuracy"][str(n)] for n in xs], marker="o", label=label)
        targets.add(res.get("config", {}).get("target"))
    scored = f"the last {targets.pop()} tokens" if len(targets) == 1 and None not in targets else "the scored tokens"
    for ax, name in ((a1, f"perplexity of {scored}"), (a2, "next-token accuracy")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
    a1.set_yscale("log")
    a1.legend(fontsize=8)
    return save_figure(fig, path, title)
