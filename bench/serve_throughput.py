"""Generated tokens/s for concurrent passkey requests: `lcx serve` (vLLM) vs `lcx generate` (HF).

One run, same prompts, same method/adapter, greedy, every request forced to the same number of new
tokens (vLLM ``min_tokens``; HF ``min_new_tokens``) so both sides generate exactly ``--new`` tokens:

* vllm: the requests are sent at once to a running `lcx serve` (engine start excluded);
* hf: what `lcx generate` does, one request after another in one process (model load excluded).

Rounds alternate the two sides; the ratio is per round.  Goal (issue 8): vllm / hf >= 3.

    .venv/bin/python bench/serve_throughput.py [--requests 8] [--length 2048] [--new 64,256] [--adapter DIR]
    .venv/bin/python bench/serve_throughput.py --method fot -o fot.local=512 --length 4096   # a memory method
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from provenance import environment  # bench/provenance.py (scripts here run as `python bench/NAME.py`)

OUT = Path(__file__).parent / "results"
# fot's defaults before issue 52, under any -o when fot is served (serve_throughput-fot*.json were measured with them)
FOT_BEFORE = ["fot.local=2048", "fot.chunk=0", "fot.sinks=0", "fot.positions=first", "fot.fixed_distance=0",
              "fot.gate=off"]


def prompts(tok, n: int, length: int, seed: int, unshared: bool = False) -> list[tuple[list[int], int]]:
    """``n`` passkey prompts, each its own key and depth.  They share the instruction and the filler before
    each needle (vLLM's prefix cache computes that once); ``unshared``: each starts with its own line, so no
    two share a KV block."""
    from lcx.evals.passkey import build_prompt_ids

    rng = random.Random(seed)
    out = []
    for k in rng.sample(range(10000, 99999), n):
        ids = build_prompt_ids(tok, length, rng.random(), k).tolist()
        if unshared:
            at = int(tok.bos_token_id is not None and ids[:1] == [tok.bos_token_id])
            ids[at:at] = tok(f"Document {k}.\n", add_special_tokens=False)["input_ids"]
        out.append((ids, k))
    return out


def run_vllm(server, name: str, batch: list[tuple[list[int], int]], new: int) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(batch)) as pool:
        outs = list(pool.map(lambda p: server.complete(name, p[0], new, min_tokens=new, ignore_eos=True), batch))
    return time.perf_counter() - t0, outs


def run_hf(session, batch: list[tuple[list[int], int]], new: int) -> tuple[float, list[list[int]]]:
    from lcx.generation import generate

    t0 = time.perf_counter()
    outs = [generate(session.run, torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False)[0].tolist()
            for ids, _ in batch]
    return time.perf_counter() - t0, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--adapter", default=None, help="an lcx LoRA adapter (e.g. results/smt/adapter) on both sides")
    ap.add_argument("--method", action="append", default=[], help="servable method on both sides (e.g. rope, fot)")
    ap.add_argument("--option", "-o", action="append", default=[], metavar="METHOD.KEY=VALUE",
                    help="method option on both sides, e.g. -o fot.local=512")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--length", type=int, default=2048, help="prompt tokens per request")
    ap.add_argument("--new", default="64,256", help="generated tokens per request; several: one result each")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--unshared", action="store_true",
                    help="each prompt starts with its own line: no request shares a KV block with another "
                         "(by default the 8 prompts share the instruction and the filler before each needle)")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: bench/results/serve_throughput[-METHODS].json")
    args = ap.parse_args()
    if "fot" in args.method:
        args.option = [*FOT_BEFORE, *args.option]
    from lcx.evals.passkey import passkey_found
    from lcx.integrations.vllm import ServerProcess
    from lcx.session import open_session, parse_options

    news = [int(x) for x in str(args.new).split(",")]
    out = args.out or OUT / ("serve_throughput" + "".join(f"-{m}" for m in args.method) + ".json")
    session = open_session(args.model, args.method, parse_options(tuple(args.option)), args.adapter)
    tok = session.tokenizer
    serve_args = [f"--method={m}" for m in args.method] + [x for o in args.option for x in ("-o", o)]
    serve_args += ["--max-model-len", str(args.length + max(news) + 64)]
    name = args.model
    if args.adapter:
        serve_args.append(f"--adapter=bench={args.adapter}")
        name = "bench"
    results = []
    with tempfile.TemporaryDirectory() as tmp, \
            ServerProcess(args.model, serve_args + ["--export-dir", f"{tmp}/export"], f"{tmp}/serve.log") as server:
        print(f"server ready in {server.ready['start_seconds']} s", flush=True)
        # warm-up at the measured shape (first LoRA load, the allocator, oneDNN's kernels for long prefill
        # chunks, the served attention's buffers), on both sides; prompts that share no block with the measured
        # ones (--unshared's own first line), so vLLM's prefix cache holds nothing of them afterwards
        warm = prompts(tok, args.requests, args.length, seed=999, unshared=True)
        run_vllm(server, name, warm, 4)
        run_hf(session, warm[:1], 4)
        for i, new in enumerate(news):
            rounds = []
            for r in range(args.rounds):
                # fresh prompts every round: vLLM's prefix cache must not remember a whole earlier prompt
                batch = prompts(tok, args.requests, args.length, seed=1000 * i + r, unshared=args.unshared)
                order = ["vllm", "hf"] if r % 2 == 0 else ["hf", "vllm"]
                row: dict = {"round": r}
                for side in order:
                    dt, outs = run_vllm(server, name, batch, new) if side == "vllm" else run_hf(session, batch, new)
                    n_new = sum(len(o) for o in outs)
                    found = sum(passkey_found(k, tok.decode(o)) for o, (_, k) in zip(outs, batch))
                    row[side] = {"seconds": round(dt, 2), "new_tokens": n_new, "tokens_per_s": round(n_new / dt, 2),
                                 "passkeys_found": found}
                    print(f"new={new} round {r} {side}: {n_new} tokens in {dt:.1f} s = {n_new / dt:.2f} tok/s, "
                          f"{found}/{len(batch)} passkeys", flush=True)
                row["ratio"] = round(row["vllm"]["tokens_per_s"] / row["hf"]["tokens_per_s"], 2)
                rounds.append(row)
            results.append({"new_tokens_per_request": new, "rounds": rounds,
                            "median_ratio": round(statistics.median(r["ratio"] for r in rounds), 3)})
    session.close()
    result = {
        **environment(), "model": args.model, "adapter": args.adapter, "methods": args.method, "options": args.option,
        "requests": args.requests, "unshared": args.unshared,
        "prompt_tokens": args.length, "results": results, "goal": "vllm/hf >= 3",
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps([{k: r[k] for k in ("new_tokens_per_request", "median_ratio")} for r in results]), f"-> {out}")


if __name__ == "__main__":
    main()
