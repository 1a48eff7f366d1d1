"""Passkey retrieval (Mohtashami & Jaggi 2023), as used by FoT and FocusLLM.

A 5-digit key hidden at a given depth inside repeated filler, or inside real
text (a ``Haystack`` of books); the model must repeat it.  Grid over total
length (tokens) x needle depth, several random keys per cell; a sample counts
as found when the key appears in the first generated tokens.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from lcx.errors import LcxError
from lcx.io import Journal, pyplot, save_figure, token_label, write_json

INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"


class Haystack:
    """Real text to hide the needle in: the sentences of documents (files, folders, JSONL), in order.

    A prompt takes whole sentences from the start of the text, so every prompt of one length holds the same
    text and only the needle moves.  Whitespace is normalised (novels' hard line wraps are not text).
    """

    BATCH = 4096  # sentences tokenized at a time: only as much text as the longest prompt needs is read

    def __init__(self, paths: list[str], text_field: str = "text") -> None:
        from lcx.data import iter_documents

        self.paths = [str(p) for p in paths]
        text = " ".join(" ".join(d["text"].split()) for d in iter_documents(self.paths, text_field))
        self.sentences = [x for x in re.split(r"(?<=[.!?])\s+", text) if x]
        if not self.sentences:
            raise LcxError(f"haystack {', '.join(self.paths)} holds no text")
        self._ids: list[list[int]] = []
        self._tokens = 0
        self._tokenizer: Any = None

    @property
    def label(self) -> str:
        return ",".join(self.paths)

    def take(self, tokenizer: Any, n: int) -> list[list[int]]:
        """Whole sentences (token ids, each after a space) from the start, at most ``n`` tokens in all, and
        no fewer than ``n`` minus one sentence: a haystack too short for ``n`` is an error naming the shortfall."""
        if tokenizer is not self._tokenizer:
            self._ids, self._tokens, self._tokenizer = [], 0, tokenizer
        while self._tokens < n and len(self._ids) < len(self.sentences):
            batch = self.sentences[len(self._ids):len(self._ids) + self.BATCH]
            ids = tokenizer([" " + x for x in batch], add_special_tokens=False)["input_ids"]
            self._ids.extend(ids)
            self._tokens += sum(map(len, ids))
        out, total = [], 0
        for ids in self._ids:
            if total + len(ids) > n:
                return out
            out.append(ids)
            total += len(ids)
        if total < n - max(map(len, self._ids)):
            raise self._too_short(total, n)
        return out

    def _too_short(self, total: int, n: int) -> LcxError:
        return LcxError(f"the haystack {self.label} has {total:,} tokens of text, {n - total:,} fewer than a "
                        f"prompt of this length needs ({n:,}); give more text (more files, or a folder of books) "
                        f"or shorter --lengths")

    def fill(self, tokenizer: Any, n: int) -> list[list[int]]:
        """Exactly ``n`` tokens: whole sentences from the start, the last one cut to fit."""
        out = self.take(tokenizer, n)
        short = n - sum(map(len, out))
        if short:
            if len(out) == len(self._ids):
                raise self._too_short(n - short, n)
            out.append(self._ids[len(out)][:short])
        return out


def build_prompt_ids(tokenizer: Any, length: int, depth: float, key: int,
                     haystack: Haystack | None = None) -> torch.Tensor:
    """Token ids (1-D) of a passkey prompt of about ``length`` tokens with the needle at ``depth``."""
    return prompt_and_needle(tokenizer, length, depth, key, haystack)[0]


def prompt_and_needle(tokenizer: Any, length: int, depth: float, key: int,
                      haystack: Haystack | None = None) -> tuple[torch.Tensor, int]:
    """The prompt's ids and where its needle starts: the tokens before it are the same for every key.
    The needle sits between whole sentences: of the repeated filler, or of ``haystack``'s text."""
    if not 0.0 <= depth <= 1.0:
        raise LcxError(f"depth must be in [0, 1], got {depth}")
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    head = tokenizer(INSTRUCTION + "\n", add_special_tokens=True)["input_ids"]  # keeps the tokenizer's BOS, if any
    question = enc("\n" + QUESTION)
    needle = enc(" " + NEEDLE.format(key=key) + " ")
    n_fill = max(0, length - len(head) - len(question) - len(needle))
    if haystack is None:
        filler = enc(" " + FILLER)
        sentences = [filler] * (n_fill // len(filler))
        cut = int(round(depth * len(sentences))) * len(filler)
    else:
        sentences = haystack.take(tokenizer, n_fill)
        bounds = [0]
        for x in sentences:
            bounds.append(bounds[-1] + len(x))
        cut = min(bounds, key=lambda b: abs(b - depth * bounds[-1]))  # the sentence boundary nearest the depth
    fill = [t for x in sentences for t in x]
    ids = head + fill[:cut] + needle + fill[cut:] + question
    return torch.tensor(ids, dtype=torch.long), len(head) + cut


def shortest_length(tokenizer: Any) -> int:
    """The fewest tokens a passkey prompt with one filler sentence takes (instruction, needle, question and
    one sentence to hide it in): shorter lengths cannot be built as asked."""
    return int(build_prompt_ids(tokenizer, 0, 0.5, 10000).shape[0]) + len(
        tokenizer(" " + FILLER, add_special_tokens=False)["input_ids"])


DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # where a grid hides its needles unless asked otherwise


@dataclass
class PasskeyConfig:
    lengths: list[int]
    depths: list[float] = field(default_factory=lambda: list(DEPTHS))
    samples: int = 5
    seed: int = 0
    max_new_tokens: int = 8
    #: files or folders of text hiding the needle ("," joined), or None for the repeated filler
    haystack: str | None = None

    def validate(self) -> None:
        if not self.lengths or any(n <= 0 for n in self.lengths):
            raise LcxError(f"lengths must be positive token counts, got {self.lengths}")
        if self.samples <= 0:
            raise LcxError(f"samples must be >= 1, got {self.samples}")
        if not self.depths:
            raise LcxError("depths must name at least one needle depth in [0, 1], got none")
        for d in self.depths:
            if not 0.0 <= d <= 1.0:
                raise LcxError(f"depths must be in [0, 1], got {d}")


def evaluate(
    generate_fn: Callable[[torch.Tensor, int, int], torch.Tensor],
    tokenizer: Any,
    config: PasskeyConfig,
    progress: bool = True,
    journal: Journal | None = None,
) -> dict[str, Any]:
    """Run the grid; ``generate_fn(ids (1, T), max_new_tokens, shared) -> new ids (1, N)``, where the first
    ``shared`` tokens (instruction and filler up to the needle) are the same for every key of a cell, so
    a generator may feed them once (``lcx.generation.PrefixReuse``).

    With a ``journal`` every finished sample is recorded as it completes, and samples the journal
    already holds (a resumed run: same seed, so the same keys) are taken from it, not recomputed."""
    config.validate()
    haystack = Haystack(config.haystack.split(",")) if config.haystack else None
    if haystack is not None:  # too little text is said before any sample runs
        haystack.take(tokenizer, max(config.lengths) - shortest_length(tokenizer))
    least = shortest_length(tokenizer)
    short = [n for n in config.lengths if n < least]
    if short:
        raise LcxError(f"passkey length {short[0]:,} is shorter than the shortest passkey prompt ({least:,} tokens: "
                       f"instruction, key, question and one filler sentence); give lengths of at least {least:,}")
    rng = random.Random(config.seed)
    cells = [(n, d) for n in config.lengths for d in config.depths]
    samples: list[dict[str, Any]] = []
    bar = tqdm(total=len(cells) * config.samples, desc="passkey", disable=not progress, unit="sample")
    for n, d in cells:
        for i in range(config.samples):
            key = rng.randint(10000, 99999)
            sid = f"{n}@{d}#{i}:{key}"
            done = journal.get(sid) if journal is not None else None
            if done is not None:  # scored again: the journal keeps the output, the check is today's
                samples.append({**{k: v for k, v in done.items() if k != "id"},
                                "found": passkey_found(done["key"], done["output"])})
                bar.update(1)
                continue
            ids, shared = prompt_and_needle(tokenizer, n, d, key, haystack)
            ids = ids[None]
            t0 = time.perf_counter()
            new = generate_fn(ids, config.max_new_tokens, shared)
            dt = time.perf_counter() - t0
            text = tokenizer.decode(new[0], skip_special_tokens=True)
            found = passkey_found(key, text)
            samples.append({"length": n, "tokens": int(ids.shape[1]), "depth": d, "key": key,
                            "output": text, "found": found, "seconds": round(dt, 3),
                            **request_options(generate_fn)})
            if journal is not None:
                journal.append(sid, samples[-1])
            bar.update(1)
            bar.set_postfix(acc=f"{sum(s['found'] for s in samples) / len(samples):.2f}")
    bar.close()
    reused = journal.reused if journal is not None else 0
    return {"config": asdict(config), "samples": samples, "summary": summarize(samples), "resumed_samples": reused}


def request_options(generate_fn: Any) -> dict[str, Any]:
    """``{"request_options": ...}`` when the generator says what per-request options its last prompt ran with
    (``lcx.cli.evaluation._grid_generator``: rope's factor, focusllm's chunk under auto), else nothing."""
    chosen = getattr(generate_fn, "request_options", None)
    return {"request_options": chosen} if chosen else {}


def passkey_found(key: int, text: str) -> bool:
    """Whether ``text`` answers with the key: the key as a whole number, not part of a longer one
    (" 8646555" does not answer 86465); digits a tokenizer wrote apart (" 8 6 4 6 5") are read together."""
    digits = re.sub(r"(?<=\d)\s+(?=\d)", "", text)
    return re.search(rf"(?<!\d){int(key)}(?!\d)", digits) is not None


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    by_len: dict[int, list[bool]] = {}
    grid: dict[str, float] = {}
    cells: dict[tuple[int, float], list[bool]] = {}
    for s in samples:
        by_len.setdefault(s["length"], []).append(s["found"])
        cells.setdefault((s["length"], s["depth"]), []).append(s["found"])
    for (n, d), v in cells.items():
        grid[f"{n}@{d}"] = sum(v) / len(v)
    return {
        "accuracy": sum(s["found"] for s in samples) / max(len(samples), 1),
        "accuracy_by_length": {str(n): sum(v) / len(v) for n, v in sorted(by_len.items())},
        "accuracy_by_cell": grid,
        "n": len(samples),
    }


def plot_heatmap(result: dict[str, Any], path: Path, title: str) -> Path:
    """Accuracy heatmap: depth (rows) x length (columns)."""
    lengths = result["config"]["lengths"]
    depths = result["config"]["depths"]
    grid = result["summary"]["accuracy_by_cell"]
    data = [[grid.get(f"{n}@{d}", float("nan")) for n in lengths] for d in depths]
    fig, ax = pyplot().subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.5 * len(depths)))
    im = ax.imshow(data, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [token_label(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("needle depth")
    for i, row in enumerate(data):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.0%}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, fraction=0.046)
    return save_figure(fig, path, title)


def write_result(result: dict[str, Any], out_dir: Path, stem: str = "passkey") -> tuple[Path, Path]:
    js = write_json(result, out_dir / f"{stem}.json")
    title = f"passkey — {result.get('model', '?')} — {result.get('methods_label', '')}"
    png = plot_heatmap(result, out_dir / f"{stem}.png", title)
    return js, png
