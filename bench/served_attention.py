"""lcx's served attention (what vLLM's worker calls per layer for streaming and fot) on its own: the time of
one decode step of R concurrent requests, at SmolLM2-135M's attention shapes, without vLLM or the rest of
the model.  This is the part of a served decode step that lcx owns; `bench/serve_throughput.py` measures
the whole server.

Each request is prefilled with a ``--prompt``-token prompt in ``--chunk``-token pieces (random q/k/v: the
cost does not depend on the values), then ``--steps`` decode steps of one token per request are timed.
The random inputs' own cost is measured apart and subtracted.

    .venv/bin/python bench/served_attention.py [--method fot,fot-sinks,streaming] [--requests 8] [--prompt 2048]
        [--threads 1] [--dtype float32] [--half-search half_pays,never] [--reads lcx,rows,gqa]
        [--out bench/results/served_attention.json]

``--dtype bfloat16``: q/k/v in bf16, as a bf16 served model hands them; ``--half-search half_pays,never``: each
method once per rule for fot's memory search's candidates (``half_pays``: lcx's rule, in bf16 where it pays; ``never``:
float32 throughout), side by side; ``--reads lcx,rows,gqa``: each method once per way a prompt piece is read,
side by side (``lcx``: ``sdpa``'s rule; ``rows``: every piece as G x n rows of its KV head under the mask repeated
per query head; ``gqa``: a piece of 16 queries or more through SDPA's own GQA under one mask, fewer as rows, as
lcx read them from bb0ea1a until ``GQA_ROWS``; each in blocks of queries).

fot runs in its passkey configuration (local 1024, chunk 256, 12 memory layers: results/README.md), fot-sinks
the same with 4 sinks, fot-defaults at fot's defaults (the local window at the model's, 4 sinks, memory keys at
distance 4096, gate -1) with the same 12 memory layers: give it a prompt past the 8K window (--prompt 10240) or
it reads no memory;
streaming with 4 sinks and the recent window SmolLM2's 8K window leaves (7,676 tokens).
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from unittest import mock

import torch

from provenance import write_results  # bench/provenance.py (scripts here run as `python bench/NAME.py`)

OUT = Path(__file__).parent / "results"
LAYERS, HEADS, KV_HEADS, HEAD_DIM, WINDOW = 30, 9, 3, 64, 8192  # SmolLM2-135M
FOT = dict(local=1024, chunk=256, memory_layers="6,7,8,14,15,17,18,19,20,21,22,23",
           # fot's defaults before issue 52 (served_attention*.json were measured with them; sinks: served())
           positions="first", fixed_distance=0, gate="off")


def served(method: str):
    from lcx.plugins.fot.served import FoTServed
    from lcx.plugins.streaming.served import StreamingServed
    from lcx.registry import registry

    if method in ("fot", "fot-sinks"):  # fot-sinks: the same with the prompt's first 4 tokens kept as sinks
        return FoTServed(registry().get("fot").from_options(**FOT, sinks=4 * (method == "fot-sinks"))), FOT["chunk"]
    if method == "fot-defaults":
        m = registry().get("fot").from_options(memory_layers=FOT["memory_layers"], local=WINDOW)
        return FoTServed(m), m.chunk
    if method != "streaming":
        raise SystemExit(f"--method {method!r}: give fot, fot-sinks, fot-defaults or streaming")
    m = registry().get("streaming").from_options(sinks=4)
    return StreamingServed(m.sinks, m.recent_for(WINDOW), m.chunk), m.chunk


def bb0ea1a_sdpa(q, keys, values, allowed, scale):
    """``sdpa`` as lcx read a piece from bb0ea1a until ``GQA_ROWS``: 16 queries or more by GQA, fewer as rows."""
    from lcx.integrations.vllm.attention import gqa_sdpa, rows_sdpa

    return (rows_sdpa if allowed is None or q.shape[1] < 16 else gqa_sdpa)(q, keys, values, allowed, scale)


def run(method: str, requests: int, prompt: int, steps: int, dtype: torch.dtype = torch.float32,
        half: str = "half_pays", reads: str = "lcx") -> dict:
    import lcx.integrations.vllm.attention as served_attention
    import lcx.plugins.fot.served as fot_served
    import lcx.plugins.streaming.served as streaming_served
    from lcx.plugins.fot import memory

    rule = {"half_pays": memory.half_pays, "never": lambda queries, keys: False}[half]
    read = {"lcx": served_attention.sdpa, "rows": served_attention.rows_sdpa, "gqa": bb0ea1a_sdpa}[reads]
    with mock.patch.object(fot_served, "top_inner_products", functools.partial(memory.top_inner_products, pays=rule)), \
            mock.patch.object(fot_served, "sdpa", read), mock.patch.object(streaming_served, "sdpa", read):
        return {**_run(method, requests, prompt, steps, dtype, half), "reads": reads}


def _run(method: str, requests: int, prompt: int, steps: int, dtype: torch.dtype, half: str) -> dict:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    from lcx.integrations.vllm.attention import Seq

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                      head_dim=HEAD_DIM, num_hidden_layers=LAYERS, intermediate_size=1536, vocab_size=100,
                      max_position_embeddings=WINDOW, rope_theta=100000)
    mods = [LlamaAttention(cfg, i) for i in range(LAYERS)]
    srv, chunk = served(method)
    rand = lambda *shape: torch.randn(*shape, dtype=dtype)  # noqa: E731

    def step(seqs: list) -> None:
        srv.begin_step()
        n = sum(s.length for s in seqs)
        for mod in mods:
            q, k, v = rand(1, HEADS, n, HEAD_DIM), rand(1, KV_HEADS, n, HEAD_DIM), rand(1, KV_HEADS, n, HEAD_DIM)
            srv.attend(mod, q, k, v, seqs)

    t = time.perf_counter()
    for start in range(0, prompt, chunk):
        step([Seq(key=r, start=start, length=min(chunk, prompt - start), prompt=prompt) for r in range(requests)])
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(steps):
        step([Seq(key=r, start=prompt + i, length=1, prompt=prompt) for r in range(requests)])
    decode = (time.perf_counter() - t) / steps
    t = time.perf_counter()
    for _ in range(steps):
        for _ in mods:
            rand(1, HEADS, requests, HEAD_DIM), rand(1, KV_HEADS, requests, HEAD_DIM), rand(1, KV_HEADS, requests, HEAD_DIM)
    inputs = (time.perf_counter() - t) / steps
    return {"method": method, "dtype": str(dtype).removeprefix("torch."), "half_search": half,
            "requests": requests, "prompt": prompt, "steps": steps,
            "prefill_s": round(prefill, 2), "decode_step_ms": round(1000 * (decode - inputs), 1),
            "decode_ms_per_request_layer": round(1000 * (decode - inputs) / (requests * LAYERS), 3)}


def listed(flag: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    """A comma-separated option's items, each one of ``allowed`` (repeats kept: they run again, alternating)."""
    items = [v.strip() for v in value.split(",")]
    if not set(items) <= set(allowed):
        raise SystemExit(f"{flag} {value!r}: give one or more of {', '.join(allowed)} (comma-separated)")
    return items


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="fot,streaming", help="comma-separated: fot, fot-sinks, fot-defaults, streaming")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="q/k/v's dtype")
    ap.add_argument("--half-search", default="half_pays",
                    help="comma-separated rules for fot's memory search, each method run once per rule: half_pays, never")
    ap.add_argument("--reads", default="lcx",
                    help="comma-separated ways to read a prompt piece, each method run once per way: lcx, rows, gqa")
    ap.add_argument("--out", type=Path, default=OUT / "served_attention.json")
    args = ap.parse_args()
    rules = listed("--half-search", args.half_search, ("half_pays", "never"))
    if len(rules) > 1 and args.dtype != "bfloat16":
        raise SystemExit("--half-search compares rules for a half-precision search: add --dtype bfloat16")
    reads = listed("--reads", args.reads, ("lcx", "rows", "gqa"))
    torch.set_num_threads(args.threads)
    rows = []
    methods = [m.strip() for m in args.method.split(",")]
    for method, half, way in [(m, h, r) for m in methods for h in rules for r in reads]:
        rows.append(run(method, args.requests, args.prompt, args.steps, getattr(torch, args.dtype), half, way))
        r = rows[-1]
        print(f"{r['method']} ({r['dtype']}, search {r['half_search']}, reads {r['reads']}): "
              f"{r['requests']} requests x {r['prompt']} prompt tokens: prefill {r['prefill_s']} s, "
              f"decode step {r['decode_step_ms']} ms ({r['decode_ms_per_request_layer']} ms per request and layer)",
              flush=True)
    write_results(args, rows)


if __name__ == "__main__":
    main()
