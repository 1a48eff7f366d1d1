#!/usr/bin/env bash
# Reproduces results/smt/ (issue 6: SMT, SmolLM2-135M 8K window toward 32K, 2 CPU cores).
#   bash results/smt/run.sh            # every step, in order
#   bash results/smt/run.sh train      # chosen steps; `train` resumes from its last checkpoint
# Training data: the six books NOT used for evaluation (wells, doyle are the ppl/passkey books).
set -euo pipefail
cd "$(dirname "$0")/../.."
LCX=${LCX:-.venv/bin/lcx}  # LCX=echo prints the commands
BOOKS=../shared/data/books
TRAIN_BOOKS=(alcott_little_men austen_pride_and_prejudice dickens_tale_of_two_cities hardy_mayor_of_casterbridge
             stevenson_treasure_island twain_tom_sawyer)
# SMT on top of YaRN x4 (the issue's "SMT on top of NTK/YaRN scaling"): rope stretches 8K -> 32K positions,
# SMT fine-tunes q/k (LoRA) on 32K-token windows while feeding 2,048 tokens per step (1,024 sampled memory
# tokens at their original positions + 1,024 target tokens) + the beta=1 ordinary window of 2,048 tokens.
# The first attempt, SMT alone growing 8K -> 32K by 8K every 40 steps, is kept in smt-only-attempt/: its SMT
# loss jumped from 3.2 to 6-7 when the range reached 16K and was still ~6.0 25 steps later (see README.md).
SMT=(--method rope -o rope.type=yarn -o rope.factor=4 --method smt -o smt.budget=2048 -o smt.window=512)
STEPS=120

train() {  # 120 steps x ~60 s on 2 cores = ~2 h (the issue's CPU budget); checkpoints every 5 steps
    local resume=()
    [ -d results/smt/adapter/checkpoints ] && resume=(--resume)
    $LCX train -m smollm2-135m "${SMT[@]}" $(printf -- "-d $BOOKS/%s.txt " "${TRAIN_BOOKS[@]}") \
        --seq-len 32768 --steps $STEPS --lr 5e-4 --warmup 10 --save-every 5 --out results/smt/adapter "${resume[@]}"
}

train_beta0() {  # the beta ablation (catastrophic forgetting check): the same run without the ordinary loss
    local resume=()
    [ -d results/smt/adapter-beta0/checkpoints ] && resume=(--resume)
    $LCX train -m smollm2-135m "${SMT[@]}" -o smt.beta=0 $(printf -- "-d $BOOKS/%s.txt " "${TRAIN_BOOKS[@]}") \
        --seq-len 32768 --steps $STEPS --lr 5e-4 --warmup 10 --save-every 5 --out results/smt/adapter-beta0 "${resume[@]}"
}
EVAL_BOOKS=(-d $BOOKS/wells_invisible_man.txt -d $BOOKS/doyle_hound_of_the_baskervilles.txt)
# Cost on 2 cores: one full-attention pass over 32K tokens ~6 min, over 16K ~1.5 min.
ppl_before() {  # untrained: truncation to the 8K window, YaRN x4 (8K -> 32K) without training, and the bare
                # model over the whole context (to 16K only: it has exploded there already, see harness/ppl/)
    $LCX eval compare ppl -m smollm2-135m --stack vanilla --stack rope -o rope.type=yarn -o rope.factor=4 \
        "${EVAL_BOOKS[@]}" --contexts 4K,8K,16K,32K --target 256 --out results/smt/ppl-before
    $LCX eval ppl -m smollm2-135m "${EVAL_BOOKS[@]}" --contexts 4K,8K,16K --room 32K --target 256 \
        --out results/smt/ppl-before-none  # --room 32K: the spans the other rows score
}
ppl_after() {
    $LCX eval ppl -m smollm2-135m --adapter results/smt/adapter "${EVAL_BOOKS[@]}" --contexts 4K,8K,16K,32K \
        --target 256 --out results/smt/ppl-after
}
ppl_beta0() {  # the ablation is about the 4K perplexity (forgetting inside the window); the same contexts as
               # ppl_after, so both score the same span (lcx eval ppl puts it after the largest context)
    $LCX eval ppl -m smollm2-135m --adapter results/smt/adapter-beta0 "${EVAL_BOOKS[@]}" --contexts 4K,8K,16K,32K \
        --target 256 --out results/smt/ppl-after-beta0
}
forgetting() {  # the beta ablation on more text: 4K context only, 8 spans per book (16 x 256 scored tokens),
                # the bare model, YaRN x4 untrained, and the two adapters on the same spans
    $LCX eval ppl -m smollm2-135m "${EVAL_BOOKS[@]}" --contexts 4K --samples 8 --out results/smt/forgetting/bare
    $LCX eval ppl -m smollm2-135m --method rope -o rope.type=yarn -o rope.factor=4 "${EVAL_BOOKS[@]}" --contexts 4K \
        --samples 8 --out results/smt/forgetting/yarn
    $LCX eval ppl -m smollm2-135m --adapter results/smt/adapter "${EVAL_BOOKS[@]}" --contexts 4K --samples 8 \
        --out results/smt/forgetting/beta1
    $LCX eval ppl -m smollm2-135m --adapter results/smt/adapter-beta0 "${EVAL_BOOKS[@]}" --contexts 4K --samples 8 \
        --out results/smt/forgetting/beta0
}
# Passkey grids sized to the CPU: depths 0.1, 0.5, 0.9, one key each, per length.
GRID=(--depths 0.1,0.5,0.9 --samples 1)
passkey_before() {  # the bare model over the whole prompt (16K only: it cannot read past its 8K window)
    $LCX eval passkey -m smollm2-135m --lengths 16K "${GRID[@]}" --out results/smt/passkey-before --resume
}
passkey_yarn() {  # YaRN x4 without training: the "before" of this recipe
    $LCX eval passkey -m smollm2-135m --method rope -o rope.type=yarn -o rope.factor=4 --lengths 16K,32K \
        "${GRID[@]}" --out results/smt/passkey-yarn --resume
}
passkey_after() {
    $LCX eval passkey -m smollm2-135m --adapter results/smt/adapter --lengths 16K,32K "${GRID[@]}" \
        --out results/smt/passkey-after --resume
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(train ppl_before ppl_after passkey_before passkey_yarn passkey_after train_beta0 ppl_beta0 forgetting)
for s in "${steps[@]}"; do echo "== $s"; "$s"; done
