"""Plain `vllm serve` (vLLM's own CLI, lcx only as its installed plugin)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .harness import NEW, ROPE, SERVING, WINDOW, hf_tokens, model_path

pytestmark = SERVING


def test_plain_vllm_serve_applies_the_sidecar_through_the_plugin(tmp_path, tok):
    """`vllm serve DIR --config-format lcx` on the model's own files plus an lcx.json naming rope: it answers
    as lcx's rope method does, not as the bare model."""
    import socket
    import subprocess
    import sys
    import urllib.request

    from lcx.integrations.vllm import stop, wait_ready

    d = tmp_path / "model"
    d.mkdir()
    for f in Path(model_path()).iterdir():
        (d / f.name).symlink_to(f.resolve())
    rope = ROPE["rope"]
    (d / "lcx.json").write_text(json.dumps({"methods": [{"name": "rope", "options": rope}]}))
    # 1,000 tokens of lcx's source (sdk/composition.py as of f30c367: edits to the live file changed the answers): an open continuation, which YaRN's changes show in (the bare model
    # answers a short passkey prompt the same way)
    text = (Path(__file__).resolve().parent / "rope_prompt.txt").read_text()  # a frozen copy, not the live file
    ids = tok(text, return_tensors="pt")["input_ids"][0, :1000]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    with open(tmp_path / "vllm.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lcx.integrations.vllm", "serve", str(d), "--config-format", "lcx",
                                 "--port", str(port), "--dtype", "float32", "--enforce-eager", "--served-model-name", "m",
                                 "--max-model-len", str(4 * WINDOW)],
                                env=env, stdout=log, stderr=log, start_new_session=True)
        try:
            # lcx's answers while the server starts (harness.server_starting says why)
            want, bare = hf_tokens(ids, ["rope"], ROPE), hf_tokens(ids)
            wait_ready(f"http://127.0.0.1:{port}/v1/models", proc, 900)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models") as r:
                assert json.loads(r.read())["data"][0]["max_model_len"] == 4 * WINDOW
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", headers={"content-type": "application/json"},
                                         data=json.dumps({"model": "m", "prompt": ids.tolist(), "max_tokens": NEW,
                                                          "temperature": 0, "return_token_ids": True}).encode())
            with urllib.request.urlopen(req, timeout=900) as r:
                got = json.loads(r.read())["choices"][0]["token_ids"]
        finally:
            stop(proc)
    assert got == want
    assert got != bare  # the bare model answers otherwise: the sidecar was applied
