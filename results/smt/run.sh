#!/usr/bin/env bash
# Reproduces results/smt/ (issue 6: SMT, SmolLM2-135M 8K window toward 32K, 2 CPU cores).
#   bash results/smt/run.sh            # every step, in order
#   bash results/smt/run.sh train      # chosen steps; `train` resumes from its last checkpoint
# Training data: the six books NOT used for evaluation (wells, doyle are the ppl/passkey books).
set -euo pipefail
cd "$(dirname "$0")/../.."
LCX=.venv/bin/lcx
BOOKS=../shared/data/books
TRAIN_BOOKS=(alcott_little_men austen_pride_and_prejudice dickens_tale_of_two_cities hardy_mayor_of_casterbridge
             stevenson_treasure_island twain_tom_sawyer)
# 2,048 tokens fed per step (1,024 sampled memory + 1,024 target) + the beta=1 window of 2,048;
# positions from 8K (the model's window) growing by 8K every 40 steps: 32K from step 120 on.
SMT=(--method smt -o smt.budget=2048 -o smt.window=512 -o smt.grow_every=40 -o smt.grow_by=8192)

train() {  # ~40 s/step on 2 idle cores (bench/smt_step.py): 180 steps ~2 h; checkpoints every 5 steps
    local resume=()
    [ -d results/smt/adapter/checkpoints ] && resume=(--resume)
    $LCX train -m smollm2-135m "${SMT[@]}" $(printf -- "-d $BOOKS/%s.txt " "${TRAIN_BOOKS[@]}") \
        --seq-len 32768 --steps 180 --lr 5e-4 --warmup 10 --save-every 5 --out results/smt/adapter "${resume[@]}"
}

train_beta0() {  # the beta ablation (catastrophic forgetting check): the same run without the ordinary loss
    local resume=()
    [ -d results/smt/adapter-beta0/checkpoints ] && resume=(--resume)
    $LCX train -m smollm2-135m "${SMT[@]}" -o smt.beta=0 $(printf -- "-d $BOOKS/%s.txt " "${TRAIN_BOOKS[@]}") \
        --seq-len 32768 --steps 180 --lr 5e-4 --warmup 10 --save-every 5 --out results/smt/adapter-beta0 "${resume[@]}"
}
EVAL_BOOKS=(-d $BOOKS/wells_invisible_man.txt -d $BOOKS/doyle_hound_of_the_baskervilles.txt)
ppl_before() {  # untrained: the bare model, truncation, and YaRN x4 (8K -> 32K) without training
    $LCX eval compare ppl -m smollm2-135m --stack none --stack vanilla --stack rope -o rope.type=yarn \
        -o rope.factor=4 "${EVAL_BOOKS[@]}" --contexts 4K,8K,16K,32K --target 256 --out results/smt/ppl-before
}
ppl_after() {
    $LCX eval ppl -m smollm2-135m --adapter results/smt/adapter "${EVAL_BOOKS[@]}" --contexts 4K,8K,16K,32K \
        --target 256 --out results/smt/ppl-after
}
ppl_beta0() {
    $LCX eval ppl -m smollm2-135m --adapter results/smt/adapter-beta0 "${EVAL_BOOKS[@]}" --contexts 4K,8K,16K,32K \
        --target 256 --out results/smt/ppl-after-beta0
}
passkey_before() {  # the bare model over the whole prompt
    $LCX eval passkey -m smollm2-135m --lengths 16K,32K --out results/smt/passkey-before --resume
}
passkey_after() {
    $LCX eval passkey -m smollm2-135m --adapter results/smt/adapter --lengths 16K,32K --out results/smt/passkey-after --resume
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(train ppl_before ppl_after passkey_before passkey_after train_beta0 ppl_beta0)
for s in "${steps[@]}"; do echo "== $s"; "$s"; done
