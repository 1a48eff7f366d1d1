"""Ad hoc (2026-11-28): can *any* served focusllm reach 3x `lcx generate` on this machine, at the shapes of
`bench/serve_throughput.py --method focusllm -o focusllm.refresh=0 --length 4096 --new 1024`?

A served focusllm has to (a) compute every request's candidates (lcx's middleware: one chunk of 2,048
tokens + a 512-token fragment per request, compute-bound, what the HF side computes too) and (b) serve
[candidate ; 2,048 local tokens] + 1,024 new tokens per request.  The cheapest (b) vLLM can do is its own
native Llama with its own CPU attention (what a KV connector injecting the candidates' keys/values would
give: no lcx attention, no Transformers backend), prefix caching off (each request's prefix is its own
candidate).  So this measures, in one run on the same prompts:

* hf:    `lcx generate -o focusllm.refresh=0` on the 8 prompts, 1,024 new tokens each (the bench's HF side);
* cand:  the middleware's candidates for the 8 prompts (`FocusLLM.serve_request`, one after another);
* native: `lcx serve` of the bare model (vLLM's native Llama, `--no-enable-prefix-caching`), the 8 prompts'
  last 2,049 tokens sent at once, 1,024 new tokens each;

and the bound hf / (cand + native): the ratio no served focusllm exceeds here, unless it computes
candidates faster than lcx's own path.  .venv/bin/python bench/results/focusllm-serve-bound/bound.py
(~15 min on 2 cores) -> bound.json"""
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/
from serve_throughput import prompts, run_hf, run_vllm  # noqa: E402

from lcx.integrations.vllm import ServerProcess  # noqa: E402
from lcx.session import open_session, parse_options  # noqa: E402

NEW, LENGTH, LOCAL = 1024, 4096, 2048
session = open_session("smollm2-135m", ["focusllm"], parse_options(("focusllm.refresh=0",)), None)
tok = session.tokenizer
batch = prompts(tok, 8, LENGTH, seed=1000 * 2)  # serve_throughput's prompts for its third --new value
out: dict = {"new": NEW, "prompt_tokens": LENGTH, "requests": len(batch), "torch_threads": torch.get_num_threads()}
m = session.run.method("focusllm")
t0 = time.perf_counter()
for ids, _ in batch:
    m.serve_request(session.run, ids, NEW)
out["cand_s"] = round(time.perf_counter() - t0, 1)
print("candidates:", out["cand_s"], "s", flush=True)
m.release(session.run)
dt, _ = run_hf(session, batch, NEW)
out["hf_s"] = round(dt, 1)
print("hf:", out["hf_s"], "s", flush=True)
session.close()
local = [(ids[-(LOCAL + 1):], k) for ids, k in batch]  # [one candidate's slot ; 2,048 local tokens]
args = ["--max-model-len", str(LOCAL + 1 + NEW + 64)]
with tempfile.TemporaryDirectory() as tmp, \
        ServerProcess("smollm2-135m", args + ["--export-dir", f"{tmp}/export", "--", "--no-enable-prefix-caching"],
                      f"{tmp}/serve.log") as server:
    run_vllm(server, "smollm2-135m", prompts(tok, 2, 64, seed=999), 4)  # warm-up
    dt, _ = run_vllm(server, "smollm2-135m", local, 1)
    out["native_prefill_s"] = round(dt, 1)
    dt, _ = run_vllm(server, "smollm2-135m", local, NEW)  # prefix caching is off: nothing is reused
    out["native_s"] = round(dt, 1)
print("native:", out["native_prefill_s"], "s prefill,", out["native_s"], "s with", NEW, "new tokens", flush=True)
out["bound"] = round(out["hf_s"] / (out["cand_s"] + out["native_s"]), 2)
print("bound hf / (cand + native):", out["bound"], flush=True)
(Path(__file__).parent / "bound.json").write_text(json.dumps(out, indent=2))
