"""FSDP2 against DDP: `lcx train`'s step time with 2 processes at the same global batch, on this machine's CPUs.

Both run the same command (`accelerate launch --config_file configs/accelerate/{ddp,fsdp2}-2proc.yaml -m lcx.cli
train ...`), alternating round after round in one run (this machine is noisy); a step's time is the "seconds"
lcx train records per step in metrics.jsonl (the main process's), the first --skip steps of each run left out
(start-up, allocator warm-up).  Also recorded: each run's peak resident memory per process (psutil, sampled),
which FSDP2 exists to lower.

    OMP_NUM_THREADS=1 .venv/bin/python bench/train_fsdp.py [--model DIR] [--steps 12] [--rounds 2] [--lora|--full]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from provenance import machine  # bench/provenance.py (scripts here run as `python bench/NAME.py`)

REPO = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "results"
TEXT = "the quick brown fox jumps over the lazy dog. " * 400


def tiny_model(folder: Path, hidden: int, layers: int) -> Path:
    sys.path.insert(0, str(REPO))
    from tests.helpers import make_tiny_model_dir

    return make_tiny_model_dir(folder, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                               num_attention_heads=hidden // 32, num_key_value_heads=hidden // 64,
                               max_position_embeddings=4096)


def launch(engine: str, args, data: Path, out: Path) -> dict:
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", "--config_file", str(REPO / f"configs/accelerate/{engine}-2proc.yaml"),
           "-m", "lcx.cli", "train", "-m", str(args.model), "-d", str(data), "--out", str(out),
           "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--batch-size", str(args.global_batch // 2),
           "--save-every", "0", "--json", *(["--full", "all"] if args.full else [])]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "LCX_DTYPE": args.dtype}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    peak: dict[int, float] = {}

    def sample() -> None:  # each rank's resident memory, every 50 ms
        while proc.poll() is None:
            try:
                for c in psutil.Process(proc.pid).children(recursive=True):
                    if "lcx.cli" in " ".join(c.cmdline()):
                        peak[c.pid] = max(peak.get(c.pid, 0.0), c.memory_info().rss / 2**20)
            except psutil.Error:
                pass
            time.sleep(0.05)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    stdout, stderr = proc.communicate(timeout=1800)
    t.join()
    if proc.returncode:
        raise SystemExit(f"{engine} run failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {"step_seconds": [s["seconds"] for s in steps[args.skip:]], "losses": [s["loss"] for s in steps],
            "peak_rss_mib_per_process": sorted(round(v) for v in peak.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model folder (default: a random llama of --hidden x --layers)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--global-batch", type=int, default=4, help="windows per step over both processes")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="first steps of each run not timed")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--full", action="store_true", help="train every weight (default: LoRA)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, default=OUT / "train_fsdp.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.model is None:
            args.model = tiny_model(tmp / "model", args.hidden, args.layers)
        data = tmp / "data"
        data.mkdir()
        for i in range(8):
            (data / f"{i}.txt").write_text(TEXT if i % 2 else TEXT.upper())
        runs: dict[str, list[dict]] = {"ddp": [], "fsdp2": []}
        for r in range(args.rounds):
            for engine in (("ddp", "fsdp2") if r % 2 == 0 else ("fsdp2", "ddp")):
                runs[engine].append(launch(engine, args, data, tmp / f"{engine}-{r}"))
                print(f"round {r} {engine}: median step {statistics.median(runs[engine][-1]['step_seconds']):.3f} s, "
                      f"peak RSS {runs[engine][-1]['peak_rss_mib_per_process']} MiB", flush=True)
    med = {e: statistics.median([s for run in rs for s in run["step_seconds"]]) for e, rs in runs.items()}
    result = {
        "what": "lcx train, 2 processes, same global batch: DDP vs FSDP2 step time (median over rounds and steps)",
        "machine": {**machine(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "settings": {k: str(v) for k, v in vars(args).items() if k != "out"},
        "median_step_seconds": med, "fsdp2_over_ddp": med["fsdp2"] / med["ddp"], "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("\n| engine | median step (s) | peak RSS per process (MiB) |\n|---|---|---|")
    for e in ("ddp", "fsdp2"):
        print(f"| {e} | {med[e]:.3f} | {max(max(r['peak_rss_mib_per_process'] or [0]) for r in runs[e])} |")
    print(f"\nFSDP2 / DDP step time: {result['fsdp2_over_ddp']:.2f}  ->  {args.out}")


if __name__ == "__main__":
    main()
