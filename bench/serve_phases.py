"""Where a served request's time goes, per server configuration, side by side in one run: engine start
(the ready line, and when each of vLLM's processes showed up in its log), prefill (R prompts answered
with one token each) and decode (the same number of fresh prompts, N new tokens each: the difference
per generated step).  vLLM only; `bench/serve_throughput.py` compares with lcx's HF path.

Each configuration is `LABEL=LCX_SERVE_ARGS` (the arguments of `lcx serve MODEL`; vLLM's own after
`--`).  The defaults separate what fot's served attention costs from what serving it through the
Transformers backend without prefix caching (as every lcx attention method is served) costs:

    .venv/bin/python bench/serve_phases.py                          # ~25 min on 2 cores
    .venv/bin/python bench/serve_phases.py -c 'streaming=--method streaming'
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

from provenance import machine  # bench/provenance.py
from serve_throughput import prompts, run_vllm  # bench/serve_throughput.py (scripts here run as `python bench/NAME.py`)

OUT = Path(__file__).parent / "results"
FOT = "--method fot -o fot.local=1024 -o fot.chunk=256 -o fot.memory_layers=6,7,8,14,15,17,18,19,20,21,22,23"
# fot's defaults before issue 52 (serve_phases.json was measured with them)
FOT += " -o fot.sinks=0 -o fot.positions=first -o fot.fixed_distance=0 -o fot.gate=off"
DEFAULT = [
    "base=",  # vLLM's own Llama, prefix caching on (the 8 passkey prompts share their filler)
    "base, Transformers backend, no prefix cache=-- --no-enable-prefix-caching --model-impl transformers",
    f"fot={FOT}",  # served as every lcx attention method is: Transformers backend, no prefix cache
]
#: vLLM log lines that mark a start phase: (phase, pattern); the first line matching each counts
MARKS = [("api server logging", r"\(APIServer pid=\d+\) INFO"), ("engine core up", r"Initializing a V1 LLM engine"),
         ("worker up", r"\(VllmWorker\S* pid=\d+\)"), ("engine ready", r"init engine \(profile"),
         ("http up", r"Starting vLLM server")]
STAMP = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d)")


def start_marks(log: Path, t0: float) -> dict[str, float]:
    """Seconds from the launch of `lcx serve` to each phase's first log line (the log stamps whole seconds)."""
    year = datetime.fromtimestamp(t0).year
    out: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        for phase, pat in MARKS:
            if phase not in out and re.search(pat, line) and (m := STAMP.search(line)):
                at = datetime.strptime(f"{year}-{m.group(1)}", "%Y-%m-%d %H:%M:%S").timestamp()
                out[phase] = round(at - t0, 1)
    return out


def measure(model: str, label: str, args: list[str], tok, requests: int, length: int, new: int, work: Path) -> dict:
    from lcx.integrations.vllm import ServerProcess

    slug = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    # lcx's options first: a configuration's own may end with `-- VLLM_ARGS`
    server = ServerProcess(model, ["--export-dir", str(work / slug), "--max-model-len", str(length + new + 64), *args],
                           work / f"{slug}.log")
    ready = time.time() - t0

    def batch(seed: int, n: int) -> float:
        return run_vllm(server, model, prompts(tok, requests, length, seed), n)[0]

    try:
        batch(1, 1)  # warm-up: the first requests pay one-off costs
        prefill = batch(2, 1)
        total = batch(3, new)
    finally:
        server.close()
    return {"label": label, "args": args, "start_s": round(ready, 1), "start_marks_s": start_marks(server.log_path, t0),
            "prefill_s": round(prefill, 2), f"prefill_plus_{new}_new_s": round(total, 2),
            "decode_step_ms": round(1000 * (total - prefill) / (new - 1), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("-c", "--config", action="append", default=None, metavar="LABEL=ARGS",
                    help="a server configuration: LABEL=`lcx serve` arguments (repeat; default: the three above)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--length", type=int, default=2048, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=256, help="new tokens per request in the decode measurement")
    ap.add_argument("--rounds", type=int, default=2, help="every configuration once per round, in turn (this "
                    "machine's speed drifts by tens of percent over minutes: compare within a round)")
    ap.add_argument("--out", type=Path, default=OUT / "serve_phases.json")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from lcx.models import resolve_model_path

    configs = []
    for c in args.config or DEFAULT:
        label, sep, rest = c.partition("=")
        if not sep or not label:
            ap.error(f"--config {c!r}: expected LABEL=ARGS, e.g. 'fot=--method fot -o fot.local=1024'")
        configs.append((label, shlex.split(rest)))
    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(args.model)))
    work = Path(tempfile.mkdtemp(prefix="lcx-serve-phases-"))
    results = []
    for r in range(args.rounds):
        for label, cargs in configs:
            print(f"== round {r}: {label}", flush=True)
            results.append({"round": r, **measure(args.model, label, cargs, tok, args.requests, args.length, args.new,
                                                  work / str(r))})
            print(json.dumps(results[-1]), flush=True)
    summary = {label: {key: statistics.median(x[key] for x in results if x["label"] == label)
                       for key in ("start_s", "prefill_s", "decode_step_ms")} for label, _ in configs}
    for label, m in summary.items():
        print(f"{label}: start {m['start_s']} s, prefill {m['prefill_s']} s, decode step {m['decode_step_ms']} ms (median)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "requests": args.requests, "prompt_tokens": args.length,
                                    "new_tokens": args.new, "rounds": args.rounds, "median": summary, "results": results,
                                    "machine": machine()},
                                   indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
