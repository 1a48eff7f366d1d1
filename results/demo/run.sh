#!/usr/bin/env bash
# results/demo/: `lcx demo` at every method's defaults, no options and no adapter (issue 52: "make demo with no
# options"), SmolLM2-135M, a 16K passkey prompt (2x its window), the key at depth 0.5.
#   bash results/demo/run.sh            # --dtype auto (bfloat16 on a CPU with AMX or avx512_bf16)
#   DTYPE=float32 bash results/demo/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
LCX=${LCX:-.venv/bin/lcx}
DTYPE=${DTYPE:-auto}
out=results/demo/defaults-$DTYPE.json
$LCX demo --dtype "$DTYPE" --json > "$out.part" && mv "$out.part" "$out"
.venv/bin/python -c "
import json, sys
for r in json.load(open(sys.argv[1])):
    print(f\"{r['method']:>10}  {'found' if r['found'] else 'missed'}  {r.get('seconds', 0):6.1f} s  {r.get('why', '')}\")
" "$out"
