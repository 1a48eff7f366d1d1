#!/usr/bin/env bash
# Issue 52's "must show" for fot at its defaults (no -o options): SmolLM2-135M, float32.
#   bash results/fot/defaults/run.sh [STEP...]     # steps: ppl passkey16 passkey32 passkey64 (default: all, in that order)
# Each step is long on 2 CPU cores (ppl ~1 h; a 16K passkey sample ~4 min, a 64K one far more): run it on an
# otherwise idle machine; the passkey grids journal every sample and continue where they stopped.
set -euo pipefail
cd "$(dirname "$0")/../../.."
LCX=${LCX:-.venv/bin/lcx}  # LCX=echo prints the commands
BOOKS=../shared/data/books
OUT=results/fot/defaults
ppl() {  # fot's defaults beside truncation (vanilla), results/fot/ppl's two books and spans, 2K..32K
    $LCX eval compare ppl -m smollm2-135m --stack fot --stack vanilla \
        -d $BOOKS/wells_invisible_man.txt -d $BOOKS/doyle_hound_of_the_baskervilles.txt \
        --contexts 2K,4K,8K,16K,32K --room 32K --target 256 --out $OUT/ppl --json
}
passkey() {  # LEN: filler passkey, 5 depths x 5 keys (seed 0)
    $LCX eval passkey -m smollm2-135m --method fot --lengths "$1" --out $OUT/passkey-$1 --resume
}
passkey16() { passkey 16K; }
passkey32() { passkey 32K; }
passkey64() { passkey 64K; }
[ $# -eq 0 ] && set -- ppl passkey16 passkey32 passkey64
for s in "$@"; do "$s"; done
