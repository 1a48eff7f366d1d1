"""What the serving tests share: the model, starting a server beside lcx's own answers, and those answers."""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from lcx.integrations.vllm import ServerProcess

MODEL = "smollm2-135m"  # the name the server serves it under
#: The served model: SmolLM2-135M's weights under a config whose window is 2,048 tokens (the length it was
#: pretrained at before its 8K extension), so that every prompt past the window is a short one (model_path).
WINDOW = 2048
LONG = WINDOW + WINDOW // 4  # the parity length: past the model's window by a quarter of it
NEW = 8

#: fot's memory layers as its `auto` measures them on the catalog's SmolLM2 (results/models/smollm2-135m/retrieval),
#: given so that the serving tests do not pay the measurement (tests/test_auto.py checks auto, and that export serves
#: it).
FOT_LAYERS = "6,7,8,14,15,17,18,19,20,21,22,23"

#: Every serving test starts a vLLM engine on the real model (each module: ``pytestmark = SERVING``).
SERVING = [pytest.mark.vllm, pytest.mark.slow]

#: The rope method the LoRA server applies under its adapters (and plain `vllm serve`'s sidecar names).
ROPE = {"rope": {"type": "yarn", "factor": 4}}
ROPE_ARGS = [x for k, v in ROPE["rope"].items() for x in ("-o", f"rope.{k}={v}")]


def method_args(method: str, opts: dict[str, Any]) -> list[str]:
    """``-o method.k=v`` for each option."""
    return [x for k, v in opts.items() for x in ("-o", f"{method}.{k}={v}")]


@functools.cache
def model_path() -> str:
    """The served model's folder, made on first use: the pulled model's files linked, its config's window set to
    WINDOW.  Past the window every path runs the same code at 2,048 as at 8,192, at a small part of the cost of
    a forward over 8K+ tokens (its attention grows with the square of the length).  Removed when the run ends."""
    import atexit
    import shutil
    import tempfile

    from lcx.models import resolve_model_path

    src = resolve_model_path(MODEL)
    d = Path(tempfile.mkdtemp(prefix="lcx-serve-model-")) / MODEL  # the folder's name is the served name
    d.mkdir()
    atexit.register(shutil.rmtree, d.parent, True)
    for f in src.iterdir():  # a plain HF folder: not the catalog's record, nor its auto cache
        if f.name not in ("config.json", "lcx-model.json", "lcx-auto.json"):
            (d / f.name).symlink_to(f.resolve())
    config = json.loads((src / "config.json").read_text())
    config["max_position_embeddings"] = WINDOW
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return str(d)


@contextmanager
def server_starting(args: list[str], tmp: Path) -> Iterator[ServerProcess]:
    """`lcx serve` launched, not yet ready: ``wait_ready()`` blocks until its ready line.  An engine start
    leaves a core idle about half its start (vLLM imports itself in three processes, one after another), so most
    tests compute lcx's answers in between.  The server is stopped on leaving, and must exit cleanly when the
    body did."""
    s = ServerProcess(model_path(), [*args, "--export-dir", str(tmp / "export")], tmp / "serve.log", wait=False)
    try:
        yield s
    finally:
        code = s.close()
    assert code == 0, f"the server exited with status {code}; log: {tmp / 'serve.log'}"


def smt_adapter(out: Path, seed: int, scale: float = 0.05) -> Path:
    """A q/k LoRA adapter (rank 8) with random B: what `lcx train --method smt` writes, untrained."""
    from lcx.adapters.peft_bridge import random_adapter
    from lcx.models import load_model

    return random_adapter(load_model(model_path())[0], out, seed, scale=scale)


#: Open HF sessions by (methods, options, adapter, memory), most recently used last: loading the model per reference
#: would cost a load each; a few are kept (each holds a copy of the model).  conftest closes them per module.
SESSIONS: OrderedDict[tuple, Any] = OrderedDict()
_KEEP_SESSIONS = 3


def close_sessions() -> None:
    while SESSIONS:
        SESSIONS.popitem()[1].close()


def hf_tokens(ids: torch.Tensor, methods=(), options=None, adapter=None, max_new_tokens: int = NEW,
              memory=None) -> list[int]:
    """The lcx Hugging Face path: what `lcx generate --greedy [--memory PATH]` produces.  A session is
    reused across prompts as `lcx eval` does (each generation starts a fresh plan and memory); with a
    document memory it is reloaded before every prompt, since fot's multi-document mode keeps what a
    prompt adds."""
    from lcx.generation import generate
    from lcx.session import open_session

    key = (tuple(methods), json.dumps(options or {}, sort_keys=True), str(adapter), str(memory))
    s = SESSIONS.pop(key, None) or open_session(model_path(), list(methods), options or {}, adapter)
    SESSIONS[key] = s
    while len(SESSIONS) > _KEEP_SESSIONS:
        SESSIONS.popitem(last=False)[1].close()
    if memory is not None:
        s.run.method("fot").load(memory, s.model)
    return generate(s.run, ids[None], max_new_tokens=max_new_tokens, do_sample=False)[0].tolist()
