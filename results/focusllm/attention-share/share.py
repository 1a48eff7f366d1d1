"""Where focusllm's local tokens look: the attention mass that the prompt's last queries (the question,
"What is the pass key? The pass key is") put on the candidates, on the candidate of the chunk holding the
needle, and on the needle itself when it lies among the local tokens — with the base projections
(training-free) and with the trained candidate adapter (results/focusllm/adapter), on the same prompts.

    .venv/bin/python results/focusllm/attention-share/share.py   # -> share.json beside it (~20 min, 1 core)
    .venv/bin/python results/focusllm/attention-share/share.py --adapter results/focusllm/adapter-fresh \
        --out results/focusllm/attention-share/share-fresh.json          # another trained adapter

A probe method attached after focusllm records, in every layer's attention of the local window's forward
(queries: the window's tokens; keys: [candidates ; local tokens], contiguous positions), the softmax of
the last QUERIES queries over all keys (causal); attention itself is computed unchanged.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from lcx.adapters.peft_bridge import load_adapter
from lcx.composition import attach
from lcx.evals.passkey import NEEDLE, prompt_and_needle
from lcx.generation import generate
from lcx.hookspecs import hookimpl
from lcx.method import Method
from lcx.models import load_model

HERE = Path(__file__).resolve().parent
ADAPTER = HERE.parent / "adapter"
MODEL = "smollm2-135m"
CASES = [(16384, d, k) for d, k in ((0.1, 41237), (0.5, 58112), (0.9, 73905))] + [(32768, 0.5, 26641)]
QUERIES = 16


@dataclass
class CandidateShare(Method):
    """Not a registered method: attention mass of the last queries on [candidates ; local] key groups."""

    name = "candidate-share"
    description = "records where the local window's last queries attend; attention unchanged"

    def __post_init__(self) -> None:
        self.case: dict | None = None
        self.layers: dict[int, dict[str, float]] = {}

    @hookimpl
    def lcx_attention(self, run, module, query, key, value, attention_mask, kwargs):
        B, H, T, D = query.shape
        S = key.shape[-2]
        c = self.case
        if c is None or T < QUERIES or S - T != c["n"]:  # only the local window over its candidates
            return None
        k = key.repeat_interleave(H // key.shape[1], dim=1).float()
        q = query[:, :, -QUERIES:].float()
        scores = (q @ k.transpose(-1, -2)) * (kwargs.get("scaling") or D ** -0.5)  # (B, H, Q, S)
        q_pos = torch.arange(S - QUERIES, S)
        scores = scores.masked_fill(torch.arange(S)[None, :] > q_pos[:, None], float("-inf"))
        p = scores.softmax(-1).mean(dim=(0, 1, 2))  # (S,) mean over heads and queries
        rec = {"candidates": float(p[:c["n"]].sum())}
        if c["chunk"] is not None:
            rec["needle_candidate"] = float(p[c["chunk"]])
            rec["mean_other_candidate"] = float((p[:c["n"]].sum() - p[c["chunk"]]) / max(c["n"] - 1, 1))
        if c["local_needle"] is not None:
            a, b = c["local_needle"]
            rec["needle_tokens_local"] = float(p[c["n"] + a:c["n"] + b].sum())
        self.layers[module.layer_idx] = rec
        return None


def _shown(path: Path) -> str:
    """The adapter's path from the repository root when it is inside it."""
    try:
        return str(path.resolve().relative_to(HERE.parents[2]))
    except ValueError:
        return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", type=Path, default=ADAPTER, help="the trained candidate adapter (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=HERE / "share.json", help="JSON output (default: %(default)s)")
    args = ap.parse_args()
    out = {"queries": QUERIES, "model": MODEL, "adapter": _shown(args.adapter), "runs": {}}
    for label, adapter in (("base projections", None), ("trained adapter", args.adapter)):
        model, tok = load_model(MODEL)
        if adapter is not None:
            model, _ = load_adapter(model, adapter)
        probe = CandidateShare()
        rows = []
        with attach(model, ["focusllm", probe], focusllm={"chunk": 2048}) as run, torch.no_grad():  # as share.json ran
            f = run.method("focusllm")
            for length, depth, key in CASES:
                ids, start = prompt_and_needle(tok, length, depth, key)
                n_needle = len(tok(" " + NEEDLE.format(key=key) + " ", add_special_tokens=False)["input_ids"])
                memory = len(ids) - f.local
                n = -(-memory // f.chunk)
                probe.case = {"n": n, "chunk": start // f.chunk if start < memory else None,
                              "local_needle": (start - memory, start - memory + n_needle) if start >= memory else None}
                probe.layers = {}
                answer = tok.decode(generate(run, ids[None], max_new_tokens=8, do_sample=False)[0])  # the new tokens
                layers = dict(sorted(probe.layers.items()))
                mean = {k: sum(r[k] for r in layers.values()) / len(layers) for k in next(iter(layers.values()))}
                rows.append({"tokens": len(ids), "depth": depth, "key": key, "candidates": n,
                             "needle_chunk": probe.case["chunk"], "answer": answer, "found": str(key) in answer,
                             "mean_over_layers": mean, "by_layer": layers})
                print(label, length, depth, n, answer.replace("\n", " "), {k: round(v, 4) for k, v in mean.items()},
                      file=sys.stderr, flush=True)
                probe.case = None
        out["runs"][label] = rows
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
