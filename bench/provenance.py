"""What a benchmark ran: the commit (marked when lcx's own code differs from it), the command, torch and the machine."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CODE = ("sdk", "plugins", "adapters", "integrations")  # what the figures depend on (not results/ or docs)
LOAD_AT_START = list(os.getloadavg())  # read on import: most benches record their machine after measuring


def git_commit() -> str:
    """HEAD's hash, with "+uncommitted changes" when the working tree's lcx code is not HEAD's."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *CODE], cwd=ROOT).returncode != 0
    return head + ("+uncommitted changes" if dirty else "")


def environment() -> dict:
    """What every benchmark's JSON records about the run: its command, the code, torch and the machine."""
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": git_commit(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "machine": machine()}


def write_results(args, results: list) -> None:
    """``args.out``: a bench's options, ``environment()`` and its results, as JSON."""
    import json

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": {**vars(args), "out": str(args.out)}, **environment(), "results": results},
                                   indent=2) + "\n")
    print(f"wrote {args.out}")


def machine() -> dict:
    """The machine a figure was measured on: the CPU's model and cores, the half-precision flags lcx's dtype
    choice reads (``lcx.models.cpu_flags``), memory, and the load when the bench started (other work on the cores)."""
    from lcx.models import cpu_flags

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.partition(":")[2].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu": model or platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "half_flags": sorted(cpu_flags() & {"amx_bf16", "amx_fp16", "avx512_bf16", "avx512_fp16"}),
            "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "platform": platform.platform(), "loadavg_start": LOAD_AT_START}
