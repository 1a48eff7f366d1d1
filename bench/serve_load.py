"""Load test of `lcx serve` (issue 9): concurrent clients on loopback for a bounded time.

One server (SmolLM2-135M, float32) serves the base model and two LoRA adapters at once; every request
is a passkey prompt, short or long, for one of the three, so each answer can be checked against the
request that asked it:

1. warm-up / calibration: ``--pool`` prompts per model name, each with its own passkey, all sent
   concurrently; the (prompt, model) pairs answered with their own passkey form the pool (a small
   model misses some passkeys on its own: those are not the server's fault and are left out);
2. load: ``--clients`` threads, each sending pool requests back to back until ``--seconds`` have
   passed; no two requests in flight share a passkey;
3. every answer is classified: its own passkey, another pool passkey (a cross-request answer: the
   failure this checks for), or neither.  HTTP statuses are counted (5xx must be 0).

Resident memory (RSS of the server's whole process tree) is read after the warm-up and after the
load; the goal is "after" within 10% of "after warm-up".  Prefix caching is off, so repeated prompts
cost what new ones cost.

    .venv/bin/python bench/serve_load.py [--clients 16] [--seconds 180] [--short 384] [--long 2048]
    .venv/bin/python bench/serve_load.py --method fot -o fot.local=512 --adapters 0   # a memory method
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from provenance import environment  # bench/provenance.py (scripts here run as `python bench/NAME.py`)

OUT = Path(__file__).parent / "results"
# fot's defaults before issue 52, under any -o when fot is served (serve_load-fot.json was measured with them)
FOT_BEFORE = ["fot.local=2048", "fot.chunk=0", "fot.sinks=0", "fot.positions=first", "fot.fixed_distance=0",
              "fot.gate=off"]


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--short", type=int, default=384, help="tokens of a short prompt")
    ap.add_argument("--long", type=int, default=2048, help="tokens of a long prompt")
    ap.add_argument("--new", type=int, default=12, help="max new tokens per request")
    ap.add_argument("--pool", type=int, default=12, help="calibration prompts per model name (half short, half long)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--method", action="append", default=[], help="servable method(s) of the server, e.g. fot")
    ap.add_argument("--option", "-o", action="append", default=[], metavar="METHOD.KEY=VALUE",
                    help="method option, e.g. -o fot.local=512")
    ap.add_argument("--adapters", type=int, default=2, help="random q/k LoRA adapters served beside the base model")
    ap.add_argument("--out", type=Path, default=None, help="default: bench/results/serve_load[-METHODS].json")
    args = ap.parse_args()
    if "fot" in args.method:
        args.option = [*FOT_BEFORE, *args.option]

    from transformers import AutoTokenizer

    from lcx.adapters.peft_bridge import random_adapter
    from lcx.evals.passkey import build_prompt_ids, passkey_found
    from lcx.integrations.vllm import ServerProcess
    from lcx.models import load_model, resolve_model_path

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(args.model)))
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="lcx-load-"))
    names = [args.model, *(f"a{i}" for i in range(1, args.adapters + 1))]
    out = args.out or OUT / ("serve_load" + "".join(f"-{m}" for m in args.method) + ".json")
    serve_args = ["--max-model-len", str(args.long + args.new + 64), "--export-dir", str(tmp / "export")]
    serve_args += [f"--method={m}" for m in args.method] + [x for o in args.option for x in ("-o", o)]
    for i, name in enumerate(names[1:], 1):  # small random q/k LoRA adapters (scale 0.02): answers mostly kept
        serve_args.append(f"--adapter={name}={random_adapter(load_model(args.model)[0], tmp / name, i, scale=0.02)}")
    serve_args += ["--", "--no-enable-prefix-caching"]

    keys = rng.sample(range(10000, 99999), args.pool * len(names))
    candidates = []
    for j, key in enumerate(keys):
        length = args.short if j % 2 == 0 else args.long
        candidates.append({"model": names[j % len(names)], "key": key, "length": length,
                           "ids": build_prompt_ids(tok, length, rng.random(), key).tolist()})
    all_keys = set(keys)

    def ask(server, c: dict) -> dict:
        t0 = time.perf_counter()
        status, out = server.post("/v1/completions", {"model": c["model"], "prompt": c["ids"], "max_tokens": args.new,
                                                      "temperature": 0, "return_token_ids": True}, timeout=3600)
        dt = time.perf_counter() - t0
        text = out["choices"][0]["text"] if status == 200 else ""
        found = {k for k in all_keys if passkey_found(k, text)}
        verdict = "own" if c["key"] in found else ("other" if found else "neither")
        n_new = len(out["choices"][0].get("token_ids") or []) if status == 200 else 0
        return {"status": status, "seconds": dt, "verdict": verdict, "model": c["model"], "length": c["length"],
                "new_tokens": n_new, "prompt_tokens": len(c["ids"]), "found": sorted(found)}

    with ServerProcess(args.model, serve_args, tmp / "serve.log") as server:
        print(f"server ready in {server.ready['start_seconds']} s; calibrating {len(candidates)} prompts", flush=True)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as ex:
            calib = list(ex.map(lambda c: ask(server, c), candidates))
        pool = [c for c, r in zip(candidates, calib) if r["verdict"] == "own"]
        calib_s = time.perf_counter() - t0
        kept_by_length = {n: sum(c["length"] == n for c in pool) for n in (args.short, args.long)}
        print(f"calibration: {len(pool)}/{len(candidates)} answered with their own passkey in {calib_s:.0f} s "
              f"(by prompt length: {kept_by_length}; other: {sum(r['verdict'] == 'other' for r in calib)})", flush=True)
        if len(pool) < args.clients:
            raise SystemExit(f"only {len(pool)} calibrated prompts for {args.clients} clients; raise --pool")
        time.sleep(5)
        rss_warm = tree_rss(server.proc.pid)

        free, lock, results = list(pool), threading.Lock(), []
        stop_at = time.perf_counter() + args.seconds

        def client(i: int) -> None:
            crng = random.Random(args.seed * 1000 + i)
            while time.perf_counter() < stop_at:
                with lock:  # a pool entry not in flight: no two requests share a passkey
                    c = free.pop(crng.randrange(len(free)))
                try:
                    r = ask(server, c)
                finally:
                    with lock:
                        free.append(c)
                with lock:
                    results.append(r)

        t_load = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t_load
        time.sleep(5)
        rss_after = tree_rss(server.proc.pid)

    lat = [r["seconds"] for r in results]
    by = lambda key, val: [r for r in results if r[key] == val]  # noqa: E731
    summary = {
        "requests": len(results),
        "statuses": {str(s): sum(r["status"] == s for r in results) for s in sorted({r["status"] for r in results})},
        "status_5xx": sum(r["status"] >= 500 for r in results),
        "answers": {v: len(by("verdict", v)) for v in ("own", "other", "neither")},
        "latency_s": {"p50": round(pct(lat, 0.5), 2), "p99": round(pct(lat, 0.99), 2), "max": round(max(lat), 2),
                      "short_p50": round(statistics.median([r["seconds"] for r in by("length", args.short)] or [0]), 2),
                      "long_p50": round(statistics.median([r["seconds"] for r in by("length", args.long)] or [0]), 2)},
        "throughput": {"requests_per_s": round(len(results) / wall, 3),
                       "new_tokens_per_s": round(sum(r["new_tokens"] for r in results) / wall, 2),
                       "prompt_tokens_per_s": round(sum(r["prompt_tokens"] for r in results) / wall, 1)},
        "per_model": {n: len(by("model", n)) for n in names},
        "rss_gib": {"after_warmup": round(rss_warm / 2**30, 3), "after_load": round(rss_after / 2**30, 3),
                    "growth": round(rss_after / rss_warm - 1, 4)},
        "wall_s": round(wall, 1),
    }
    summary["goals"] = {"zero_5xx": summary["status_5xx"] == 0, "zero_cross_request": summary["answers"]["other"] == 0,
                        "all_own": summary["answers"]["own"] == len(results),
                        "rss_within_10pct": abs(summary["rss_gib"]["growth"]) <= 0.10}
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "calibration": {
        "prompts": len(candidates), "kept": len(pool), "kept_by_length": kept_by_length, "seconds": round(calib_s, 1),
        "other": sum(r["verdict"] == "other" for r in calib)}, "summary": summary,
        "failures": [r for r in results if r["verdict"] != "own" or r["status"] != 200][:20],
        **environment()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=2), f"-> {out}")


if __name__ == "__main__":
    main()
