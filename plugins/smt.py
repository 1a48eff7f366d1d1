"""smt: Sparse Memory Training ("Sparse Training: Do All Tokens Matter for Long Sequence Generalization?").

Training only; the model is unchanged.  Each training window of ``seq_len`` tokens (the long
sequence) is split into a *memory* part and a *target* part (the last ``target`` tokens).  From the
memory, ``budget - target`` tokens are sampled with a distance-decaying policy and fed, in order and
with their ORIGINAL position ids, before the target; the next-token loss is taken on the target only.
A step therefore costs a forward over ``budget`` tokens whatever ``seq_len`` is, while the model sees
(and learns) positions and dependencies up to ``seq_len``.  Mixed training adds ``beta`` x the
ordinary loss on a contiguous window of ``budget`` tokens (positions from 0), against forgetting.

The decaying policy (our statement of the paper's Algorithm 1; the paper's appendix table was not
available to us, so this module defines the rule and the tests check it, not the paper's numbers):
distances are counted back from the target; window 0 holds the nearest ``window`` (W) memory tokens,
window i >= 1 the next W * 2^i; after ``decay_iters`` (T) windows, the last one takes the rest of
the memory.  Token density halves twice per window (window i: 4^-i, the last window keeps 4^-(T-1)),
so each full window gets half the share of the one before (W: 1/2, 2W: 1/4, 4W: 1/8 ...) and the
probability of a token never rises with distance and is never zero.  Counts are the budget split in
proportion to (tokens x density), a window never taking more tokens than it holds (water-filling:
the excess goes to the other windows in the same proportions); fractional counts are rounded at
random with the right expectation (systematic sampling), so a far window whose share is below one
token still gets it that often; within a window the tokens are drawn uniformly without replacement.  A memory of at most W tokens, or
``policy=uniform``, is sampled uniformly; a memory no longer than the sample is taken whole.

Trainable state: q/k projections, as LoRA (default; what vLLM serves) or whole with
``lcx train --full q_proj,k_proj`` (PEFT's modules_to_save; HF path only, vLLM's LoRA loader refuses it).
``grow_every``/``grow_by`` extend the position
range progressively (the paper: +2K every 1000 steps), a pure function of the step, so resume is exact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

import torch

from lcx.errors import LcxError
from lcx.hookspecs import hookimpl
from lcx.method import Method, option


# ---------------------------------------------------------------------- the sampling policy
def windows(memory: int, window: int, decay_iters: int) -> list[tuple[int, int]]:
    """Distance ranges ``[lo, hi)`` (counted back from the target, 0 = the nearest memory token) of
    the decaying windows for a memory of ``memory`` tokens: W, 2W, 4W, ... and, after ``decay_iters``
    windows, the rest.  Only non-empty windows are returned."""
    if window <= 0:
        raise LcxError(f"smt window (W) must be > 0, got {window}")
    if decay_iters < 1:
        raise LcxError(f"smt decay_iters (T) must be >= 1, got {decay_iters}; for uniform sampling use policy=uniform")
    out, lo, size = [], 0, window
    for i in range(decay_iters):
        hi = memory if i == decay_iters - 1 else min(memory, lo + size)
        if hi > lo:
            out.append((lo, hi))
        lo, size = hi, size * 2
        if lo >= memory:
            break
    return out


def allocate(memory: int, budget: int, window: int, decay_iters: int) -> list[tuple[int, int, float]]:
    """Expected sampled tokens per window: ``[(lo, hi, count), ...]`` with fractional counts summing
    to ``min(budget, memory)`` (see the module docstring for the rule)."""
    if budget < 0 or memory < 0:
        raise LcxError(f"smt: memory and budget must be >= 0 (got memory={memory}, budget={budget})")
    spans = windows(memory, window, decay_iters) if memory > 0 else []
    size = [hi - lo for lo, hi in spans]
    if budget >= memory:
        return [(lo, hi, float(n)) for (lo, hi), n in zip(spans, size)]
    weights = [n * 4.0 ** -i for i, n in enumerate(size)]  # tokens x density; the last window keeps its density
    counts = [0.0] * len(spans)
    free, left = set(range(len(spans))), float(budget)
    while free:  # water-filling: a window whose share exceeds its size is taken whole
        total = sum(weights[i] for i in free)
        share = {i: left * weights[i] / total for i in free}
        full = {i for i in free if share[i] >= size[i]}
        if not full:
            for i in free:
                counts[i] = share[i]
            break
        for i in full:
            counts[i] = float(size[i])
            left -= size[i]
        free -= full
    return [(lo, hi, c) for (lo, hi), c in zip(spans, counts)]


def _round(counts: list[float], gen: torch.Generator) -> list[int]:
    """Integer counts with the same sum whose expectations are exactly ``counts`` (systematic sampling
    of the fractional parts), so a window with a share below one token still has its probability."""
    whole = [int(c) for c in counts]
    frac = [c - w for c, w in zip(counts, whole)]
    extra = round(sum(frac))
    if extra:
        u = float(torch.rand((), generator=gen))
        edges = torch.tensor(frac, dtype=torch.float64).cumsum(0)
        for k in range(extra):  # window i is picked iff a point u + k falls in its slice of [0, extra)
            i = int(torch.searchsorted(edges, torch.tensor(u + k, dtype=torch.float64), right=True))
            whole[min(i, len(whole) - 1)] += 1
    return whole


def sample_memory(memory: int, budget: int, window: int, decay_iters: int, policy: str,
                  gen: torch.Generator) -> torch.Tensor:
    """Indices (ascending, into the memory part ``0..memory-1``) of the sampled memory tokens."""
    if budget >= memory:
        return torch.arange(memory)
    if policy == "uniform":
        return torch.randperm(memory, generator=gen)[:budget].sort().values
    spans = allocate(memory, budget, window, decay_iters)
    picked = []
    for (lo, hi, _), count in zip(spans, _round([c for _, _, c in spans], gen)):
        if count:
            dist = lo + torch.randperm(hi - lo, generator=gen)[:count]
            picked.append(memory - 1 - dist)  # distance 0 = the last memory token
    return torch.cat(picked).sort().values if picked else torch.zeros(0, dtype=torch.long)


def position_range(step: int, seq_len: int, start: int, grow_every: int, grow_by: int) -> int:
    """Tokens of the training window in use at ``step`` (progressive extension; all of it if not growing)."""
    if grow_every <= 0:
        return seq_len
    return min(seq_len, start + grow_by * (step // grow_every))


# ---------------------------------------------------------------------- the method
@dataclass
class SMT(Method):
    name = "smt"
    description = "Sparse Memory Training: sampled far tokens at their original positions, constant step cost"
    # tokens keep their original positions, beyond the trained window: relative (rotary) positions only; an
    # absolute position table (gpt2's) has no row for them
    requires = frozenset({"rotary"})
    lora_roles = ("q", "k")
    serving = "base"  # training-only: inference is the model plus the q/k LoRA adapter

    budget: int = option(4096, "tokens fed per training row (sampled memory + target); at most the model's window")
    target: int = option(0, "target tokens (the end of the window, where the loss is); 0 = budget // 2")
    window: int = option(1024, "W: the nearest memory window of the decaying policy")
    decay_iters: int = option(4, "T: decaying windows (W, 2W, 4W ...) before the last one takes the rest")
    policy: Literal["decay", "uniform"] = option("decay", "memory sampling: decay (Algorithm 1) or uniform (ablation)")
    beta: float = option(1.0, "weight of the ordinary next-token loss on a contiguous window (0 = SMT loss only)")
    grow_every: int = option(0, "progressive extension: widen the position range every N steps (0 = whole window from the start)")
    grow_by: int = option(2048, "progressive extension: tokens added to the range each time")
    start: int = option(0, "progressive extension: initial range in tokens (0 = the model's window)")

    def __post_init__(self) -> None:
        if self.budget < 2:
            raise ValueError(f"budget must be >= 2, got {self.budget}")
        if not 0 <= self.target < self.budget:
            raise ValueError(f"target must be in 0..budget-1 (budget={self.budget}), got {self.target}")
        if self.window <= 0:
            raise ValueError(f"window (W) must be > 0, got {self.window}")
        if self.decay_iters < 1:
            raise ValueError(f"decay_iters (T) must be >= 1, got {self.decay_iters} (T=0 would leave no window; "
                             "use policy=uniform for uniform sampling)")
        if self.policy not in ("decay", "uniform"):
            raise ValueError(f"policy must be decay or uniform, got {self.policy!r}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.grow_every < 0 or self.grow_by <= 0 or self.start < 0:
            raise ValueError(f"grow_every >= 0, grow_by > 0 and start >= 0 required (got {self.grow_every}, "
                             f"{self.grow_by}, {self.start})")

    @property
    def target_tokens(self) -> int:
        return self.target or self.budget // 2

    def check_fits(self, run, seq_len: int) -> None:
        if self.budget > run.window:
            raise LcxError(f"smt budget={self.budget} tokens per row exceeds the model's window ({run.window}); "
                           f"use -o smt.budget={run.window} or less")
        if seq_len < self.target_tokens + 1:
            raise LcxError(f"training windows of {seq_len} tokens leave no memory before smt's target of "
                           f"{self.target_tokens} tokens; raise --seq-len or lower -o smt.target")
        first = position_range(0, seq_len, self.start or run.window, self.grow_every, self.grow_by)
        if first < self.target_tokens + 1:  # progressive extension: the range only grows from here
            raise LcxError(f"progressive extension starts with {first} tokens (smt.start), which leave no memory "
                           f"before smt's target of {self.target_tokens} tokens; raise -o smt.start or lower "
                           f"-o smt.target")

    # ------------------------------------------------------------------ sampling stage
    @hookimpl
    def lcx_sample(self, run, batch, step):
        ids = batch["input_ids"]
        B, N = ids.shape
        self.check_fits(run, N)
        R = position_range(step, N, self.start or run.window, self.grow_every, self.grow_by)
        ids = ids[:, N - R:]  # the range in use: the window's last R tokens, positions 0..R-1
        target = self.target_tokens
        memory = R - target
        rng = random.Random(f"smt:{run.seed}:{step}:{run.rank}")
        gen = torch.Generator().manual_seed(rng.getrandbits(63))
        rows = []
        for _ in range(B):
            picked = sample_memory(memory, self.budget - target, self.window, self.decay_iters, self.policy, gen)
            rows.append(torch.cat([picked, torch.arange(memory, R)]))
        pos = torch.stack(rows).to(ids.device)  # the batch's device: a caller may sample after moving it
        sampled = ids.gather(1, pos)
        labels = sampled.clone()
        # The loss only on the target, and not on its first token: that one would be predicted from
        # whichever memory token was sampled last, not from its neighbour.
        labels[:, : pos.shape[1] - target + 1] = -100
        out = {"input_ids": sampled, "position_ids": pos, "attention_mask": torch.ones_like(sampled),
               "labels": labels, "smt_range": R}
        if self.beta > 0:  # an ordinary window: the last `budget` tokens, positions from 0
            plain = ids[:, R - min(self.budget, R):]
            out["smt_plain"] = plain
        return out

    # ------------------------------------------------------------------ loss stage
    @hookimpl
    def lcx_loss(self, run, model, batch):
        if "smt_range" not in batch:
            return None
        ids = batch["input_ids"]
        # (no cache in training: transformers then reads position jumps as packed sequences unless a mask is given)
        terms = {"smt": model(input_ids=ids, position_ids=batch["position_ids"], attention_mask=batch["attention_mask"],
                              labels=batch["labels"], use_cache=False).loss}
        if self.beta > 0:
            plain = batch["smt_plain"]
            terms["lm"] = self.beta * model(input_ids=plain, attention_mask=torch.ones_like(plain), labels=plain,
                                            use_cache=False).loss
        return terms


@hookimpl
def lcx_register_methods(register):
    register(SMT)
