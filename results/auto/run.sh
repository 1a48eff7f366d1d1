#!/usr/bin/env bash
# Issue 52, build 3: what every method's model-dependent (auto) options come to on each catalog model, as
# `lcx methods -m MODEL` reports them (fot's memory layers measured by retrieval analysis once, then cached).
#   bash results/auto/run.sh [MODEL...]
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -eq 0 ] && set -- smollm2-135m gemma3-270m qwen2.5-0.5b
for m in "$@"; do
    .venv/bin/lcx methods -m "$m" --json > "results/auto/$m.json.new"
    mv "results/auto/$m.json.new" "results/auto/$m.json"
done
.venv/bin/python - "$@" <<'PY' > results/auto/README.md
import json, sys
rows = {m: {r["name"]: r["on_model"] for r in json.load(open(f"results/auto/{m}.json"))["methods"]} for m in sys.argv[1:]}
methods = sorted({(n, o) for r in rows.values() for n, opts in r.items() for o in opts})
print("# Each model's `auto` choices\n\n`bash results/auto/run.sh` (`lcx methods -m MODEL --json`; one JSON per model here)."
      "\nfot's memory layers: a model with sliding-window layers gets its full-attention layers; any other gets the"
      " layers `lcx analyze retrieval` finds retrieving on its own probes (cached beside the model).\n")
print("| method.option | " + " | ".join(rows) + " |\n|---|" + "---|" * len(rows))
for n, o in methods:
    print(f"| {n}.{o} | " + " | ".join(str(rows[m].get(n, {}).get(o, "")) for m in rows) + " |")
PY
cat results/auto/README.md
