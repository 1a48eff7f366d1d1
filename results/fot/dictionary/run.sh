#!/usr/bin/env bash
# FoT's dictionary lookup (appendix F, issue 5), scaled to this CPU machine.
#   bash results/fot/dictionary/run.sh              # every step, in order (~60 min of fot training, ~55 min of evaluation)
#   bash results/fot/dictionary/run.sh eval_s3      # chosen steps
# A 4-layer llama (hidden 128, 4 heads, ~0.8M parameters, the task's 68-token vocabulary) trained from
# scratch by `lcx train` with fot crossbatch memory attention in every layer, the paper's loss (queried
# values only).  Documents: first half definitions (<k> 4 key tokens <v> 4 value tokens), second half
# queries; a row holds 2 contexts of `local` tokens (w = 1), so the queries reach the definitions only
# through memory attention.
#   warmup: 80-token documents, local 40, d = 1, 900 steps, lr 3e-3 (a model trained from scratch directly
#           at local 256 stays at the uniform loss ln 64 = 4.16 for 300 steps: logs/direct256.metrics.jsonl)
#   s1:     512-token documents, local 256, d = 1, 150 steps, lr 1e-3
#   s2:     from s1, d = 16 (up to 15 other documents' definitions as negatives), 150 steps, lr 1e-3
#   s3:     from s2, d = 32, batch 32, 80 steps, lr 1e-3
#   s4:     from s3, rows of two 512-token documents (task:dictionary:512, --seq-len 1024, w = 3), each context
#           seeing the one before it and 31 contexts of other rows; 30 steps, lr 1e-3, 2 threads (6.1 min)
#   l1_s1, l1_s2, l1_s3: s1-s3 again from the warmup model with memory attention in layer 1 only
#   l1_bank: from l1_s3, 20 steps against a bank of earlier steps' contexts at lr 2e-4 (the goal's model:
#            warmup + l1_s1-s3 + l1_bank is ~26 min of steps, quiet)
# Baseline without memory: the same model, curriculum and step counts with plain attention (`--method
# vanilla`, the whole 80- / 512-token document in one window).
# Evaluation: `lcx eval dictionary`, kNN memory (k = 32, exact search), 256 query tokens (25 queries) after
# 512 ... 64K dictionary tokens; the baseline reads the last 512 tokens (its window).
# Training times are each stage's summed step times (the `seconds` of metrics.jsonl), also in the README.
set -euo pipefail
cd "$(dirname "$0")/../../.."
LCX=${LCX:-.venv/bin/lcx}
OUT=results/fot/dictionary
RUNS=${DICT_RUNS:-out/dictionary}   # model folders (not committed)
SIZES=${DICT_SIZES:-512,1K,4K,16K,64K}
SAMPLES=${DICT_SAMPLES:-4}          # documents per size (25 queries each); a 64K document takes ~2.5 min
# fot's defaults before issue 52 (these results were made with them; chunk 0 = local, also in warmup's local 40)
FOT_BEFORE=(-o fot.chunk=0 -o fot.sinks=0 -o fot.positions=first -o fot.fixed_distance=0 -o fot.gate=off)
FOT=(--method fot -o fot.w=1 -o fot.memory_layers=all "${FOT_BEFORE[@]}")
TASK=(--full all -d task:dictionary --save-every 50)

init() {
    $LCX models init $RUNS/init --family llama -s vocab_size=68 -s hidden_size=128 -s num_hidden_layers=4 \
        -s num_attention_heads=4 -s num_key_value_heads=4 -s intermediate_size=512 -s max_position_embeddings=512 \
        --overwrite
}
log() { mkdir -p $OUT/logs && cp $RUNS/$1/metrics.jsonl $OUT/logs/$1.metrics.jsonl; }
explore64k() {  # explore64k MODEL K [METHOD OPTIONS...]: 64K on seed 99's 3 documents (explore/: not the
                # table's), kNN k = K; options default to memory in every layer, local 256
    local m=$1 k=$2; shift 2
    local opts=("$@"); [ ${#opts[@]} -eq 0 ] && opts=("${FOT[@]}" -o fot.local=256)
    $LCX eval dictionary -m $RUNS/$m "${opts[@]}" -o fot.k=$k --dict-tokens 64K --samples 3 \
        --seed 99 --label "$m k=$k" --out $RUNS/eval-$m-k$k
    cp $RUNS/eval-$m-k$k/dictionary.json $OUT/explore/$m.64k-k$k.json
}
bank_train() {  # bank_train FROM TO STEPS SAVE_EVERY: d = 32 plus a bank of the last ${BANK:-128} contexts of earlier
                # steps (no gradient), each query attending to its top-32 bank keys (fot.bank, fot.bank_k)
    $LCX train -m $RUNS/$1 "${FOT[@]}" -o fot.local=256 -o fot.d=32 -o fot.bank=${BANK:-128} -o fot.bank_k=32 "${TASK[@]}" \
        --seq-len 512 --batch-size 32 --warmup 2 --steps $3 --lr 1e-3 --save-every $4 --out $RUNS/$2 --overwrite
    cp $RUNS/$2/metrics.jsonl $OUT/explore/$2.metrics.jsonl
}
warmup() {
    $LCX train -m $RUNS/init "${FOT[@]}" -o fot.local=40 "${TASK[@]}" --seq-len 80 --batch-size 64 --warmup 50 \
        --steps 900 --lr 3e-3 --out $RUNS/warmup --overwrite
    log warmup
}
s1() {
    $LCX train -m $RUNS/warmup "${FOT[@]}" -o fot.local=256 -o fot.d=1 "${TASK[@]}" --seq-len 512 --batch-size 16 \
        --warmup 20 --steps 150 --lr 1e-3 --out $RUNS/s1 --overwrite
    log s1
}
s2() {
    $LCX train -m $RUNS/s1 "${FOT[@]}" -o fot.local=256 -o fot.d=16 "${TASK[@]}" --seq-len 512 --batch-size 16 \
        --warmup 10 --steps 150 --lr 1e-3 --out $RUNS/s2 --overwrite
    log s2
}
s3() {
    $LCX train -m $RUNS/s2 "${FOT[@]}" -o fot.local=256 -o fot.d=32 "${TASK[@]}" --seq-len 512 --batch-size 32 \
        --warmup 5 --steps 80 --lr 1e-3 --out $RUNS/s3 --overwrite
    log s3
}
s4() {  # from s3: rows of two 512-token documents back to back (4 contexts, w = 3); each context sees only the
        # one before it (a document's queries see its definitions; the second document's definitions are read
        # with the first document's queries in memory, as every definition window after the first is at
        # evaluation) and 31 contexts of earlier rows; 2 torch threads
    OMP_NUM_THREADS=2 $LCX train -m $RUNS/s3 --method fot -o fot.w=3 -o fot.segments=0:0,1:31,2:31,3:31 \
        -o fot.memory_layers=all -o fot.local=256 -o fot.d=16 --full all -d task:dictionary:512 --save-every 10 \
        "${FOT_BEFORE[@]}" \
        --seq-len 1024 --batch-size 16 --warmup 3 --steps 30 --lr 1e-3 --out $RUNS/s4 --overwrite
    log s4
}
s3_topk() {  # from s3: 80 more steps at d = 32 with each query attending to its top-32 memory keys only
            # (fot.train_k, as kNN retrieval at evaluation), against explore/s3-plus-80-d32 (dense, same steps)
    $LCX train -m $RUNS/s3 "${FOT[@]}" -o fot.local=256 -o fot.d=32 -o fot.train_k=32 "${TASK[@]}" --seq-len 512 \
        --batch-size 32 --warmup 5 --steps 80 --lr 1e-3 --out $RUNS/s3-topk32 --overwrite
    log s3-topk32
}
explore_topk() {  # 64K on seed 99's documents, k = 32 and 8
    for k in 32 8; do explore64k s3-topk32 $k; done
}
s3_near() {  # from s3: 40 steps at d = 32 on documents where half of the keys are near misses (each keeps 2 of an
            # earlier key's 4 symbols in place: task:dictionary:near=0.5), ~12 min on one thread
    $LCX train -m $RUNS/s3 "${FOT[@]}" -o fot.local=256 -o fot.d=32 --full all -d task:dictionary:near=0.5 \
        --save-every 10 --seq-len 512 --batch-size 32 --warmup 5 --steps 40 --lr 1e-3 --out $RUNS/s3-near50 --overwrite
    cp $RUNS/s3-near50/metrics.jsonl $OUT/explore/s3-near50.metrics.jsonl
}
s3_bank() {  # from s3: d = 32 plus a bank of the last 128 contexts of earlier steps (32K keys, no gradient), each
            # query attending to its top-32 bank keys as kNN retrieval hands them at 64K (fot.bank, fot.bank_k)
    bank_train s3 s3-bank ${BANK_STEPS:-20} 5
}
s3_bank_more() {  # 20 more bank steps from s3-bank (over the 45-minute budget: does the trend go on?)
    bank_train s3-bank s3-bank40 20 5
    explore64k s3-bank40 32
}
s2_bank() {  # in place of s3: from s2, d = 32 with the bank from the first step, 40 steps (warmup + s1 + s2 + this
            # stay inside the 45-minute budget: s3's 80 dense steps are skipped), then 64K on seed 99's documents
    bank_train s2 s2-bank ${BANK_STEPS:-40} 5
    explore64k s2-bank 32
}
s3_bank_80() {  # 40 more bank steps from s3-bank40 (80 in all, far over the budget): can the bank reach 90% at 64K?
    bank_train s3-bank40 s3-bank80 40 10
    for k in 32 8; do explore64k s3-bank80 $k; done
}
# l1: one memory layer (layer 1, where the all-layer models do their lookup: "Memory layers at inference" in
# results/README.md).  Memory attention in layers 0, 2 and 3 costs ~3/4 of a d = 32 step and is not used.
# The same curriculum from the same warmup model, every stage with fot.memory_layers=1, then 20 steps
# against a bank of the last 256 contexts of earlier steps (64K entries, as many as a 64K dictionary) at
# lr 2e-4: at 1e-3 the bank's keys, computed by earlier steps' weights, go stale within the 4 steps they are
# kept and distract less than a fresh memory does (l1_bank_lr1e3: 64K 0.79 after 40 steps).
L1=(--method fot -o fot.w=1 -o fot.memory_layers=1 -o fot.local=256 "${FOT_BEFORE[@]}")
l1_stage() {  # l1_stage FROM TO D BATCH WARMUP STEPS LR [extra lcx train options]
    local from=$1 to=$2 d=$3 batch=$4 warm=$5 steps=$6 lr=$7; shift 7
    $LCX train -m $RUNS/$from "${L1[@]}" -o fot.d=$d "${TASK[@]}" "$@" --seq-len 512 --batch-size $batch \
        --warmup $warm --steps $steps --lr $lr --out $RUNS/$to --overwrite
    log $to
}
l1_s1() { l1_stage warmup l1-s1 1 16 20 150 1e-3; }
l1_s2() { l1_stage l1-s1 l1-s2 16 16 10 150 1e-3; }
l1_s3() { l1_stage l1-s2 l1-s3 32 32 5 80 1e-3; }
l1_bank() { l1_stage l1-s3 l1-bank 32 32 2 20 2e-4 -o fot.bank=256 -o fot.bank_k=32 --save-every 10; }
keep_l1() {  # the l1-bank model (4.3 MB) committed as model/, to evaluate without training it
    mkdir -p $OUT/model
    cp $RUNS/l1-bank/{config.json,generation_config.json,lcx.json,model.safetensors,train_config.json} $OUT/model/
}
l1_bank_lr1e3() {  # explored first: the same bank at lr 1e-3, 40 steps (over the budget with l1_s1-s3)
    l1_stage l1-s3 l1-bank-lr1e3 32 32 2 40 1e-3 -o fot.bank=256 -o fot.bank_k=32 --save-every 10
    l1_bank_lr1e3_explore
}
l1_explore() { explore64k "$1" "$2" "${L1[@]}"; }  # l1_explore MODEL K: explore64k, memory in layer 1
explore_l1() {  # 64K on seed 99's documents: l1-s3 (k = 32, 8), l1-bank (k = 32, 8, 4); what l1-s3's search ranks first
    for k in 32 8; do l1_explore l1-s3 $k; done
    for k in 32 8 4; do l1_explore l1-bank $k; done
    .venv/bin/python $OUT/retrieved.py $RUNS/l1-s3 --memory-layers 1 --dict-tokens 64K --samples 2 --seed 99 \
        --out $OUT/explore/l1-s3.64k-retrieved.json > /dev/null
}
explore_bank() {  # 64K on seed 99's documents (explore/: not the table's), k = 32 and 8
    for k in 32 8; do explore64k s3-bank $k; done
}
explore_s3() {  # 64K on seed 99's documents (3, ~3 min each): s3 at k = 1 and 4 (k = 32: explore/s3.64k.json),
                # s3 with memory in layer 1 only, s3-near50 at k = 32; then what kNN ranks first (retrieved.py)
    for k in 1 4; do explore64k s3 $k; done
    $LCX eval dictionary -m $RUNS/s3 --method fot -o fot.memory_layers=1 -o fot.local=256 -o fot.k=32 --dict-tokens 64K \
        "${FOT_BEFORE[@]}" --samples 3 --seed 99 --label "s3 layer1" --out $RUNS/eval-s3-layer1
    cp $RUNS/eval-s3-layer1/dictionary.json $OUT/explore/s3.64k-layer1.json
    $LCX eval dictionary -m $RUNS/s3-near50 "${FOT[@]}" -o fot.local=256 -o fot.k=32 --dict-tokens 64K --samples 3 \
        --seed 99 --label "s3-near50" --out $RUNS/eval-s3-near50
    cp $RUNS/eval-s3-near50/dictionary.json $OUT/explore/s3-near50.64k.json
    for m in s3 s3-near50; do
        .venv/bin/python $OUT/retrieved.py $RUNS/$m --dict-tokens 64K --samples 2 --seed 99 \
            --out $OUT/explore/$m.64k-retrieved.json > /dev/null
    done
}
baseline() {  # plain attention, same curriculum
    $LCX train -m $RUNS/init --method vanilla "${TASK[@]}" --seq-len 80 --batch-size 64 --warmup 50 --steps 900 \
        --lr 3e-3 --out $RUNS/baseline-warmup --overwrite
    log baseline-warmup
    $LCX train -m $RUNS/baseline-warmup --method vanilla "${TASK[@]}" --seq-len 512 --batch-size 16 --warmup 30 \
        --steps 300 --lr 5e-4 --out $RUNS/baseline --overwrite
    log baseline
}
evaluate_fot() {  # evaluate_fot STAGE "D" [SIZES]
    $LCX eval dictionary -m $RUNS/$1 "${FOT[@]}" -o fot.local=256 -o fot.k=32 --dict-tokens ${3:-$SIZES} \
        --samples $SAMPLES --label "fot $1 (d = $2)" --out $OUT
}
eval_s1() { evaluate_fot s1 1 512,1K,4K,16K; }  # 64K left out for time: 0.27 at 16K already
eval_s2() { evaluate_fot s2 16; }
eval_s3() { evaluate_fot s3 32; }
eval_s4() { OMP_NUM_THREADS=2 evaluate_fot s4 "16, 2-document rows"; }
eval_l1() {  # the l1 model after its bank steps; 128K too, now that a 64K document takes ~35 s
    $LCX eval dictionary -m $RUNS/l1-bank "${L1[@]}" -o fot.k=32 --dict-tokens $SIZES,128K --samples $SAMPLES \
        --label "fot l1 (memory in layer 1, d = 32, + 20 bank steps)" --out $OUT
}
l1_bank_lr1e3_explore() { for k in 32 8 4; do l1_explore l1-bank-lr1e3 $k; done; }
eval_baseline() {
    $LCX eval dictionary -m $RUNS/baseline --method vanilla -o vanilla.head_fraction=0 --dict-tokens $SIZES \
        --samples $SAMPLES --label "no memory (plain attention, window 512)" --out $OUT
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(init warmup s1 s2 s3 s4 l1_s1 l1_s2 l1_s3 l1_bank keep_l1 baseline
                                  eval_s1 eval_s2 eval_s3 eval_s4 eval_l1 eval_baseline)
for s in "${steps[@]}"; do echo "== $s"; "$s"; done
