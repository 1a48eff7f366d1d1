"""RULER's synthetic tasks (Hsieh et al., 2024), generated offline over a haystack of real text.

Each task builds prompts of an exact token length from one instruction, a context and a question ending in
the answer prefix (raw text: base models continue it).  The needle tasks hide ``key -> value`` sentences
(or a chain of variable assignments) between the haystack's whole sentences, the queried one at the
sample's depth and the others at seeded random depths; the aggregation tasks (common and frequent words)
are word lists whose length is chosen to fill the prompt.  A sample is scored as RULER does: the fraction
of the expected strings found in the output, case-insensitively ("all"), or whether any is ("part").

A sample's prompt depends only on (seed, task, length, sample index), so adding a task or a length to a
grid changes no other sample, and a journal resumes them.
"""

from __future__ import annotations

import random
import re
import string
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from lcx.errors import LcxError
from lcx.evals.passkey import DEPTHS, Haystack, request_options
from lcx.io import Journal, pyplot, save_figure, token_label, write_json


@dataclass
class Prompt:
    """One generated sample: its ids, the strings a right answer holds, and where its parts sit."""

    ids: list[int]
    answers: list[str]
    metric: str  # "all" or "part"
    max_new_tokens: int
    shared: int  # leading tokens every sample of this task and length has in common
    needle_at: int | None = None  # token offset of the queried needle (needle tasks)
    context: tuple[int, int] = (0, 0)  # token span of the context (haystack and needles)


def score_all(output: str, answers: list[str]) -> float:
    """RULER's string_match_all: the share of the expected strings found in the output."""
    low = output.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


def score_part(output: str, answers: list[str]) -> float:
    """RULER's string_match_part: 1 if any expected string is in the output."""
    low = output.lower()
    return float(any(a.lower() in low for a in answers))


METRICS = {"all": score_all, "part": score_part}


# ---------------------------------------------------------------------- the building blocks
class Source:
    """What every task draws on: the haystack's sentences (the needle tasks' context) and its vocabulary
    (keys, word values and the common-words list), read once per evaluation."""

    def __init__(self, haystack: Haystack) -> None:
        self.haystack = haystack
        seen: dict[str, None] = {}
        for s in haystack.sentences:
            for w in re.findall(r"[A-Za-z]+", s):
                if 4 <= len(w) <= 10 and w.islower():
                    seen.setdefault(w)
        self.words = list(seen)
        if len(self.words) < 50:
            raise LcxError(f"the haystack {haystack.label} has {len(self.words)} distinct lower-case words; RULER's "
                           f"tasks draw keys and word lists from at least 50: give more text")

    def compound(self, rng: random.Random) -> str:
        """A key or word value unlikely to occur in the text or in another sample: two words joined by '-'."""
        return "-".join(rng.sample(self.words, 2))


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _head(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=True)["input_ids"]  # keeps the tokenizer's BOS, if any


def _with_needles(tokenizer: Any, source: Source, length: int, head: str, items: list[str], depths: list[float],
                  tail: str) -> tuple[list[int], list[int], tuple[int, int]]:
    """``head``, the haystack with ``items`` between whole sentences at ``depths`` (fractions of the context),
    and ``tail``, in exactly ``length`` tokens (the last haystack sentence cut to fit); returns the ids, each
    item's token offset and the context's span."""
    h, t = _head(tokenizer, head + "\n"), _encode(tokenizer, "\n" + tail)
    pieces = [_encode(tokenizer, " " + x) for x in items]
    budget = length - len(h) - len(t) - sum(map(len, pieces))
    if budget < 0:
        raise LcxError(f"a RULER prompt of {length:,} tokens cannot hold its instruction, needles and question "
                       f"({length - budget:,} tokens); give longer --lengths")
    sentences = source.haystack.fill(tokenizer, budget)
    whole = len(source.haystack.take(tokenizer, budget))  # the last of ``sentences`` may be cut: no needle after it
    bounds = [0]
    for s in sentences:
        bounds.append(bounds[-1] + len(s))
    cuts = [min(range(whole + 1), key=lambda i: abs(bounds[i] - d * bounds[-1])) for d in depths]
    order = sorted(range(len(items)), key=lambda i: (cuts[i], i))
    ids, at, prev = list(h), [0] * len(items), 0
    for i in order:
        for s in sentences[prev:cuts[i]]:
            ids += s
        prev = cuts[i]
        at[i] = len(ids)
        ids += pieces[i]
    for s in sentences[prev:]:
        ids += s
    span = (len(h), len(ids))
    return ids + t, at, span


def _fit_list(tokenizer: Any, length: int, head: str, tail: str,
              entries: Callable[[int], list[str]], most: int) -> tuple[list[int], int, int]:
    """``head``, a word list ``entries(n)`` (each after a space) and ``tail`` in at most ``length`` tokens,
    with the largest ``n`` <= ``most`` that fits (a binary search: the list's size grows with ``n``); returns
    the ids, the head's length and ``n``."""
    h, t = _head(tokenizer, head + "\n"), _encode(tokenizer, "\n" + tail)

    def build(n: int) -> list[int]:
        out = list(h)
        for ids in (tokenizer([" " + e for e in entries(n)], add_special_tokens=False)["input_ids"] if n else []):
            out += ids
        return out + t

    lo, hi = 0, most
    if len(build(0)) > length:
        raise LcxError(f"a RULER prompt of {length:,} tokens cannot hold its instruction and question; "
                       f"give longer --lengths")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(build(mid)) <= length:
            lo = mid
        else:
            hi = mid - 1
    return build(lo), len(h), lo


# ---------------------------------------------------------------------- the tasks
NIAH_HEAD = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
             "I will quiz you about the {kind} afterwards.")
NIAH_NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NIAH_TAIL = ("What are all the special magic {kind} for {query} mentioned in the provided text? "
             "The special magic {kind} for {query} mentioned in the provided text are")


def _value(kind: str, rng: random.Random, source: Source) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "words":
        return source.compound(rng)
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _niah(kind: str, keys: int = 1, values: int = 1, queries: int = 1, tokens: int = 32):
    """A needle task: ``keys`` needles of distinct keys (``queries`` of them asked), the first key with
    ``values`` needles (all asked); the first needle at the sample's depth, the others at random depths."""

    def make(tokenizer: Any, source: Source, rng: random.Random, length: int, depth: float) -> Prompt:
        names = [source.compound(rng) for _ in range(keys)]
        while len(set(names)) < keys:
            names = [source.compound(rng) for _ in range(keys)]
        needles = [(names[0], _value(kind, rng, source)) for _ in range(values)]
        needles += [(k, _value(kind, rng, source)) for k in names[1:]]
        asked = names[:queries]
        answers = [v for k, v in needles if k in asked]
        query = asked[0] if queries == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
        texts = [NIAH_NEEDLE.format(kind=kind, key=k, value=v) for k, v in needles]
        depths = [depth] + [rng.random() for _ in texts[1:]]
        ids, at, span = _with_needles(tokenizer, source, length, NIAH_HEAD.format(kind=kind), texts, depths,
                                      NIAH_TAIL.format(kind=kind, query=query))
        return Prompt(ids, answers, "all", tokens, min(at), at[0], span)

    return make


VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text."
VT_TAIL = ("Question: Find all variables that are assigned the value {value} in the text above. Answer: According "
           "to the chain(s) of variable assignment in the text above, {n} variables are assigned the value {value}, "
           "they are:")


def _variable_tracking(hops: int = 4, tokens: int = 30):
    """One chain ``VAR A = value``, ``VAR B = VAR A``, ... of ``hops`` + 1 variables, in reading order from
    the sample's depth on; every variable of the chain must be named."""

    def make(tokenizer: Any, source: Source, rng: random.Random, length: int, depth: float) -> Prompt:
        names: list[str] = []
        while len(names) < hops + 1:
            n = "".join(rng.choices(string.ascii_uppercase, k=5))
            if n not in names:
                names.append(n)
        value = str(rng.randint(10_000, 99_999))
        texts = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        depths = [depth] + sorted(depth + (1 - depth) * rng.random() for _ in texts[1:])
        ids, at, span = _with_needles(tokenizer, source, length, VT_HEAD, texts, depths,
                                      VT_TAIL.format(value=value, n=len(names)))
        return Prompt(ids, names, "all", tokens, min(at), at[0], span)

    return make


CWE_HEAD = ("Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.")
CWE_TAIL = ("Question: What are the {n} most common words in the above list? Answer: The top {n} words that appear "
            "most often in the list are:")


def _common_words(common: int = 10, often: int = 30, rarely: int = 3, tokens: int = 120):
    """A numbered list where ``common`` words appear ``often`` times each and as many others as fit appear
    ``rarely`` times (the last perhaps fewer); the common ones must be named.  Where ``often`` repeats would fill more than half the
    prompt they are fewer (but always more than ``rarely``)."""

    def make(tokenizer: Any, source: Source, rng: random.Random, length: int, depth: float) -> Prompt:
        seed = rng.getrandbits(64)
        most = min((len(source.words) - common) * rarely, length)  # an entry is at least one token
        per_entry = len(_encode(tokenizer, " 999. " + source.words[0]))
        repeats = max(rarely + 1, min(often, length // (2 * common * per_entry)))

        def draw(n: int) -> tuple[list[str], list[str]]:  # (the common words, the list with n rare entries)
            r = random.Random(seed)
            words = r.sample(source.words, common + -(-n // rarely))
            seq = words[:common] * repeats + [w for w in words[common:] for _ in range(rarely)][:n]
            r.shuffle(seq)
            return words[:common], seq

        entries = lambda n: [f"{i + 1}. {w}" for i, w in enumerate(draw(n)[1])]  # noqa: E731
        ids, head, n = _fit_list(tokenizer, length, CWE_HEAD, CWE_TAIL.format(n=common), entries, most)
        answers = draw(n)[0]
        return Prompt(ids, answers, "all", tokens, head, None, (head, len(ids)))

    return make


FWE_HEAD = ("Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words.")
FWE_TAIL = ("Question: Do not provide any explanation. What are the three most frequently appeared words in the "
            "above coded text? Answer: According to the coded text above, the three most frequently appeared "
            "words are:")


def _frequent_words(alpha: float = 2.0, vocabulary: int = 2000, tokens: int = 50):
    """Coded (random) words drawn from a Zipf law of exponent ``alpha``, as many as fit; the three most
    frequent must be named.  A longer prompt extends the same draw."""

    def make(tokenizer: Any, source: Source, rng: random.Random, length: int, depth: float) -> Prompt:
        vocab: list[str] = []
        while len(vocab) < vocabulary:
            w = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(4, 6)))
            if w not in vocab:
                vocab.append(w)
        weights = [1 / (r + 1) ** alpha for r in range(vocabulary)]
        stream = rng.choices(vocab, weights=weights, k=length)  # more than ever fits: a word is >= 1 token

        ids, head, n = _fit_list(tokenizer, length, FWE_HEAD, FWE_TAIL, lambda m: stream[:m], length)
        answers = [w for w, _ in Counter(stream[:n]).most_common(3)]
        return Prompt(ids, answers, "all", tokens, head, None, (head, len(ids)))

    return make


#: name -> generator(tokenizer, source, rng, length, depth) -> Prompt
TASKS: dict[str, Callable[..., Prompt]] = {
    "niah_single_number": _niah("numbers"),
    "niah_single_word": _niah("words"),
    "niah_single_uuid": _niah("uuids", tokens=64),
    "niah_multikey": _niah("numbers", keys=4),
    "niah_multivalue": _niah("numbers", values=4, tokens=64),
    "niah_multiquery": _niah("numbers", keys=4, queries=4, tokens=64),
    "vt": _variable_tracking(),
    "cwe": _common_words(),
    "fwe": _frequent_words(),
}


def parse_tasks(spec: str) -> list[str]:
    """``"all"``, or task names (and prefixes: ``niah`` = every needle task) joined by commas."""
    names: list[str] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        hits = list(TASKS) if part == "all" else [t for t in TASKS if t == part or t.startswith(part + "_")]
        if not hits:
            raise LcxError(f"unknown RULER task {part!r}; tasks: {', '.join(TASKS)} (or all, or niah for every "
                           f"needle task)")
        names += [t for t in hits if t not in names]
    if not names:
        raise LcxError("no RULER task named; give --tasks all or some of: " + ", ".join(TASKS))
    return names


def make_prompt(task: str, tokenizer: Any, source: Source, length: int, depth: float, seed: int,
                index: int) -> Prompt:
    """Sample ``index`` of ``task`` at ``length`` tokens: the same prompt for the same arguments."""
    rng = random.Random(f"{seed}:{task}:{length}:{index}")
    return TASKS[task](tokenizer, source, rng, length, depth)


# ---------------------------------------------------------------------- the grid
@dataclass
class RulerConfig:
    lengths: list[int]
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    samples: int = 5
    #: sample i's queried needle sits at depths[i % len(depths)]
    depths: list[float] = field(default_factory=lambda: list(DEPTHS))
    seed: int = 0
    #: files or folders of text ("," joined)
    haystack: str = ""
    #: new tokens per answer; None: each task's own
    max_new_tokens: int | None = None

    def validate(self) -> None:
        if not self.lengths or any(n <= 0 for n in self.lengths):
            raise LcxError(f"lengths must be positive token counts, got {self.lengths}")
        if self.samples <= 0:
            raise LcxError(f"samples must be >= 1, got {self.samples}")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise LcxError(f"depths must be in [0, 1], got {self.depths}")
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown or not self.tasks:
            raise LcxError(f"unknown RULER task {unknown[0] if unknown else None!r}; tasks: {', '.join(TASKS)}")
        if not self.haystack:
            raise LcxError("RULER needs a haystack of real text: give --haystack PATH (e.g. ../shared/data/books)")


def evaluate(
    generate_fn: Callable[[torch.Tensor, int, int], torch.Tensor],
    tokenizer: Any,
    config: RulerConfig,
    progress: bool = True,
    journal: Journal | None = None,
) -> dict[str, Any]:
    """Run the lengths x tasks x samples grid; ``generate_fn(ids (1, T), max_new_tokens, shared) -> new ids
    (1, N)`` as for the passkey grid.  With a ``journal`` finished samples are recorded and reused."""
    config.validate()
    source = Source(Haystack(config.haystack.split(",")))
    source.haystack.fill(tokenizer, max(config.lengths))  # too little text is said before any sample runs
    cells = [(n, t) for n in config.lengths for t in config.tasks]
    samples: list[dict[str, Any]] = []
    bar = tqdm(total=len(cells) * config.samples, desc="ruler", disable=not progress, unit="sample")
    for n, task in cells:
        for i in range(config.samples):
            sid = f"{task}@{n}#{i}"
            done = journal.get(sid) if journal is not None else None
            if done is not None:  # scored again: the journal keeps the output, the scoring is today's
                samples.append({**{k: v for k, v in done.items() if k != "id"},
                                "score": METRICS[done["metric"]](done["output"], done["answers"])})
                bar.update(1)
                continue
            depth = config.depths[i % len(config.depths)]
            p = make_prompt(task, tokenizer, source, n, depth, config.seed, i)
            ids = torch.tensor([p.ids], dtype=torch.long)
            t0 = time.perf_counter()
            new = generate_fn(ids, config.max_new_tokens or p.max_new_tokens, p.shared)
            dt = time.perf_counter() - t0
            text = tokenizer.decode(new[0], skip_special_tokens=True)
            samples.append({"task": task, "length": n, "tokens": len(p.ids), "depth": depth,
                            "answers": p.answers, "metric": p.metric, "output": text,
                            "score": METRICS[p.metric](text, p.answers), "seconds": round(dt, 3),
                            **request_options(generate_fn)})
            if journal is not None:
                journal.append(sid, samples[-1])
            bar.update(1)
            bar.set_postfix(score=f"{sum(s['score'] for s in samples) / len(samples):.2f}")
    bar.close()
    reused = journal.reused if journal is not None else 0
    return {"config": asdict(config), "samples": samples, "summary": summarize(samples), "resumed_samples": reused}


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean scores by task and length, by length (each task weighs the same) and overall."""
    cells: dict[str, dict[str, list[float]]] = {}
    for s in samples:
        cells.setdefault(s["task"], {}).setdefault(str(s["length"]), []).append(s["score"])
    by_task = {t: {n: sum(v) / len(v) for n, v in c.items()} for t, c in cells.items()}
    lengths = sorted({n for c in by_task.values() for n in c}, key=int)
    by_length = {n: sum(c[n] for c in by_task.values() if n in c) / sum(n in c for c in by_task.values())
                 for n in lengths}
    return {"score": sum(by_length.values()) / max(len(by_length), 1), "score_by_length": by_length,
            "score_by_task": by_task, "n": len(samples)}


def plot_heatmap(result: dict[str, Any], path: Path, title: str) -> Path:
    """Score heatmap: task (rows) x length (columns), with the mean over tasks as the last row."""
    lengths, tasks = result["config"]["lengths"], result["config"]["tasks"]
    by_task, by_length = result["summary"]["score_by_task"], result["summary"]["score_by_length"]
    data = [[by_task.get(t, {}).get(str(n), float("nan")) for n in lengths] for t in tasks]
    data.append([by_length.get(str(n), float("nan")) for n in lengths])
    fig, ax = pyplot().subplots(figsize=(2.6 + 0.9 * len(lengths), 1.0 + 0.42 * len(data)))
    im = ax.imshow(data, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [token_label(n) for n in lengths])
    ax.set_yticks(range(len(data)), [*tasks, "mean"])
    ax.set_xlabel("prompt length (tokens)")
    for i, row in enumerate(data):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.0%}", ha="center", va="center", fontsize=8)
    ax.axhline(len(tasks) - 0.5, color="black", lw=1)
    fig.colorbar(im, ax=ax, fraction=0.046)
    return save_figure(fig, path, title)


def write_result(result: dict[str, Any], out_dir: Path, stem: str = "ruler") -> tuple[Path, Path]:
    js = write_json(result, out_dir / f"{stem}.json")
    title = f"RULER — {result.get('model', '?')} — {result.get('methods_label', '')}"
    return js, plot_heatmap(result, out_dir / f"{stem}.png", title)
