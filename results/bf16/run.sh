#!/usr/bin/env bash
# Quality parity of bfloat16 with float32 on SmolLM2-135M (issue 49): the fot passkey grids and the fot / rope / smt
# perplexity tables of results/fot and results/smt, rerun with --dtype bfloat16 (same commands otherwise), then
# compared with the float32 files by compare.py.
#   bash results/bf16/run.sh               # every step, in order (journals: an interrupted step continues)
#   bash results/bf16/run.sh ppl_fot       # chosen steps
set -euo pipefail
cd "$(dirname "$0")/../.."
LCX=${LCX:-.venv/bin/lcx}  # LCX=echo prints the commands
BOOKS=../shared/data/books
BF16=(--dtype bfloat16)
FOT=(-o fot.local=1024 -o fot.chunk=256 -o fot.memory_layers=6,7,8,14,15,17,18,19,20,21,22,23)
# fot's defaults before issue 52 (these results were made with them)
FOT+=(-o fot.sinks=0 -o fot.positions=first -o fot.fixed_distance=0 -o fot.gate=off)
EVAL_BOOKS=(-d $BOOKS/wells_invisible_man.txt -d $BOOKS/doyle_hound_of_the_baskervilles.txt)

ppl_fot() {  # results/fot/run.sh ppl
    $LCX eval compare ppl -m smollm2-135m --stack fot --stack vanilla "${FOT[@]}" -o fot.backend=faiss-ivf \
        "${EVAL_BOOKS[@]}" --contexts 2K,4K,8K,16K,32K --target 256 "${BF16[@]}" --out results/bf16/fot-ppl
}
ppl_rope() {  # results/smt/run.sh ppl_before (truncation and YaRN x4, untrained)
    $LCX eval compare ppl -m smollm2-135m --stack vanilla --stack rope -o rope.type=yarn -o rope.factor=4 \
        "${EVAL_BOOKS[@]}" --contexts 4K,8K,16K,32K --target 256 "${BF16[@]}" --out results/bf16/smt-ppl-before
}
ppl_smt() {  # results/smt/run.sh ppl_after (the YaRN x4 + SMT adapter)
    $LCX eval ppl -m smollm2-135m --adapter results/smt/adapter "${EVAL_BOOKS[@]}" --contexts 4K,8K,16K,32K \
        --target 256 "${BF16[@]}" --out results/bf16/smt-ppl-after
}
passkey16() {  # results/fot/run.sh passkey16, the fot stack
    $LCX eval compare passkey -m smollm2-135m --stack fot --lengths 16K "${FOT[@]}" "${BF16[@]}" \
        --out results/bf16/fot-passkey-16k --resume
}
passkey32() {  # results/fot/run.sh passkey32, the fot stack
    $LCX eval compare passkey -m smollm2-135m --stack fot --lengths 32K "${FOT[@]}" -o fot.backend=faiss-ivf \
        "${BF16[@]}" --out results/bf16/fot-passkey-32k --resume
}
compare() {
    .venv/bin/python results/bf16/compare.py
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(ppl_fot ppl_rope ppl_smt passkey16 passkey32 compare)
for s in "${steps[@]}"; do echo "== $s"; "$s"; done
