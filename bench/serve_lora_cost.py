"""What naming a LoRA adapter costs a request on vLLM's CPU backend.

Three servers in turn (SmolLM2-135M, float32, prefix caching off): without LoRA, and with one adapter (q/k,
rank 8) twice: on vLLM's own CPU LoRA ops (``LCX_VLLM_LORA_OPS=vllm``) and on lcx's
(``lcx.integrations.vllm.lora``: one product per adapter in the batch). Each round sends 8 concurrent
1,024-token passkey prompts (12 new tokens) per model name.

    .venv/bin/python bench/serve_lora_cost.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

OUT = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT / "serve_lora_cost.json")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from lcx.adapters.peft_bridge import random_adapter
    from lcx.evals.passkey import build_prompt_ids
    from lcx.integrations.vllm import ServerProcess
    from lcx.integrations.vllm.lora import OPS_ENV
    from lcx.models import load_model, resolve_model_path

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(args.model)))
    rng = random.Random(1)
    tmp = Path(tempfile.mkdtemp(prefix="lcx-lora-cost-"))
    a1 = random_adapter(load_model(args.model)[0], tmp / "a1", 1, scale=0.02)
    rows = []
    for with_lora, ops in ((False, None), (True, "vllm"), (True, "lcx")):
        serve = ["--max-model-len", "2200", "--export-dir", str(tmp / f"export-{with_lora}-{ops}"),
                 *([f"--adapter=a1={a1}"] if with_lora else []), "--", "--no-enable-prefix-caching"]
        if ops:
            os.environ[OPS_ENV] = ops  # the server's processes inherit it
        with ServerProcess(args.model, serve, tmp / f"serve-{with_lora}-{ops}.log") as server:
            for rnd in range(args.rounds):
                batch = [build_prompt_ids(tok, 1024, rng.random(), k).tolist() for k in rng.sample(range(10000, 99999), 8)]
                for name in ([args.model, "a1"] if with_lora else [args.model]):
                    t0 = time.perf_counter()
                    with ThreadPoolExecutor(8) as ex:
                        list(ex.map(lambda p: server.complete(name, p, 12), batch))
                    row = {"lora_enabled": with_lora, "lora_ops": ops, "model": name, "round": rnd,
                           "seconds": round(time.perf_counter() - t0, 1)}
                    print(row, flush=True)
                    rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    os.environ.pop(OPS_ENV, None)
    args.out.write_text(json.dumps({"requests": 8, "prompt_tokens": 1024, "new_tokens": 12, "rows": rows}, indent=2))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
