"""Where fot's prefill time goes: a cProfile of one long prompt, grouped into the parts of fot's memory path.

Feeds N tokens of the shared books through ``fot`` (what a passkey sample's prompt costs) and sorts the
profile's own time into the kNN search, the joint local + memory attention of the memory layers, the model's
projections and MLPs, and the other layers' attention kernel.  The search grows with memory (every chunk's
queries against every memory key), the rest with the prompt, so two lengths show how the shares move.

    .venv/bin/python bench/fot_profile.py                        # Qwen2.5 0.5B, 8K and 16K, bf16
    .venv/bin/python bench/fot_profile.py --model gemma3-270m -o memory_layers=auto
    .venv/bin/python bench/fot_profile.py --search both         # float32 search, then candidates in bf16, per length
    .venv/bin/python bench/fot_profile.py --attention-at 052056a  # that commit's memory attention, then today's
    .venv/bin/python bench/fot_profile.py --attention-at 052056a --search-at 052056a  # its attention and search
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

import lcx
import lcx.plugins.fot.memory as memory
import lcx.plugins.fot.method as fot_method
from lcx.generation import make_plan, prefill
from lcx.io import token_counts
from lcx.session import parse_options

from books import book_tokens  # bench/books.py (scripts here run as `python bench/NAME.py`)
from loading import bench_model
from provenance import environment

OUT = Path(__file__).parent / "results" / "fot-profile.json"
# qwen_fot64's configuration (results/models): local 4K, chunk 1K, the 18 layers memory_layers=auto chose, and
# the gate auto chose there (pinned, so the profile does not include the calibration)
DEFAULT = ["local=4096", "chunk=1024", "memory_layers=3,5,6,7,9,10,11,12,13,14,15,16,17,18,19,20,21,22", "gate=1"]
# (part, the profile entries whose own time it sums: (file suffix, function name))
PARTS = [
    ("kNN search: scores (matmul)", [("memory.py", "_search"), ("memory.py", "top_inner_products")]),
    ("kNN search: topk", [("~", "<method 'topk' of 'torch._C.TensorBase' objects>")]),
    ("kNN search: query copies, gather of values", [("memory.py", "search"), ("attention.py", "_memory_scores"),
                                                    ("~", "<built-in method torch.stack>")]),
    ("memory layers: local scores (bmm, mask add; before: baddbmm)",
     [("~", "<built-in method torch.baddbmm>"), ("~", "<built-in method torch.bmm>"),
      ("~", "<method 'add_' of 'torch._C.TensorBase' objects>")]),
    ("memory layers: joint softmax (max, exp, sums, value products; before: cat, softmax)",
     [("~", "<built-in method torch.cat>"), ("~", "<method 'softmax' of 'torch._C.TensorBase' objects>"),
      ("~", "<built-in method torch.matmul>"), ("attention.py", "joint_softmax"),
      ("~", "<built-in method torch.maximum>")]
     + [("~", f"<method '{m}' of 'torch._C.TensorBase' objects>") for m in ("amax", "sub_", "exp_", "sum", "div_")]),
    ("memory layers: the rest (mask repeat, casts, loop)",
     [("attention.py", "memory_attention"), ("~", "<method 'repeat' of 'torch._C.TensorBase' objects>"),
      ("~", "<method 'float' of 'torch._C.TensorBase' objects>")]),
    ("projections and MLPs (linear)", [("~", "<built-in method torch._C._nn.linear>")]),
    ("other layers' attention (sdpa)", [("~", "<built-in method torch._C._nn.scaled_dot_product_attention>")]),
]


HALF_SEARCH = memory.top_inner_products


def float32_search(queries, keys, k, select_dtype=None):
    """The search before candidates were picked in the model's dtype: every score in float32."""
    return HALF_SEARCH(queries, keys, k)


ATTENTION = fot_method.memory_attention


def held_at(rev: str, path: str, name: str):
    """``name`` as the file ``path`` held it at git revision ``rev``, loaded beside today's (its file name keeps
    the suffix the parts match on)."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                              text=True)
        if done.returncode:
            raise SystemExit(f"fot_profile.py: git {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    rev = git("rev-parse", "--short", rev).strip()
    source = git("show", f"{rev}:{path}")
    # registered: a dataclass in the file (memory.py's StoreConfig) looks its module up in sys.modules
    module = sys.modules.setdefault(f"{Path(path).stem}_at_{rev}", types.ModuleType(f"{Path(path).stem}_at_{rev}"))
    exec(compile(source, f"{rev}/{Path(path).name}", "exec"), module.__dict__)
    if not hasattr(module, name):
        raise SystemExit(f"fot_profile.py: {path} at {rev} has no {name}")
    return getattr(module, name)


def profile(model, ids: torch.Tensor, options: dict, search: str = "dtype", attention=None, top=None) -> dict:
    """``attention``, ``top``: another ``memory_attention`` or ``top_inner_products`` to run instead of today's."""
    def run() -> None:
        memory.top_inner_products = float32_search if search == "float32" else top or HALF_SEARCH
        fot_method.memory_attention = attention or ATTENTION
        try:
            with lcx.attach(model, ["fot"], fot=options) as r:
                prefill(r, make_plan(r, ids, None, 0), include_last=True)
        finally:
            memory.top_inner_products = HALF_SEARCH
            fot_method.memory_attention = ATTENTION

    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    run()
    prof.disable()
    total = time.perf_counter() - start
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, own time, cumulative, callers)
    own: dict[tuple[str, str], float] = {}
    for (file, _, name), (_, _, tt, _, _) in stats.items():
        own[(file, name)] = own.get((file, name), 0.0) + tt
    parts = {}
    for part, entries in PARTS:
        parts[part] = sum(t for (file, name), t in own.items()
                          if any(file.endswith(f) and name == n for f, n in entries))
    parts["everything else"] = total - sum(parts.values())
    return {"tokens": ids.shape[1], "search": search, "seconds": round(total, 1),
            "attention": getattr(attention, "__module__", None) or "this checkout",
            "top_inner_products": getattr(top, "__module__", None) or "this checkout",
            "parts": {p: {"seconds": round(t, 1), "share": round(t / total, 3)} for p, t in parts.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--lengths", default="8K,16K", help="prompt lengths, each profiled alone (K suffix allowed)")
    ap.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16")
    ap.add_argument("-o", "--option", action="append", default=None, help=f"fot option KEY=VALUE (default: {DEFAULT})")
    ap.add_argument("--search", choices=["dtype", "float32", "both"], default="dtype",
                    help="dtype: the kNN search picks its candidates in the model's dtype (lcx's default); float32: "
                         "every score in float32; both: one then the other at each length, side by side")
    ap.add_argument("--attention-at", metavar="REV", default=None,
                    help="also profile fot's memory attention as git revision REV held it, before today's, at each "
                         "length (side by side, in one process)")
    ap.add_argument("--search-at", metavar="REV", default=None,
                    help="the same for the kNN search's top inner products (with --attention-at: both as REV held "
                         "them in the first profile)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    held = (args.attention_at, args.search_at)
    if any(held) and args.search == "both":
        ap.error("--attention-at/--search-at and --search both each run two profiles a length: give one of them")
    if args.search_at and args.search == "float32":
        ap.error("--search-at swaps the search that picks candidates in the model's dtype: drop --search float32")
    before = (held_at(args.attention_at, "plugins/fot/attention.py", "memory_attention") if args.attention_at
              else None,
              held_at(args.search_at, "plugins/fot/memory.py", "top_inner_products") if args.search_at else None)
    options = parse_options(args.option or DEFAULT)
    model, tok = bench_model(args.model, None, False, args.dtype)
    lengths = token_counts(args.lengths)
    ids = book_tokens(tok, max(lengths))
    profile(model, ids[:, :2048], options)  # warm-up (first calls, allocator), not reported
    runs = []
    for n in lengths:
        for search, code in ([("float32", (None, None)), ("dtype", (None, None))] if args.search == "both" else
                             [(args.search, before)] * any(held) + [(args.search, (None, None))]):
            runs.append(profile(model, ids[:, :n], options, search, *code))
            print(f"{n} tokens, search {search}, attention {runs[-1]['attention']}, top inner products "
                  f"{runs[-1]['top_inner_products']}: {runs[-1]['seconds']} s")
            for p, v in runs[-1]["parts"].items():
                print(f"  {v['share']:6.1%} {v['seconds']:8.1f} s  {p}")
    result = {"benchmark": "where fot's prefill time goes (cProfile own time)", "model": args.model,
              "dtype": args.dtype, "fot_options": options, **environment(), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
