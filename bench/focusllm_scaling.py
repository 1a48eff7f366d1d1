"""FocusLLM: peak memory and time to first token vs input length, serial vs parallel vs full attention.

For each input length N (the first N tokens of the shared books) and each variant, a fresh
subprocess loads the model, reads the input and produces one token; it reports the time to first
token (model loading excluded), the parent samples its peak resident memory (so one variant's
allocations never inflate another's):

* focusllm-serial: candidates one chunk at a time (``parallel=1``; flat memory in N);
* focusllm-parallel: ``--parallel`` chunks per forward (0 = all at once);
* full: the bare model over all N tokens (only where it fits: ``--full-max``).

Goals (issue 7): serial peak memory at the longest length <= 2x at the shortest; parallel faster than serial.

    .venv/bin/python bench/focusllm_scaling.py [--lengths 8K,32K,128K] [-o chunk=2048 ...]
    python bench/focusllm_scaling.py --device cuda [--random-weights]   # on a GPU (peak GPU memory too)

"Parallel faster than serial" needs idle compute beside one chunk's forward: on a 2-core CPU there is none,
which is what ``--device cuda`` is for.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from lcx.io import pyplot, save_figure, token_counts
from lcx.session import parse_options

from books import book_tokens  # bench/books.py (scripts here run as `python bench/NAME.py`)
from loading import bench_model, device_name, gpu_peak, reset_gpu_peak, sync
from provenance import environment

OUT = Path(__file__).parent / "results"
DEFAULT = ["chunk=2048", "local=2048", "fragment=512"]


def one(model_name: str, n: int, variant: str, options: dict, parallel: int, device: str | None,
        random_weights: bool, dtype: str) -> None:
    """In the subprocess: read n tokens, produce one; prints the time to first token (load excluded) as JSON."""
    import lcx

    model, tok = bench_model(model_name, device, random_weights, dtype)
    ids = book_tokens(tok, n)
    reset_gpu_peak(model)
    sync(model)
    t0 = time.perf_counter()
    if variant == "full":
        with torch.no_grad():
            model(input_ids=ids.to(model.device), logits_to_keep=1)
    else:
        opts = {**options, "parallel": 1 if variant == "focusllm-serial" else parallel}
        with lcx.attach(model, ["focusllm"], focusllm=opts) as run:
            lcx.generate(run, ids, max_new_tokens=1)
    sync(model)
    print(json.dumps({"ttft_seconds": round(time.perf_counter() - t0, 2), "device": device_name(model),
                      **gpu_peak(model)}))


def measure_child(args: list[str]) -> dict:
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True)
        ps, peak = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            try:
                peak = max(peak, ps.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        out = proc.stdout.read() if proc.stdout else ""
        err.seek(0)
        errors = err.read()
    if proc.returncode:
        sys.stderr.write(errors)
        oom = next((line for line in errors.splitlines() if "OutOfMemoryError" in line), None)
        return {"error": oom.strip() if oom else f"exit status {proc.returncode}: {errors.strip()[-300:]}"}
    # peak RSS of the whole process (model included); time to first token without loading the model
    child = json.loads(out.strip().splitlines()[-1])
    return {"seconds": child["ttft_seconds"], "peak_rss_mib": round(peak / 2**20),
            **({"peak_gpu_mib": child["peak_gpu_mib"]} if "peak_gpu_mib" in child else {}), "device": child["device"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="8K,32K,128K", help="input lengths, shortest first (K suffix allowed)")
    ap.add_argument("--parallel", type=int, default=0, help="chunks per forward of the parallel variant (0 = all)")
    ap.add_argument("--full-max", default="32K", help="longest input the full-attention variant is run on")
    ap.add_argument("-o", "--option", action="append", default=None, help=f"focusllm option KEY=VALUE (default: {DEFAULT})")
    ap.add_argument("--device", default=None, help="where the model runs: cpu (default), cuda (or LCX_DEVICE)")
    ap.add_argument("--random-weights", action="store_true",
                    help="the model's architecture with random weights (from its config.json; speed only)")
    ap.add_argument("--dtype", default="float32", help="the model's dtype: float32 (default), bfloat16, float16")
    ap.add_argument("--out", type=Path, default=OUT / "focusllm_scaling.json")
    ap.add_argument("--one", nargs=2, metavar=("VARIANT", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    options = parse_options(args.option or DEFAULT)
    if args.one:
        one(args.model, int(args.one[1]), args.one[0], options, args.parallel, args.device, args.random_weights,
            args.dtype)
        return
    lengths, full_max = token_counts(args.lengths), token_counts(args.full_max)[0]
    passthrough = [a for o in (args.option or []) for a in ("-o", o)]
    passthrough += (["--device", args.device] if args.device else []) + (["--random-weights"] if args.random_weights else [])
    passthrough += ["--dtype", args.dtype] if args.dtype != "float32" else []
    rows = []
    for n in lengths:
        row: dict = {"tokens": n}
        for variant in ("focusllm-serial", "focusllm-parallel", "full"):
            if variant == "full" and n > full_max:
                row[variant] = {"skipped": f"longer than --full-max {args.full_max}"}
                continue
            print(f"{variant} @ {n} tokens ...", flush=True)
            row[variant] = measure_child([sys.executable, __file__, "--model", args.model, "--parallel",
                                          str(args.parallel), *passthrough, "--one", variant, str(n)])
            print(f"  {row[variant]}", flush=True)
        rows.append(row)
    memory_key = "peak_gpu_mib" if "peak_gpu_mib" in rows[0]["focusllm-serial"] else "peak_rss_mib"
    serial = [r["focusllm-serial"].get(memory_key) for r in rows]
    mem_ratio = serial[-1] / serial[0] if all(serial) else None
    speed = [r["focusllm-serial"]["seconds"] / r["focusllm-parallel"]["seconds"] for r in rows
             if "seconds" in r["focusllm-serial"] and "seconds" in r["focusllm-parallel"]]
    result = {
        "benchmark": "FocusLLM memory and time to first token", "model": args.model, "dtype": args.dtype, "focusllm_options": options,
        "parallel": args.parallel, **environment(), "rows": rows,
        "serial_peak_ratio_longest_over_shortest": round(mem_ratio, 3) if mem_ratio else None, "peak_of": memory_key,
        "parallel_speedup_over_serial": [round(s, 3) for s in speed],
        "goals": "serial peak ratio <= 2; parallel faster than serial",
        "command": "python bench/focusllm_scaling.py " + " ".join(passthrough) + f" --lengths {args.lengths} "
                   f"--parallel {args.parallel} --full-max {args.full_max}",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    fig, axes = pyplot().subplots(1, 2, figsize=(9, 3.4))
    for variant, style in (("focusllm-serial", "o-"), ("focusllm-parallel", "s-"), ("full", "^--")):
        xs = [r["tokens"] for r in rows if "seconds" in r[variant]]
        for ax, key, scale in ((axes[0], memory_key, 1 / 1024), (axes[1], "seconds", 1)):
            ax.plot(xs, [r[variant][key] * scale for r in rows if "seconds" in r[variant]], style, label=variant)
    memory_label = "peak GPU memory (GiB)" if memory_key == "peak_gpu_mib" else "peak resident memory (GiB)"
    for ax, label in ((axes[0], memory_label), (axes[1], "time to first token (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n // 1024}K" for n in lengths])
        ax.set_xlabel("input tokens")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    save_figure(fig, args.out.with_suffix(".png"), f"FocusLLM scaling, {args.model}")
    print(f"serial peak ratio {result['serial_peak_ratio_longest_over_shortest']} (goal <= 2); parallel speed-up "
          f"{result['parallel_speedup_over_serial']}; wrote {args.out}")


if __name__ == "__main__":
    main()
