#!/usr/bin/env bash
# The serving throughput bench for the methods BENCHMARKS.md had no row for (2026-11-28):
# streaming, rope and an SMT LoRA adapter (rope + LoRA), one round each at 64 and 256 new tokens,
# 8 requests of 2,048 prompt tokens, like the base model's and fot's rows.  Run alone (2 cores).
#   bash bench/results/serve_throughput-methods.sh [streaming|rope|smt ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
run() {
  case "$1" in
    streaming) $PY bench/serve_throughput.py --method streaming -o streaming.window=1024 --length 2048 --rounds 1 ;;
    rope)      $PY bench/serve_throughput.py --method rope --length 2048 --rounds 1 ;;
    smt)       $PY bench/serve_throughput.py --adapter results/smt/adapter --length 2048 --rounds 1 \
                 --out bench/results/serve_throughput-smt.json ;;
    *) echo "unknown step $1 (streaming, rope, smt)" >&2; exit 2 ;;
  esac
}
for step in "${@:-streaming rope smt}"; do for s in $step; do echo "== $s $(date -u +%FT%TZ)"; run "$s"; done; done
