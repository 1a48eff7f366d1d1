"""Ad hoc (2026-11-28): time before the first token of served focusllm (KV connector) for the serve_throughput
bench's shape (8 prompts of 4,096 tokens, chunk/local 2,048), the 8 requests sent at once vs one after
another (1 new token each; fresh prompts each time).  If "at once" takes longer, the middleware's candidate
forwards and vLLM's prefills slow each other down when they overlap on the 2 cores.
    .venv/bin/python bench/results/focusllm-connector-checks/ttft.py [OUT]  (~4 min) -> ttft.json or OUT
ttft.json: the middleware computed the candidates on lcx's path (87414db); ttft-engine.json: vLLM's engine runs
the chunk forwards (this file's second run, 2026-11-28)."""
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/
from serve_throughput import prompts  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from lcx.integrations.vllm import ServerProcess  # noqa: E402
from lcx.models import resolve_model_path  # noqa: E402

MODEL = "smollm2-135m"
tok = AutoTokenizer.from_pretrained(str(resolve_model_path(MODEL)))
out = {}
with tempfile.TemporaryDirectory() as tmp, ServerProcess(MODEL, ["--method", "focusllm", "-o", "focusllm.refresh=0",
                                                                  "--export-dir", f"{tmp}/export"], f"{tmp}/serve.log") as s:
    s.complete(MODEL, prompts(tok, 1, 4096, seed=998)[0][0], 1)  # warm-up
    for name, seed in (("one_after_another_s", 21), ("at_once_s", 22), ("one_after_another_again_s", 23)):
        batch = [p for p, _ in prompts(tok, 8, 4096, seed=seed)]
        t0 = time.perf_counter()
        if name.startswith("at_once"):
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda p: s.complete(MODEL, p, 1), batch))
        else:
            for p in batch:
                s.complete(MODEL, p, 1)
        out[name] = round(time.perf_counter() - t0, 1)
        print(name, out[name], flush=True)
(Path(__file__).parent / (sys.argv[1] if len(sys.argv) > 1 else "ttft.json")).write_text(json.dumps(out, indent=2))
