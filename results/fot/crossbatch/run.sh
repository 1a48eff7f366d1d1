#!/usr/bin/env bash
# Reproduces results/fot/crossbatch/ (issue 5: a short crossbatch LoRA fine-tune of SmolLM2-135M on the
# books, then the issue-4 measurements again with the adapter: passkey 16K, perplexity, distraction).
#   bash results/fot/crossbatch/run.sh               # every step, in order
#   bash results/fot/crossbatch/run.sh passkey16     # chosen steps
# Budget (1 thread of the 2-core CI machine): train 150 steps x 4 rows x 512 tokens = 307K tokens, ~40 min;
# passkey16 ~30 min, ppl ~10 min, ppl_control ~5 min, distraction ~5 min. The "before" figures are results/fot/{passkey-16k,ppl,distraction}.
set -euo pipefail
cd "$(dirname "$0")/../../.."
LCX=${LCX:-.venv/bin/lcx}  # LCX=echo prints the commands
BOOKS=../shared/data/books
OUT=results/fot/crossbatch
ML=6,7,8,14,15,17,18,19,20,21,22,23   # results/fot/retrieval's layers, as in issue 4's runs
# inference configuration of issue 4 (results/fot/run.sh), so the before/after figures compare directly
FOT=(-o fot.local=1024 -o fot.chunk=256 -o fot.memory_layers=$ML)

train() {  # crossbatch: local 256, rows of 2 contexts (w=1), each memory layer sees its row's document + 3 others
    local resume=(); [ -d $OUT/adapter/checkpoints ] && resume=(--resume)   # an interrupted run continues
    $LCX train -m smollm2-135m --method fot -o fot.local=256 -o fot.w=1 -o fot.d=4 -o fot.memory_layers=$ML \
        -o fot.chunk=0 -o fot.sinks=0 -o fot.positions=first -o fot.fixed_distance=0 -o fot.gate=off \
        -d $BOOKS --seq-len 512 --batch-size 4 --steps 150 --lr 3e-4 --warmup 10 --schedule cosine \
        --save-every 25 --out $OUT/adapter "${resume[@]}"
}
passkey16() {
    $LCX eval passkey -m smollm2-135m --adapter $OUT/adapter "${FOT[@]}" --lengths 16K \
        --out $OUT/passkey-16k --resume
}
ppl() {
    $LCX eval ppl -m smollm2-135m --adapter $OUT/adapter "${FOT[@]}" -o fot.backend=faiss-ivf \
        -d $BOOKS/wells_invisible_man.txt -d $BOOKS/doyle_hound_of_the_baskervilles.txt \
        --contexts 2K,4K,8K,16K,32K --target 256 --out $OUT/ppl
}
ppl_control() {  # the same adapter without memory attention (vanilla: truncation to the 8K window): what the
                # LoRA does to perplexity on its own (novel-domain adaptation; doyle's scored span was in the training data)
    $LCX eval ppl -m smollm2-135m --adapter $OUT/adapter --method vanilla \
        -d $BOOKS/wells_invisible_man.txt -d $BOOKS/doyle_hound_of_the_baskervilles.txt \
        --contexts 2K,4K,8K,16K,32K --target 256 --out $OUT/ppl-vanilla
}
distraction() {  # same settings as results/fot/run.sh distraction (the "before"), added to its plot
    $LCX analyze distraction -m smollm2-135m --adapter $OUT/adapter -d $BOOKS -o local=256 -o memory_layers=$ML \
        --ds 1,2,4,8 --batches 3 --label "SmolLM2-135M + crossbatch LoRA" --out results/fot/distraction
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(train passkey16 ppl ppl_control distraction)
for s in "${steps[@]}"; do echo "== $s"; "$s"; done
