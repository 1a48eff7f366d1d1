"""Two ways to read one prompt, timed side by side: the shared loop of the A/B benchmarks (mask_slices, sliding_layers).

Each variant is a context manager factory that sets its way up (patches a module attribute, say) and undoes it on
exit; rounds alternate which variant goes first, so warm-up and drift fall on both.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable, ContextManager

import torch

import lcx
from lcx.generation import generate
from lcx.models import dtype_name
from provenance import environment

Variant = Callable[[], ContextManager[object]]


def timed_generate(model, methods: list[str], options: dict, ids: torch.Tensor, new: int) -> tuple[float, list[int]]:
    """Seconds for the prefill and `new` tokens of `ids` under `methods`, and the tokens."""
    with lcx.attach(model, methods, **options) as run:
        t = time.perf_counter()
        out = generate(run, ids, max_new_tokens=new, progress=False)
        return time.perf_counter() - t, out[0].tolist()


def alternate(variants: dict[str, Variant], run: Callable[[], tuple[float, list[int]]], rounds: int,
              label: Callable[[str], str] = str) -> tuple[dict[str, list[float]], dict[str, list[int]], list[float]]:
    """Runs `run` under each of the two `variants` once a round, the first to go flipping every round.

    Returns each variant's seconds, each one's last tokens, and per round the second variant's time over the first's
    (so > 1 means the first is faster).
    """
    if len(variants) != 2:
        raise ValueError(f"alternate compares two variants, got {len(variants)}: {sorted(variants)}")
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    answers: dict[str, list[int]] = {}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            with variants[name]():
                s, answers[name] = run()
            times[name].append(s)
            print(f"round {r + 1}: {label(name)}: {s:.1f} s", flush=True)
    ratios = [b / a for a, b in zip(times[names[0]], times[names[1]])]
    return times, answers, ratios


@contextlib.contextmanager
def patched(modules, name: str, value):
    """`name` set to `value` on each of `modules`, restored on exit."""
    old = [getattr(m, name) for m in modules]
    for m in modules:
        setattr(m, name, value)
    try:
        yield
    finally:
        for m, v in zip(modules, old):
            setattr(m, name, v)


def record(benchmark: str, model_name: str, model, tokens: int, new: int, options: dict,
           times: dict[str, list[float]], ratios: list[float], **extra) -> dict:
    """The JSON a side-by-side benchmark writes: what ran, where, and its figures."""
    return {"benchmark": benchmark, **environment(),
            "model": model_name, "dtype": dtype_name(model.dtype), "tokens": tokens, "new_tokens": new,
            "options": options, **extra, "seconds": times, "speedup_per_round": ratios,
            "speedup_median": statistics.median(ratios)}
