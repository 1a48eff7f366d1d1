#!/usr/bin/env bash
# results/models/: lcx on models that can read (issue 50): Gemma 3 270M and Qwen2.5 0.5B, bfloat16 (DTYPE), the
# needle in real prose (the 8 books, in file-name order) and in the repeated filler.
#   bash results/models/run.sh gemma_fot64          # chosen steps (every passkey step journals: rerun continues)
#   bash results/models/run.sh                      # every step, in order
#   DTYPE=float32 bash results/models/run.sh "ppl_held qwen2.5-0.5b"   # a step with its argument; another precision
# Windows held to 4K inside the native 32K window: fot local, streaming window, focusllm chunk and local, vanilla.
set -euo pipefail
cd "$(dirname "$0")/../.."
LCX=${LCX:-.venv/bin/lcx}  # LCX=echo prints the commands
BOOKS=../shared/data/books
DTYPE="${DTYPE:-bfloat16}"
COMMON=(--dtype "$DTYPE" --resume)
WIN4K=(-o fot.local=4096 -o fot.chunk=1024 -o streaming.window=4096 -o focusllm.chunk=4096 -o focusllm.local=4096
       -o vanilla.window=4096)
# fot's defaults before issue 52, which gemma_fot64's committed figure was made with
FOT_BEFORE=(-o fot.sinks=0 -o fot.positions=first -o fot.fixed_distance=0 -o fot.gate=off)
# Qwen2.5 0.5B retrieves with memory in every layer (tried by hand); Gemma 3: auto = its 3 full-attention layers
QWEN_FOT=(-o fot.memory_layers=all)

retrieval() {  # $1 model: which layers copy from far context (lcx analyze retrieval; fot's memory_layers=auto)
    $LCX analyze retrieval -m "$1" --keys 2 --out "results/models/$1/retrieval"
}
gemma_fot64() {  # the first figure past the window: fot training-free at 64K (2x Gemma's window), one key per depth
    $LCX eval passkey -m gemma3-270m --method fot -o local=4096 -o chunk=1024 --lengths 64K --samples 1 \
        "${FOT_BEFORE[@]}" --haystack $BOOKS --out results/models/gemma3-270m/fot-64k-prose "${COMMON[@]}"
}
gemma_fot64_gate() {  # $1 gate (-1: the default before auto; auto: today's; off): gemma_fot64 at fot's defaults since issue 52
    $LCX eval passkey -m gemma3-270m --method fot -o local=4096 -o chunk=1024 -o fot.gate="$1" --lengths 64K \
        --samples 1 --haystack $BOOKS --out "results/models/gemma3-270m/fot-64k-prose-gate$1" "${COMMON[@]}"
}
qwen_fot64() {  # Qwen2.5's 64K prose passkey at fot's defaults (gate auto: 1 at local 4K), gemma_fot64_gate's draw
    $LCX eval passkey -m qwen2.5-0.5b --method fot -o local=4096 -o chunk=1024 --lengths 64K --samples 1 \
        --haystack $BOOKS --out "results/models/qwen2.5-0.5b/fot-64k-prose-gateauto" "${COMMON[@]}"
}
inside() {  # $1 model, $2 length: each method at a 4K window against the bare model's full attention, prose
    local extra=(); [ "$1" = qwen2.5-0.5b ] && extra=("${QWEN_FOT[@]}")
    $LCX eval compare passkey -m "$1" --stack none --stack fot --stack streaming --stack focusllm --stack vanilla \
        "${WIN4K[@]}" "${extra[@]}" --lengths "$2" --samples 3 --haystack $BOOKS \
        --out "results/models/$1/inside-$2" "${COMMON[@]}"
}
ppl() {  # $1 model: perplexity at 16K and 32K, two books, same stacks
    local extra=(); [ "$1" = qwen2.5-0.5b ] && extra=("${QWEN_FOT[@]}")
    $LCX eval compare ppl -m "$1" --stack none --stack fot --stack streaming --stack focusllm --stack vanilla \
        "${WIN4K[@]}" "${extra[@]}" -d $BOOKS/wells_invisible_man.txt -d $BOOKS/doyle_hound_of_the_baskervilles.txt \
        --contexts 16K,32K --target 256 --dtype "$DTYPE" --out "results/models/$1/ppl-$DTYPE"
}
ppl_held() {  # $1 model: perplexity past a window held to 4K (2x it: 8K), fot at its defaults against truncation to
    # the same 4K and the bare model reading all 8K (inside its real 32K window: the ceiling), the books of ppl()
    # (fot's default gate then, -1, pinned: gate=auto became the default since; held_stack fot-auto runs it)
    $LCX eval compare ppl -m "$1" --stack none --stack vanilla --stack fot -o vanilla.window=4096 -o fot.local=4096 \
        -o fot.gate=-1 -d $BOOKS/wells_invisible_man.txt -d $BOOKS/doyle_hound_of_the_baskervilles.txt --contexts 4K,8K --target 256 \
        --dtype "$DTYPE" --out "results/models/$1/ppl-held-4k-$DTYPE"
}
ppl_held_k2() {  # $1 model: ppl_held's fot with each query reading its 2 best memory keys and no gate (the
    # cell results/fot/ppl-safe found at truncation's perplexity on SmolLM2); its other rows are ppl_held's
    $LCX eval compare ppl -m "$1" --stack fot -o fot.local=4096 -o fot.k=2 -o fot.gate=off \
        -d $BOOKS/wells_invisible_man.txt -d $BOOKS/doyle_hound_of_the_baskervilles.txt --contexts 4K,8K --target 256 \
        --dtype "$DTYPE" --out "results/models/$1/ppl-held-4k-k2-$DTYPE"
}
ppl64() {  # $1 model [options]: perplexity at 2x the window (64K) and at the window (32K) on the same scored tokens,
    # ppl()'s books: the bare model, truncation to the window (vanilla), fot at its defaults (local = the window,
    # gate auto; options after the model, e.g. auto's calibrated value given explicitly, are passed on)
    $LCX eval compare ppl -m "$1" --stack none --stack vanilla --stack fot -d $BOOKS/wells_invisible_man.txt \
        -d $BOOKS/doyle_hound_of_the_baskervilles.txt --contexts 32K,64K --target 256 --dtype "$DTYPE" \
        --out "results/models/$1/ppl-64k-$DTYPE" "${@:2}"
}
ppl64_fot() {  # $1 model, $2 label, options: ppl64's fot alone with other options (ppl-64k-$2-$DTYPE), e.g.
    # "ppl64_fot gemma3-270m gate-1 -o fot.gate=-1" beside ppl64's gate off
    $LCX eval compare ppl -m "$1" --stack fot -d $BOOKS/wells_invisible_man.txt \
        -d $BOOKS/doyle_hound_of_the_baskervilles.txt --contexts 32K,64K --target 256 --dtype "$DTYPE" \
        --out "results/models/$1/ppl-64k-$2-$DTYPE" "${@:3}"
}
ppl64_before() {  # $1 model: ppl64's fot in gemma_fot64's passkey configuration (local 4K, chunk 1K, FoT's options)
    $LCX eval compare ppl -m "$1" --stack fot -o fot.local=4096 -o fot.chunk=1024 "${FOT_BEFORE[@]}" \
        -d $BOOKS/wells_invisible_man.txt -d $BOOKS/doyle_hound_of_the_baskervilles.txt --contexts 32K,64K \
        --target 256 --dtype "$DTYPE" --out "results/models/$1/ppl-64k-before-$DTYPE"
}
inside_bare() {  # $1 model[, $2 new tokens]: the bare model inside its window, 32K prose prompts, one key per depth:
    # the reference issue 52 puts the 64K fot figures (gemma_fot64_gate, qwen_fot64) against; 16 new tokens leave
    # room for an answer that restates the question first (Gemma 3's at 32K)
    $LCX eval passkey -m "$1" --lengths 32K --samples 1 --haystack $BOOKS --max-new-tokens "${2:-8}" \
        --out "results/models/$1/inside-32k-prose-none${2:+-$2tok}" "${COMMON[@]}"
}
inside_none() {  # $1 model, $2 length[, $3 new tokens, default 16]: inside()'s bare-model row alone, on its draw, with
    # room for an answer that restates the question first (Gemma 3's)
    $LCX eval passkey -m "$1" --lengths "$2" --samples 3 --haystack $BOOKS --max-new-tokens "${3:-16}" \
        --out "results/models/$1/inside-$2/none-${3:-16}tok" "${COMMON[@]}"
}
held_stack() {  # $1 stack: sets METHOD and OPTS, a stack past the window held to 4K (ppl_held_spans, passkey_held)
    METHOD=$1; OPTS=()
    case $1 in
        vanilla) OPTS=(-o vanilla.window=4096) ;;
        streaming) OPTS=(-o streaming.window=4096) ;;  # the 4 sinks and 4K recent tokens: fot with no memory
        fot) OPTS=(-o fot.local=4096 -o fot.gate=-1) ;;  # the default gate before auto: its folders were measured so
        fot-auto) METHOD=fot; OPTS=(-o fot.local=4096) ;;  # fot's defaults since gate=auto: calibrated on the model
        fot-k2) METHOD=fot; OPTS=(-o fot.local=4096 -o fot.k=2 -o fot.gate=off) ;;
        # Qwen2.5's cost candidates: memory only in the layers whose best head puts >= 0.7 on the key (8 of auto's
        # 18, retrieval/retrieval.json), and gate 0 measured past the sinks (results/fot/ppl-safe's cheapest cell)
        fot-layers07) METHOD=fot; OPTS=(-o fot.local=4096 -o fot.memory_layers=3,7,9,11,13,14,16,17) ;;
        fot-gate0-past-sinks) METHOD=fot; OPTS=(-o fot.local=4096 -o fot.gate=0 -o fot.gate_sinks=false) ;;
        fot-gate0) METHOD=fot; OPTS=(-o fot.local=4096 -o fot.gate=0) ;;  # stricter than the default's -1
        # stricter still: a memory key must beat every local key by N logits, toward streaming's floor
        fot-gate[1-9]) METHOD=fot; OPTS=(-o fot.local=4096 -o fot.gate=${1#fot-gate}) ;;  # fot-gate1 ... fot-gate9
        fot-gate-m2) METHOD=fot; OPTS=(-o fot.local=4096 -o fot.gate=-2) ;;  # looser than the default's -1
        fot-gate-off) METHOD=fot; OPTS=(-o fot.local=4096 -o fot.gate=off) ;;  # every query reads memory
        none) METHOD=none; OPTS=() ;;  # the bare model reading all 8K, inside its real window: the ceiling
        # memory read only by the query heads retrieval analysis finds on a needle
        fot-heads) METHOD=fot; OPTS=(-o fot.local=4096 -o fot.memory_heads=auto) ;;
        *) echo "run.sh: unknown stack $1 (vanilla, streaming, fot, fot-auto, fot-k2, fot-layers07,
           fot-gate0-past-sinks, fot-gate0, fot-gate1 ... fot-gate9, fot-gate-m2, fot-gate-off, fot-heads, none)" >&2
           return 2 ;;
    esac
}
held_ppl() {  # $1 model, $2 stack (held_stack), $3 folder, $4 $5 books: 8K, 4 spans a book; a finished stack is not rerun
    local out="results/models/$1/$3-$DTYPE/$2"
    [ -f "$out/compare-ppl.json" ] && { echo "done before: $out"; return; }
    held_stack "$2"
    $LCX eval compare ppl -m "$1" --stack "$METHOD" "${OPTS[@]}" -d "$BOOKS/$4" -d "$BOOKS/$5" --contexts 8K \
        --samples 4 --target 256 --dtype "$DTYPE" --out "$out"
}
ppl_held_spans() {  # $1 model, $2 stack: ppl_held at 8K with 4 spans a book, not 1 (ppl_held's table is 2 x 256
    # scored tokens); one folder per stack
    held_ppl "$1" "$2" ppl-held-4k-spans wells_invisible_man.txt doyle_hound_of_the_baskervilles.txt
}
ppl_held_spans_fresh() {  # $1 model, $2 stack: ppl_held_spans on two other books (a fresh draw for a cell chosen
    # from ppl_held_spans' grid)
    held_ppl "$1" "$2" ppl-held-4k-spans-fresh stevenson_treasure_island.txt twain_tom_sawyer.txt
}
held_passkey() {  # $1 model, $2 stack (held_stack), $3 folder, then eval passkey's draw: retrieval past the window
    # held to 4K: 8K prompts, the needle at depths 0.1, 0.25, 0.4 (4.9K-7.4K tokens back: in memory, not the local
    # window), 2 keys a depth
    local model=$1 stack=$2 folder=$3; shift 3
    held_stack "$stack"
    local method=(--method "$METHOD"); [ "$METHOD" = none ] && method=()  # the bare model: no method
    $LCX eval passkey -m "$model" "${method[@]}" "${OPTS[@]}" --lengths 8K --depths 0.1,0.25,0.4 --samples 2 \
        "$@" --out "results/models/$model/$folder-$DTYPE/$stack" "${COMMON[@]}"
}
passkey_held() {  # $1 model, $2 stack: held_passkey in prose (the 8 books)
    held_passkey "$1" "$2" passkey-held-4k --haystack $BOOKS
}
passkey_held_fresh() {  # $1 model, $2 stack: passkey_held on a fresh draw (keys of seed 1, the needle in the two
    # books of ppl_held_spans_fresh) for a cell chosen from the grid
    held_passkey "$1" "$2" passkey-held-4k-fresh --seed 1 --haystack $BOOKS/stevenson_treasure_island.txt \
        --haystack $BOOKS/twain_tom_sawyer.txt
}
beyond() {  # $1 model, $2 haystack (prose|filler): 64K, every training-free stack at its defaults and YaRN x2; in
    # prose fot's row is read from fot64_defaults' journal (the same draw; run that step first), in the filler fot runs here
    local hay=() fot=(--stack fot)
    case "${2:-}" in prose) hay=(--haystack $BOOKS)
                            fot=(--include "results/models/$1/fot-64k-prose-defaults/passkey.samples.jsonl");; filler) ;;
        *) echo "beyond MODEL prose|filler, not '${2:-}'" >&2; return 2;; esac
    $LCX eval compare passkey -m "$1" --stack vanilla --stack rope --stack streaming --stack focusllm "${fot[@]}" \
        -o rope.factor=2 --lengths 64K --samples 3 "${hay[@]}" \
        --out "results/models/$1/beyond-64k-$2" "${COMMON[@]}"
}
fot64_gate() {  # $1 model, $2 gate: fot at its defaults but the gate (ppl64_fot's cells), 64K prose, one key per
    # depth (gemma_fot64_gate's prompts, inside_bare's keys): does a gate that costs less perplexity keep retrieval?
    $LCX eval passkey -m "$1" --method fot -o fot.gate="$2" --lengths 64K --samples 1 --haystack $BOOKS \
        --out "results/models/$1/fot-64k-prose-defaults-gate$2" "${COMMON[@]}"
}
fot64_defaults() {  # $1 model[, $2 keys per depth, default 3, its own folder when given]: fot with no option at
    # all, 64K prose, 5 depths: issue 52's "no options" figure and issue 50's fot row of the beyond grid, the first
    # use's calibration included
    $LCX eval passkey -m "$1" --method fot --lengths 64K --samples "${2:-3}" --haystack $BOOKS \
        --out "results/models/$1/fot-64k-prose-defaults${2:+-$2keys}" "${COMMON[@]}"
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=("retrieval smollm2-135m" "retrieval gemma3-270m" "retrieval qwen2.5-0.5b" gemma_fot64 "inside gemma3-270m 16K" "inside qwen2.5-0.5b 16K" "ppl gemma3-270m"
    "ppl qwen2.5-0.5b" "ppl_held gemma3-270m" "ppl_held qwen2.5-0.5b"
    "inside gemma3-270m 32K" "inside qwen2.5-0.5b 32K" "fot64_defaults gemma3-270m" "fot64_defaults qwen2.5-0.5b"
    "beyond gemma3-270m prose" "beyond qwen2.5-0.5b prose" "beyond gemma3-270m filler" "beyond qwen2.5-0.5b filler")
for s in "${steps[@]}"; do echo "== $s"; $s; done
