#!/usr/bin/env bash
# Reproduces results/focusllm/ (issue 7: FocusLLM on SmolLM2-135M, 8K window, 2 CPU cores).
#   bash results/focusllm/run.sh                    # every step, in order
#   bash results/focusllm/run.sh passkey_free       # chosen steps
# Passkey steps journal every sample (--resume): rerunning an interrupted step continues it; `train`
# resumes from its last checkpoint.  Defaults when these ran: chunk 2048, local 2048, fragment 512, all chunks at once.  The
# evaluation steps pin the chunk (FIXED): they ran before chunk=auto, which gives 2048 up to 64K but 4096 at 128K,
# and a journal resumes only under the options it was started with (an adapter's recorded chunk is not applied).
set -euo pipefail
cd "$(dirname "$0")/../.."
LCX=${LCX:-.venv/bin/lcx}  # device-run.sh: python3 -m lcx.cli
BOOKS=../shared/data/books
# the six books not used for evaluation (wells and doyle are the perplexity books)
TRAIN_BOOKS=(alcott_little_men austen_pride_and_prejudice dickens_tale_of_two_cities hardy_mayor_of_casterbridge
             stevenson_treasure_island twain_tom_sawyer)
EVAL_BOOKS=(-d $BOOKS/wells_invisible_man.txt -d $BOOKS/doyle_hound_of_the_baskervilles.txt)
LENGTHS=16K,32K,64K,128K
FIXED=(-o focusllm.chunk=2048)
# a 128K prompt's estimate (~16.5 GiB) fits 24 GB only without the memory check's 1.5x heap allowance, which
# came after these grids ran: freed tensors go back to the system instead
export LCX_BOUNDED_HEAP=${LCX_BOUNDED_HEAP:-1}

passkey_free() {  # training-free: the candidates use the base projections
    $LCX eval passkey -m smollm2-135m --method focusllm "${FIXED[@]}" --lengths $LENGTHS --out results/focusllm/passkey-free --resume
}
ppl_free() {
    $LCX eval compare ppl -m smollm2-135m --stack focusllm --stack vanilla "${FIXED[@]}" "${EVAL_BOOKS[@]}" --contexts 4K,8K,16K,32K \
        --target 256 --out results/focusllm/ppl-free
}
train() {  # the candidate adapter (q/k/v/o LoRA rank 8, gated to candidate positions); both loss terms;
           # 8K-token windows, chunk size from {64..2048} and local size drawn per step; checkpoints every 10 steps
    local resume=()
    [ -d results/focusllm/adapter/checkpoints ] && resume=(--resume)
    $LCX train -m smollm2-135m --method focusllm $(printf -- "-d $BOOKS/%s.txt " "${TRAIN_BOOKS[@]}") \
        --seq-len 8192 --steps ${FOCUSLLM_STEPS:-200} --lr 1e-3 --warmup 10 --save-every 10 \
        --out results/focusllm/adapter "${resume[@]}"
}
train_fresh() {  # the candidate adapter trained for exact generation (-o focusllm.fresh=128): only the last 128
                 # tokens of each copied span are predicted, each with every candidate refreshed through the
                 # token before it; repetition term only, 4K-token windows (a step is ~2x cheaper than 8K)
    local resume=()
    [ -d results/focusllm/adapter-fresh/checkpoints ] && resume=(--resume)
    $LCX train -m smollm2-135m --method focusllm -o focusllm.fresh=128 -o focusllm.losses=repetition -o focusllm.train_chunks=512,1024,2048 \
        $(printf -- "-d $BOOKS/%s.txt " "${TRAIN_BOOKS[@]}") --seq-len 4096 --steps ${FOCUSLLM_FRESH_STEPS:-150} \
        --lr 1e-3 --warmup 10 --save-every 10 --out results/focusllm/adapter-fresh "${resume[@]}"
}
train_recall() {  # from the fresh-trained adapter, the recall term only (-o focusllm.losses=recall): the window's
                  # end, then a 4-32 token cue copied from the memory; the 32 tokens that follow it there are
                  # predicted, each with every candidate refreshed (what a passkey question asks of the candidates)
    local resume=()
    [ -d results/focusllm/adapter-recall/checkpoints ] && resume=(--resume)
    $LCX train -m smollm2-135m --method focusllm -o focusllm.fresh=32 -o focusllm.losses=recall -o focusllm.train_chunks=512,1024,2048 \
        $(printf -- "-d $BOOKS/%s.txt " "${TRAIN_BOOKS[@]}") --seq-len 4096 --steps ${FOCUSLLM_RECALL_STEPS:-120} \
        --init-adapter results/focusllm/adapter-fresh --lr 5e-4 --warmup 5 --save-every 10 \
        --out results/focusllm/adapter-recall "${resume[@]}"
}
train_recall_local() {  # from adapter-recall, the recall term with half of its draws' cue and value among the local
                        # tokens (-o focusllm.recall_local=0.5): the answer is in the memory or local, as a passkey's
    local resume=()
    [ -d results/focusllm/adapter-recall-local/checkpoints ] && resume=(--resume)
    $LCX train -m smollm2-135m --method focusllm -o focusllm.fresh=32 -o focusllm.losses=recall -o focusllm.recall_local=0.5 \
        -o focusllm.train_chunks=512,1024,2048 $(printf -- "-d $BOOKS/%s.txt " "${TRAIN_BOOKS[@]}") --seq-len 4096 \
        --steps ${FOCUSLLM_RECALL_STEPS:-100} --init-adapter results/focusllm/adapter-recall --lr 5e-4 --warmup 5 \
        --save-every 10 --seed 1 --out results/focusllm/adapter-recall-local "${resume[@]}"
}
passkey_recall_local() {
    $LCX eval passkey -m smollm2-135m --adapter results/focusllm/adapter-recall-local "${FIXED[@]}" --lengths ${RECALL_LENGTHS:-16K} \
        --out results/focusllm/passkey-recall-local --resume
}
passkey_recall_local_32k() {  # a first look at 32K: 2 keys per depth (~100 s a sample on 2 cores)
    $LCX eval passkey -m smollm2-135m --adapter results/focusllm/adapter-recall-local "${FIXED[@]}" --lengths 32K --samples 2 \
        --out results/focusllm/passkey-recall-local-32k-2keys --resume
}
passkey_recall_local_long() {  # 32K, 64K, 128K, 5 keys per depth, one folder each.  The committed journals were
    # made on an H200 by device-run.sh (3-7 s a sample there); on 2 CPU cores ~100 s (32K) to ~10 min (128K) a
    # sample.  DEVICE=cuda runs them on a GPU.
    local L
    for L in ${RECALL_LONG:-32K 64K 128K}; do
        $LCX eval passkey -m smollm2-135m --adapter results/focusllm/adapter-recall-local "${FIXED[@]}" --lengths $L \
            --device ${DEVICE:-cpu} --out results/focusllm/passkey-recall-local-${L,,} --resume
    done
}
passkey_recall_local_overlap() {  # the same adapter, each chunk also reading the 64 tokens before it
    # (-o focusllm.overlap=64): the depth-0.5 needles, cut by a chunk boundary at every length, are whole in one
    for L in ${OVERLAP_LENGTHS:-16K}; do
        $LCX eval passkey -m smollm2-135m --adapter results/focusllm/adapter-recall-local "${FIXED[@]}" -o focusllm.overlap=64 \
            --lengths $L --device ${DEVICE:-cpu} --out results/focusllm/passkey-recall-local-overlap-${L,,} --resume
    done
}
passkey_topk() {  # the full grids with -o focusllm.topk=4 (each local query head reads its 4 best candidates;
                  # see topk_probe) and overlap 64; ~4-5 min a 64K prompt on 2 CPU cores, DEVICE=cuda on a GPU
    local L
    for L in ${TOPK_LENGTHS:-64K 128K}; do
        $LCX eval passkey -m smollm2-135m --adapter results/focusllm/adapter-recall-local "${FIXED[@]}" -o focusllm.overlap=64 \
            -o focusllm.topk=4 --lengths $L --device ${DEVICE:-cpu} \
            --out results/focusllm/passkey-recall-local-topk4-${L,,} --resume
    done
}
passkey_free_topk() {  # topk 4 without training (the base projections), overlap 64: what topk alone does
    local L
    for L in ${FREE_TOPK_LENGTHS:-64K}; do
        $LCX eval passkey -m smollm2-135m --method focusllm "${FIXED[@]}" -o focusllm.overlap=64 -o focusllm.topk=4 --lengths $L \
            --device ${DEVICE:-cpu} --out results/focusllm/passkey-free-topk4-${L,,} --resume
    done
}
bigchunk_probe() {  # chunks of 7,616 tokens (the largest the window holds with overlap 64 and fragment 512): 9
                    # candidates at 64K instead of 31; the first key of each depth of the committed 64K grid
                    # (~5 min a prompt on 2 cores)
    .venv/bin/python results/focusllm/bigchunk/probe.py --length 64K --index 0 \
        --baseline results/focusllm/passkey-recall-local-64k -o focusllm.chunk=7616 -o focusllm.overlap=64 \
        --out results/focusllm/bigchunk/c7616-64k
}
passkey_recall() {  # the recall-trained adapter on the 16K grid (exact refresh)
    $LCX eval passkey -m smollm2-135m --adapter results/focusllm/adapter-recall "${FIXED[@]}" --lengths ${RECALL_LENGTHS:-16K} \
        --out results/focusllm/passkey-recall --resume
}
passkey_trained() {
    $LCX eval passkey -m smollm2-135m --adapter results/focusllm/adapter "${FIXED[@]}" --lengths $LENGTHS \
        --out results/focusllm/passkey-trained --resume
}
passkey_fresh() {  # the fresh-trained adapter (train_fresh) on the 16K grid (exact refresh; ~50 s a sample, 2 cores)
    $LCX eval passkey -m smollm2-135m --adapter results/focusllm/adapter-fresh "${FIXED[@]}" --lengths ${FRESH_LENGTHS:-16K} \
        --out results/focusllm/passkey-fresh --resume
}
diagnose_fresh() {  # why passkey_fresh finds what it finds: the held-out copy loss, what the needle's candidate
                    # knows on its own, where the question's queries look (~20 min on 2 cores)
    .venv/bin/python results/focusllm/fresh-loss/fresh_loss.py
    .venv/bin/python results/focusllm/passkey-ceiling/ceiling.py
    .venv/bin/python results/focusllm/attention-share/share.py --adapter results/focusllm/adapter-fresh \
        --out results/focusllm/attention-share/share-fresh.json
}
ppl_trained() {
    $LCX eval ppl -m smollm2-135m --adapter results/focusllm/adapter "${FIXED[@]}" "${EVAL_BOOKS[@]}" --contexts 4K,8K,16K,32K \
        --target 256 --out results/focusllm/ppl-trained
}

compare16_topk() {  # the topk stack (adapter-recall-local, overlap 64, topk 4) on compare16's prompts; the vanilla,
                   # streaming and fot rows are compare16's: their journals are copied and --resume reuses them
                   # (same prompts and options; ~20-180 s a sample each to recompute on one thread)
    local D=results/focusllm/compare-16k-topk S
    mkdir -p $D
    for S in vanilla streaming fot; do
        [ -e $D/compare-passkey.$S.samples.jsonl ] || cp results/focusllm/compare-16k/compare-passkey.$S.samples.jsonl $D/
    done
    $LCX eval compare passkey -m smollm2-135m --stack focusllm@results/focusllm/adapter-recall-local \
        --stack vanilla --stack streaming --stack fot "${FIXED[@]}" -o focusllm.overlap=64 -o focusllm.topk=4 \
        -o fot.local=1024 -o fot.chunk=256 -o fot.memory_layers=6,7,8,14,15,17,18,19,20,21,22,23 \
        -o fot.sinks=0 -o fot.positions=first -o fot.fixed_distance=0 -o fot.gate=off \
        --lengths 16K --depths 0.1,0.5,0.9 --samples 2 --out $D --resume
}
compare16() {  # focusllm, training-free and with the trained adapter (focusllm@DIR), against vanilla, streaming
               # and fot (fot in the configuration of results/fot/run.sh) on the same 16K prompts: 3 depths x 2
               # keys (~1-3 min per sample and stack on one thread)
    $LCX eval compare passkey -m smollm2-135m --stack focusllm --stack focusllm@results/focusllm/adapter \
        --stack vanilla --stack streaming --stack fot "${FIXED[@]}" \
        -o fot.local=1024 -o fot.chunk=256 -o fot.memory_layers=6,7,8,14,15,17,18,19,20,21,22,23 \
        -o fot.sinks=0 -o fot.positions=first -o fot.fixed_distance=0 -o fot.gate=off \
        --lengths 16K --depths 0.1,0.5,0.9 --samples 2 --out results/focusllm/compare-16k --resume
}

passkey_topk_chunk4096() {  # the 128K grid with chunks of 4,096 tokens: 31 candidates, as 2,048-token chunks
                            # make at 64K (23/25 there); ~9 min for the first prompt, ~1 min each after (2 cores)
    $LCX eval passkey -m smollm2-135m --adapter results/focusllm/adapter-recall-local -o focusllm.overlap=64 \
        -o focusllm.topk=4 -o focusllm.chunk=4096 --lengths 128K --device ${DEVICE:-cpu} \
        --out results/focusllm/passkey-recall-local-topk4-chunk4096-128k --resume
    # held out: chunk 4096 was chosen after reading the 2,048-token grid, so a fresh draw of keys (seed 2)
    $LCX eval passkey -m smollm2-135m --adapter results/focusllm/adapter-recall-local -o focusllm.overlap=64 \
        -o focusllm.topk=4 -o focusllm.chunk=4096 --lengths 128K --seed 2 --device ${DEVICE:-cpu} \
        --out results/focusllm/passkey-recall-local-topk4-chunk4096-128k-seed2 --resume
    # and at 64K (15 candidates; ~40 s a prompt after the first)
    $LCX eval passkey -m smollm2-135m --adapter results/focusllm/adapter-recall-local -o focusllm.overlap=64 \
        -o focusllm.topk=4 -o focusllm.chunk=4096 --lengths 64K --device ${DEVICE:-cpu} \
        --out results/focusllm/passkey-recall-local-topk4-chunk4096-64k --resume
}
chunk_auto_probe() {  # chunk=auto (the default since it was added: 4,096 at 128K) on three prompts of the seed-0
                     # 128K grid, beside what the 2,048- and 4,096-token grids answered there (~15 min, then ~2 min)
    .venv/bin/python results/focusllm/bigchunk/probe.py --length 128K --index 0 --depths 0.1,0.5,0.9 \
        --baseline results/focusllm/passkey-recall-local-topk4-chunk4096-128k \
        --baseline results/focusllm/passkey-recall-local-topk4-128k -o focusllm.chunk=auto -o focusllm.overlap=64 \
        -o focusllm.topk=4 --out results/focusllm/chunk-auto/probe-128k
}
dev_probe() {  # generation variants on development prompts at 128K (dev/probe.py: depths 0.2-0.8, keys of seed 1,
               # never a test-grid prompt), the adapter-recall-local stack; ~9 min for a first prompt's chunks,
               # ~70 s a variant with exact refresh after it (2 cores).  Run as three calls, each stopped once its new
               # variants had lost prompts topk 4 finds (topk 6, 8, refresh 0; then topk 3, 2): dev-128k.jsonl
               # holds what ran, and a rerun skips it
    P="results/focusllm/dev/probe.py" D=results/focusllm/dev/dev-128k
    .venv/bin/python $P --length 128K --out $D --depths 0.2,0.4 --samples 2 \
        --variant topk4=topk:4 --variant topk8=topk:8 --variant topk6=topk:6 --variant topk4-r0=topk:4,refresh:0
    .venv/bin/python $P --length 128K --out $D --depths 0.2 --samples 2 --variant topk4=topk:4 --variant topk3=topk:3 \
        --variant topk2=topk:2
    .venv/bin/python $P --length 128K --out $D --variant topk4=topk:4
}
steps=("$@")
topk_probe() {  # -o focusllm.topk=K: each local query head reads its K best candidates; prompts of the committed
                # grids (bigchunk/probe.py), ~100 s a prompt at 32K, ~5 min at 64K on 2 cores
    P="results/focusllm/bigchunk/probe.py"
    .venv/bin/python $P --length 32K --index 0,1 --baseline results/focusllm/passkey-recall-local-overlap-32k \
        -o focusllm.overlap=64 -o focusllm.topk=1 --out results/focusllm/topk/k1-32k  # stopped after 7 prompts
    .venv/bin/python $P --length 32K --index 0,1 --depths 0.1,0.3,0.5 \
        --baseline results/focusllm/passkey-recall-local-overlap-32k -o focusllm.overlap=64 -o focusllm.topk=4 \
        --out results/focusllm/topk/k4-32k
    .venv/bin/python $P --length 64K --index 0 --baseline results/focusllm/passkey-recall-local-overlap-64k \
        --baseline results/focusllm/passkey-recall-local-64k -o focusllm.overlap=64 -o focusllm.topk=4 \
        --out results/focusllm/topk/k4-64k
    .venv/bin/python $P --length 64K --index 1 --baseline results/focusllm/passkey-recall-local-overlap-64k \
        --baseline results/focusllm/passkey-recall-local-64k -o focusllm.overlap=64 -o focusllm.topk=4 \
        --out results/focusllm/topk/k4-64k-i1
}
[ ${#steps[@]} -eq 0 ] && steps=(passkey_free ppl_free train passkey_trained ppl_trained train_fresh passkey_fresh diagnose_fresh train_recall passkey_recall train_recall_local passkey_recall_local passkey_recall_local_32k passkey_recall_local_long passkey_recall_local_overlap bigchunk_probe topk_probe passkey_topk compare16_topk passkey_free_topk dev_probe passkey_topk_chunk4096 chunk_auto_probe)
for s in "${steps[@]}"; do echo "== $s"; "$s"; done
