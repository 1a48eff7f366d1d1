"""Ad hoc (2026-11-28, run as /tmp/prof/focus_phases.py; since then only the bench path made relative and a log copy to /tmp dropped): where served focusllm's
time goes before the first token, HF vs vLLM.  .venv/bin/python bench/results/focusllm-serve-phases/phases.py
(~6 min on 2 cores) -> output.txt"""
import sys, time, tempfile, torch, json
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/
from serve_throughput import prompts, run_vllm, run_hf
from lcx.integrations.vllm import ServerProcess
from lcx.session import open_session, parse_options
opts = ("focusllm.refresh=0",)
session = open_session("smollm2-135m", ["focusllm"], parse_options(opts), None)
tok = session.tokenizer
batch = prompts(tok, 8, 4096, seed=5)
m = session.run.method("focusllm")
t0 = time.perf_counter()
for ids, _ in batch:
    m.serve_request(session.run, ids, 1)
print("HF serve_request x8 (candidates):", round(time.perf_counter() - t0, 1), "threads", torch.get_num_threads(), flush=True)
dt, _ = run_hf(session, batch, 1)
print("HF generate 1 token x8:", round(dt, 1), flush=True)
serve_args = ["--method=focusllm", "-o", opts[0], "--max-model-len", str(4096 + 320)]
with tempfile.TemporaryDirectory() as tmp, ServerProcess("smollm2-135m", serve_args + ["--export-dir", f"{tmp}/export"], f"{tmp}/serve.log") as server:
    run_vllm(server, "smollm2-135m", prompts(tok, 2, 64, seed=999), 4)
    dt, _ = run_vllm(server, "smollm2-135m", batch[:1], 1); print("vLLM 1 request 1 token:", round(dt, 1), flush=True)
    dt, _ = run_vllm(server, "smollm2-135m", prompts(tok, 8, 4096, seed=6), 1); print("vLLM 8 requests 1 token:", round(dt, 1), flush=True)
    dt, _ = run_vllm(server, "smollm2-135m", prompts(tok, 8, 4096, seed=7), 64); print("vLLM 8 requests 64 tokens:", round(dt, 1), flush=True)
    pass
