"""vanilla: the model as it is, with the input truncated to its window.

The comparison point for every method: it keeps the start and the end of the
prompt (where instructions and the question usually are) and drops the middle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lcx.errors import LcxError
from lcx.hookspecs import hookimpl
from lcx.method import Method, option
from lcx.plan import Plan, left_pad, unpad


@dataclass
class Vanilla(Method):
    name = "vanilla"
    description = "truncate the middle of the prompt to fit the model's window (baseline)"

    head_fraction: float = option(0.5, "share of the token budget kept from the start of the prompt; the rest is its end")
    window: int = option(0, "token budget incl. generated tokens; 0 = the model's trained window")

    def __post_init__(self) -> None:
        if not 0.0 <= self.head_fraction <= 1.0:
            raise ValueError(f"head_fraction must be in [0, 1], got {self.head_fraction}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0 (0 = model window), got {self.window}")

    #: vLLM serves it as the plain model behind a request middleware that truncates the prompt.
    serving = "prompt"

    def resolved(self, config: dict) -> dict:
        from lcx.adapters import families

        return {"window": self.window or families.json_window(config)}

    def budget(self, max_new_tokens: int, window: int) -> int:
        """Prompt tokens kept: the window (this method's, else the model's) less the tokens to generate."""
        budget = (self.window or window) - max_new_tokens
        if budget <= 0:
            raise LcxError(f"max_new_tokens={max_new_tokens} leaves no room in a window of {self.window or window} "
                           f"(vanilla keeps that window less the new tokens of the prompt); ask for fewer new tokens"
                           + ("" if self.window else " or set a larger -o vanilla.window"))
        return budget

    def keep(self, n: int, budget: int) -> tuple[int, int]:
        """For a prompt of ``n`` tokens: (tokens kept from its start, index where its kept end begins)."""
        if n <= budget:
            return n, n
        head = int(budget * self.head_fraction)
        return head, n - (budget - head)

    def reach(self, run, tokens: int, new: int, span: tuple[int, int]) -> tuple[bool, str]:
        budget = self.budget(new, self.window or run.window)
        if tokens <= budget:
            return True, f"all {tokens:,} tokens fit its {budget:,}-token budget"
        head, tail = self.keep(tokens, budget)
        kept = span[1] <= head or span[0] >= tail
        return kept, (f"keeps the first {head:,} and the last {tokens - tail:,} tokens: the key was "
                      + ("kept" if kept else "cut with the middle of the prompt"))

    def serve_prompt(self, ids: list[int], max_new_tokens: int, window: int) -> list[int]:
        head, tail = self.keep(len(ids), self.budget(max_new_tokens, window))
        return ids[:head] + ids[tail:]

    @hookimpl
    def lcx_plan(self, run, input_ids, attention_mask, max_new_tokens):
        budget = self.budget(max_new_tokens, self.window or run.window)  # the model's window only when needed
        rows, dropped = [], 0
        for row in unpad(input_ids, attention_mask):
            if row.numel() > budget:
                head, tail = self.keep(row.numel(), budget)
                dropped = max(dropped, row.numel() - budget)
                row = torch.cat([row[:head], row[tail:]])
            rows.append(row)
        if not dropped:
            return Plan.whole(input_ids, attention_mask)
        pad = int(input_ids[attention_mask == 0][0]) if (attention_mask == 0).any() else 0
        ids, mask = left_pad(rows, pad)
        return Plan.whole(ids, mask, dropped=dropped)


@hookimpl
def lcx_register_methods(register):
    register(Vanilla)
