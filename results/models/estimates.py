"""What lcx's up-front check says of 64K and 128K prompts on the catalog's new models, every method, float32
and bfloat16: the estimate's parts and whether this machine's free memory admits the request (issue 50).

    .venv/bin/python results/models/estimates.py        # writes results/models/estimates.{json,md}
"""

from __future__ import annotations

import json
from pathlib import Path

import lcx
from lcx.limits import LimitError, Limits, available_ram, check_request
from lcx.models import load_model

OUT = Path(__file__).parent
STACKS = {"none": [], "vanilla": ["vanilla"], "rope": ["rope"], "streaming": ["streaming"], "fot": ["fot"],
          "focusllm": ["focusllm"]}
OPTIONS = {"rope": {"factor": 4.0},
           # fot's defaults before issue 52 (estimates.md was made with them)
           "fot": {"local": 2048, "chunk": 0, "sinks": 0, "positions": "first", "fixed_distance": 0, "gate": "off"}}
rows = []
free = available_ram()
for name in ("gemma3-270m", "qwen2.5-0.5b"):
    for dtype in ("float32", "bfloat16"):
        model, _ = load_model(name, dtype=dtype)
        for label, methods in STACKS.items():
            with lcx.attach(model, methods, **OPTIONS.get(label, {})) as run:
                for tokens in (65536, 131072):
                    row = {"model": name, "dtype": dtype, "stack": label, "tokens": tokens}
                    try:
                        est = check_request(run, tokens, 16, limits=Limits(max_input_tokens=10**7))
                        row.update(kv_gib=est["kv_bytes"] / 2**30, forward_gib=est["forward_bytes"] / 2**30,
                                   admitted=True)
                    except LimitError as e:
                        row.update(admitted=False, error=str(e))
                    rows.append(row)
        del model
(OUT / "estimates.json").write_text(json.dumps({"free_ram_gib": free / 2**30, "rows": rows}, indent=2))
lines = [f"# The up-front memory check at 64K and 128K (free RAM when run: {free / 2**30:.1f} GiB)", "",
         "`.venv/bin/python results/models/estimates.py`; 16 new tokens; rope is YaRN x4; every method at its "
         "defaults.", "", "| model | dtype | stack | tokens | cache + memories (GiB) | largest pass (GiB) | admitted |",
         "|---|---|---|---|---|---|---|"]
for r in rows:
    kv = f"{r['kv_gib']:.2f}" if r["admitted"] else "-"
    fw = f"{r['forward_gib']:.2f}" if r["admitted"] else "-"
    lines.append(f"| {r['model']} | {r['dtype']} | {r['stack']} | {r['tokens'] // 1024}K | {kv} | {fw} | "
                 f"{'yes' if r['admitted'] else 'no: ' + r['error']} |")
(OUT / "estimates.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
