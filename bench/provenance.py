"""What a benchmark ran: the commit (marked when lcx's own code differs from it), the command, torch and the machine."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CODE = ("sdk", "plugins", "adapters", "integrations")  # what the figures depend on (not results/ or docs)


def git_commit() -> str:
    """HEAD's hash, with "+uncommitted changes" when the working tree's lcx code is not HEAD's."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *CODE], cwd=ROOT).returncode != 0
    return head + ("+uncommitted changes" if dirty else "")


def environment() -> dict:
    """What every benchmark's JSON records about the run: its command, the code, torch and the machine."""
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": git_commit(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine()}
