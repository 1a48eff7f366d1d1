"""Writing result files: atomically (temp file + rename), so a crash never leaves half a file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(obj: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)
    return path


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display on our machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, title: str | None = None) -> Path:
    """Title, tighten, write atomically as PNG and close ``fig``."""
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    pyplot().close(fig)
    return path
