"""What the serving tests share: the model, starting a server beside lcx's own answers, and those answers."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from lcx.integrations.vllm import ServerProcess

MODEL = "smollm2-135m"
WINDOW = 8192
LONG = WINDOW + WINDOW // 4  # the parity length: past the model's window by a quarter of it
#: The parity length where a test also checks that the answer holds the key: at LONG, test_lora's and
#: test_focusllm's keys are missed (on both sides alike), and that check would have no real answer to check.
LONG_ANSWERED = WINDOW + WINDOW // 2
NEW = 8

#: fot's memory layers as its `auto` measures them on this model (results/models/smollm2-135m/retrieval), given so
#: that the serving tests do not pay the measurement (tests/test_auto.py checks auto, and that export serves it).
FOT_LAYERS = "6,7,8,14,15,17,18,19,20,21,22,23"

#: Every serving test starts a vLLM engine on the real model (each module: ``pytestmark = SERVING``).
SERVING = [pytest.mark.vllm, pytest.mark.slow]

#: The rope method the LoRA server applies under its adapters (and plain `vllm serve`'s sidecar names).
ROPE = {"rope": {"type": "yarn", "factor": 4}}
ROPE_ARGS = [x for k, v in ROPE["rope"].items() for x in ("-o", f"rope.{k}={v}")]


def method_args(method: str, opts: dict[str, Any]) -> list[str]:
    """``-o method.k=v`` for each option."""
    return [x for k, v in opts.items() for x in ("-o", f"{method}.{k}={v}")]


@contextmanager
def server_starting(args: list[str], tmp: Path) -> Iterator[ServerProcess]:
    """`lcx serve` launched, not yet ready: ``wait_ready()`` blocks until its ready line.  An engine start
    leaves a core idle about half its ~24 s (vLLM imports itself in three processes, one after another), so
    test_lora and test_vanilla compute their long reference (one full-attention forward) in between:
    11-15 s less each (the group's run of 2026-11-27).  The chunked methods' references (fot, focusllm,
    streaming: many small forwards, which a busy core stalls) took 6-19 s longer there, so those tests
    compute theirs first.  The server is stopped on leaving, and must exit cleanly when the body did."""
    s = ServerProcess(MODEL, [*args, "--export-dir", str(tmp / "export")], tmp / "serve.log", wait=False)
    try:
        yield s
    finally:
        code = s.close()
    assert code == 0, f"the server exited with status {code}; log: {tmp / 'serve.log'}"


def smt_adapter(out: Path, seed: int, scale: float = 0.05) -> Path:
    """A q/k LoRA adapter (rank 8) with random B: what `lcx train --method smt` writes, untrained."""
    from lcx.adapters.peft_bridge import random_adapter
    from lcx.models import load_model

    return random_adapter(load_model(MODEL)[0], out, seed, scale=scale)


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
    s = SESSIONS.pop(key, None) or open_session(MODEL, list(methods), options or {}, adapter)
    SESSIONS[key] = s
    while len(SESSIONS) > _KEEP_SESSIONS:
        SESSIONS.popitem(last=False)[1].close()
    if memory is not None:
        s.run.method("fot").load(memory, s.model)
    return generate(s.run, ids[None], max_new_tokens=max_new_tokens, do_sample=False)[0].tolist()
