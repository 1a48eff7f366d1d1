"""`lcx serve` on Gemma 3 270M and Qwen2.5 0.5B (issue 50): each method served by vLLM on this CPU answers a
prompt in real prose with the tokens `lcx generate` gives it, past the method's window.

    .venv/bin/python results/models/serve_check.py [--models gemma3-270m,qwen2.5-0.5b] [--tokens 3072]

Windows are held to 1K (fot local, streaming window, focusllm chunk and local; vanilla 2K) so that a 3K-token
prompt is past each of them; rope is YaRN x2.  The needle is a pass key in the 8 books (../shared/data/books);
both sides run float32, greedy, 12 new tokens.  Writes results/models/serve/{serve.json,README.md}; a server's
vLLM log goes beside them (deleted when its method matched).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BOOKS = ROOT.parent / "shared" / "data" / "books"
OUT = Path(__file__).parent / "serve"
NEW = 12
STACKS = {
    "none": {},
    "vanilla": {"window": 2048},
    "rope": {"factor": 2},
    "streaming": {"window": 1024, "chunk": 256},
    # fot: its defaults before issue 52 pinned (serve/ was made with them)
    "fot": {"local": 1024, "chunk": 256, "sinks": 0, "positions": "first", "fixed_distance": 0, "gate": "off"},
    "focusllm": {"chunk": 1024, "local": 1024, "fragment": 256, "refresh": 0},
}
# fot's memory layers as `auto` chooses them (tests/test_real_models.py): given, so no run pays the measurement
FOT_LAYERS = {"gemma3-270m": "auto", "qwen2.5-0.5b": "3,5,6,7,9,10,11,12,13,14,15,16,17,18,19,20,21,22"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gemma3-270m,qwen2.5-0.5b")
    ap.add_argument("--methods", default=",".join(STACKS))
    ap.add_argument("--tokens", type=int, default=3072)
    a = ap.parse_args()

    from lcx.evals.passkey import Haystack, prompt_and_needle
    from lcx.generation import generate
    from lcx.integrations.vllm import ServerProcess
    from lcx.session import open_session

    OUT.mkdir(parents=True, exist_ok=True)
    old = OUT / "serve.json"  # rows of earlier runs stay, unless this run redoes their model and method
    rows = json.loads(old.read_text())["rows"] if old.is_file() else []
    todo = {(m, x) for m in a.models.split(",") for x in a.methods.split(",")}
    rows = [r for r in rows if (r["model"], r["method"]) not in todo]
    for model in a.models.split(","):
        for method in a.methods.split(","):
            opts = dict(STACKS[method])
            if method == "fot":
                opts["memory_layers"] = FOT_LAYERS[model]
            methods = [] if method == "none" else [method]
            s = open_session(model, methods, {method: opts} if opts else {}, None, dtype="float32")
            key = 40000 + 10 * list(STACKS).index(method) + list(FOT_LAYERS).index(model)
            ids, _ = prompt_and_needle(s.tokenizer, a.tokens, 0.5, key, Haystack([str(BOOKS)]))
            t0 = time.perf_counter()
            want = generate(s.run, ids[None], max_new_tokens=NEW, do_sample=False)[0].tolist()
            hf_s = time.perf_counter() - t0
            s.close()
            args = [x for k, v in opts.items() for x in ("-o", f"{method}.{k}={v}")]
            args = (["--method", method] if methods else []) + args + ["--dtype", "float32"]
            if method != "rope":  # rope sets its own: factor x the window
                args += ["--max-model-len", str(a.tokens + 2 * NEW + 64)]
            log = OUT / f"{model}-{method}.log"
            row = {"model": model, "method": method, "options": opts, "prompt_tokens": int(ids.shape[0]),
                   "key": key, "lcx_generate": s.tokenizer.decode(want), "hf_seconds": round(hf_s, 1)}
            try:
                with ServerProcess(model, [*args, "--export-dir", str(OUT / "export")], log) as srv:
                    t0 = time.perf_counter()
                    got = srv.complete(model, ids.tolist(), NEW)
                    row.update(served=s.tokenizer.decode(got), same_tokens=got == want,
                               served_seconds=round(time.perf_counter() - t0, 1))
            except Exception as e:  # noqa: BLE001  (a method that does not start is a row, not the end)
                row.update(served=None, same_tokens=False, error=str(e)[-600:])
            row["key_found"] = {"lcx_generate": str(key) in row["lcx_generate"],
                                "served": bool(row.get("served")) and str(key) in row["served"]}
            if row["same_tokens"]:
                log.unlink(missing_ok=True)
            rows.append(row)
            print(json.dumps(row), flush=True)
            (OUT / "serve.json").write_text(json.dumps({"tokens": a.tokens, "new_tokens": NEW, "rows": rows},
                                                       indent=1) + "\n")
    order = {(m, x): i for i, (m, x) in enumerate((m, x) for m in FOT_LAYERS for x in STACKS)}
    rows.sort(key=lambda r: order[(r["model"], r["method"])])
    (OUT / "serve.json").write_text(json.dumps({"tokens": a.tokens, "new_tokens": NEW, "rows": rows}, indent=1) + "\n")
    lines = ["# `lcx serve` on the new families: served tokens against `lcx generate`'s", "",
             f"`.venv/bin/python results/models/serve_check.py` ({a.tokens}-token prompt in prose, pass key at depth "
             f"0.5, {NEW} new tokens, float32, greedy; windows held to 1K so each method works past its window).  The "
             "seconds are one request's wall time as it ran, on a 2-core machine that may have been running other "
             "work: not a speed comparison (bench/ has those).", "",
             "| model | method | options | same tokens | key found (generate / served) | generate (s) | served (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        opts = " ".join(f"{k}={v}" for k, v in r["options"].items()) or "-"
        same = "yes" if r["same_tokens"] else ("no: " + r["error"].splitlines()[-1][:120] if r.get("error") else "no")
        lines.append(f"| {r['model']} | {r['method']} | {opts} | {same} | {'yes' if r['key_found']['lcx_generate'] else 'no'}"
                     f" / {'yes' if r['key_found']['served'] else 'no'} | {r['hf_seconds']} | {r.get('served_seconds', '-')} |")
    (OUT / "README.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
