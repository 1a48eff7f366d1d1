#!/usr/bin/env bash
# Issue 52, build 2: fot configurations whose perplexity on ordinary text is not worse than truncation to the
# window, measured side by side with truncation (vanilla), SmolLM2-135M, two books (as results/fot/run.sh ppl).
#   bash results/fot/ppl-safe/run.sh [STEP...]     # steps: local8k gate sinks
set -euo pipefail
cd "$(dirname "$0")/../../.."
LCX=.venv/bin/lcx
BOOKS=../shared/data/books
DOCS=(-d $BOOKS/wells_invisible_man.txt -d $BOOKS/doyle_hound_of_the_baskervilles.txt)
IVF=(-o fot.backend=faiss-ivf)  # exact below 32,768 entries, as results/fot/ppl
local8k() {  # the local window at the model's window (8K): memory adds only what truncation drops
    $LCX eval compare ppl -m smollm2-135m --stack fot --stack vanilla -o fot.local=8192 -o fot.chunk=256 "${IVF[@]}" \
        "${DOCS[@]}" --contexts 2K,4K,8K,16K,32K --target 256 --out results/fot/ppl-safe/local8k --json
}
gate() {  # the passkey configuration (local 1024) with memory read only where it beats the local keys (gate 0)
    $LCX eval compare ppl -m smollm2-135m --stack fot -o fot.local=1024 -o fot.chunk=256 -o fot.gate=0 "${IVF[@]}" \
        "${DOCS[@]}" --contexts 8K,32K --room 32K --target 256 --out results/fot/ppl-safe/gate0 --json
}
sinks() {  # local at the window, the prompt's first 4 tokens kept beside it (attention sinks)
    $LCX eval compare ppl -m smollm2-135m --stack fot -o fot.local=8192 -o fot.chunk=256 -o fot.sinks=4 "${IVF[@]}" \
        "${DOCS[@]}" --contexts 8K,16K,32K --room 32K --target 256 --out results/fot/ppl-safe/sinks --json
}
[ $# -eq 0 ] && set -- local8k gate sinks
for s in "$@"; do "$s"; done
