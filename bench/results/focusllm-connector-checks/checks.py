"""Ad hoc (2026-11-28): two checks of focusllm served through lcx's KV connector that the CI tests do not make.

1. Preemption: a server with a KV cache too small for 8 concurrent answers (``--kv-cache-gib 0.1``) has to
   preempt running requests and recompute them from their prompts, loading their candidates again; the
   tokens must still equal `lcx generate`'s.  The reloads are counted from the connector's log lines.
2. Time to first token: the 8 requests sent at once vs one after another (1 new token each), to see what
   the middleware's candidates and vLLM's prefill cost when they share the 2 cores.

    .venv/bin/python bench/results/focusllm-connector-checks/checks.py [OUT [MAX_MODEL_LEN]]  (~6 min) -> output.json or OUT
output.json: the middleware computed the candidates on lcx's path (665a5f5); output-engine.json: vLLM's engine
runs the chunk forwards, whose own preemptions are counted too (2026-11-28)."""
import json
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lcx.evals.passkey import build_prompt_ids
from lcx.generation import generate
from lcx.integrations.vllm import ServerProcess
from lcx.session import open_session

MODEL, NEW = "smollm2-135m", 300  # 513 prompt tokens + 300 span 2 more of vLLM's 128-token blocks
opts = {"refresh": 0, "local": 512}
session = open_session(MODEL, ["focusllm"], {"focusllm": opts}, None)
tok = session.tokenizer
rng = random.Random(11)
jobs = [build_prompt_ids(tok, 1400, rng.uniform(0.1, 0.9), k).tolist() for k in rng.sample(range(10000, 99999), 8)]
want = [generate(session.run, torch.tensor([j]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0].tolist()
        for j in jobs]
session.close()
out = {}
# 2,048: the chunk forwards (~1,400 tokens) fit the engine's limit, so vLLM runs them (at 1,024, output.json's
# run, the middleware ran them on lcx's path)
args = ["--method", "focusllm", "-o", "focusllm.refresh=0", "-o", "focusllm.local=512",
        "--max-model-len", sys.argv[2] if len(sys.argv) > 2 else "2048", "--kv-cache-gib", "0.1"]
with tempfile.TemporaryDirectory() as tmp, ServerProcess(MODEL, args + ["--export-dir", f"{tmp}/export"],
                                                         f"{tmp}/serve.log") as s:
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda j: s.complete(MODEL, j, NEW, min_tokens=NEW, ignore_eos=True), jobs))
    log = s.log_path.read_text()
    out["preemptions"] = log.count("candidates are loaded again")
    out["chunk_forward_preemptions"] = log.count("computed again")
    out["chunk_forwards_on_the_engine"] = "chunk forwards run on vLLM's engine" in log
    out["equal_to_lcx_generate"] = sum(g == w for g, w in zip(got, want))
    print("preemptions:", out["preemptions"], "answers equal to lcx generate:", out["equal_to_lcx_generate"], "/ 8",
          flush=True)
    fresh = [j[1:] + j[:1] for j in jobs]  # other tokens, the same work
    t0 = time.perf_counter()
    for j in fresh:
        s.complete(MODEL, j, 1)
    out["one_after_another_s"] = round(time.perf_counter() - t0, 1)
    fresh = [j[2:] + j[:2] for j in jobs]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda j: s.complete(MODEL, j, 1), fresh))
    out["at_once_s"] = round(time.perf_counter() - t0, 1)
    print("8 requests, 1 token each: one after another", out["one_after_another_s"], "s, at once", out["at_once_s"], "s",
          flush=True)
(Path(__file__).parent / (sys.argv[1] if len(sys.argv) > 1 else "output.json")).write_text(json.dumps(out, indent=2))
sys.exit(0 if out["equal_to_lcx_generate"] == 8 else 1)
