#!/usr/bin/env bash
# Issue 52, build 2: fot configurations whose perplexity on ordinary text is not worse than truncation to the
# window, measured side by side with truncation (vanilla), SmolLM2-135M, two books (as results/fot/run.sh ppl).
#   bash results/fot/ppl-safe/run.sh [STEP...]     # steps: local8k gate sinks8k sinks sinks_fixed sinks_fixed_gate passkey passkey_far passkey_far_fixed passkey_far_fixed_gate heads_fixed passkey_far_heads fixed4096 passkey_far_fixed4096 fixed4096_gate passkey_far_fixed4096_gate fixed4096_gate_m2 passkey_far_fixed4096_gate_m2 fixed4096_gate_m1 passkey_far_fixed4096_gate_m1 confirm_books confirm_seed confirm_32k gate_past_sinks passkey_mid_gate_past_sinks passkey_mid_gate_off passkey_edge_local7k bare_window_edge bare_window_depths gate_m2_past_sinks passkey_mid_gate_m2_past_sinks k4_gate_off passkey_mid_k4_gate_off k_sweep passkey_mid_k_small confirm_k2_books confirm_k2_seed spans
# A step's options not given here ran at fot's defaults of its day, which each JSON records (since then: positions
# fixed at 4096, then gate -1, then gate=auto); give those as -o to rerun a cell as it was made.
set -euo pipefail
cd "$(dirname "$0")/../../.."
LCX=${LCX:-.venv/bin/lcx}  # LCX=echo prints the commands
BOOKS=../shared/data/books
DOCS=(-d $BOOKS/wells_invisible_man.txt -d $BOOKS/doyle_hound_of_the_baskervilles.txt)
IVF=(-o fot.backend=faiss-ivf)  # exact below 32,768 entries, as results/fot/ppl
SINKS=(-o fot.local=8192 -o fot.chunk=256 -o fot.sinks=4 "${IVF[@]}")  # the sinks candidate every later step varies
ppl16k() {  # OUT OPTION...: the sinks candidate with OPTIONs, perplexity at 16K
    local out=$1; shift
    $LCX eval compare ppl -m smollm2-135m --stack fot "${SINKS[@]}" "$@" \
        "${DOCS[@]}" --contexts 16K --room 32K --target 256 --out results/fot/ppl-safe/$out --json
}
far() {  # OUT DEPTHS OPTION...: the sinks candidate with OPTIONs, filler passkey at 16K, needles at DEPTHS (journaled)
    local out=$1 depths=$2; shift 2
    $LCX eval passkey -m smollm2-135m --method fot "${SINKS[@]}" "$@" \
        --lengths 16K --depths $depths --out results/fot/ppl-safe/$out --resume
}
local8k() {  # the local window at the model's window (8K): memory adds only what truncation drops
    $LCX eval compare ppl -m smollm2-135m --stack fot --stack vanilla -o fot.local=8192 -o fot.chunk=256 "${IVF[@]}" \
        "${DOCS[@]}" --contexts 2K,4K,8K,16K,32K --target 256 --out results/fot/ppl-safe/local8k --json
}
gate() {  # the passkey configuration (local 1024) with memory read only where it beats the local keys (gate 0)
    $LCX eval compare ppl -m smollm2-135m --stack fot -o fot.local=1024 -o fot.chunk=256 -o fot.gate=0 "${IVF[@]}" \
        "${DOCS[@]}" --contexts 8K,32K --room 32K --target 256 --out results/fot/ppl-safe/gate0 --json
}
sinks8k() {  # the sinks candidate at 8K only (its committed run wrote to /tmp/sinks-check, then copied here)
    $LCX eval compare ppl -m smollm2-135m --stack fot -o fot.local=8192 -o fot.chunk=256 -o fot.sinks=4 "${IVF[@]}" \
        "${DOCS[@]}" --contexts 8K --room 32K --target 256 --out results/fot/ppl-safe/sinks-8k --json
}
sinks() {  # local at the window, the prompt's first 4 tokens kept beside it (attention sinks); 8K is sinks8k
    $LCX eval compare ppl -m smollm2-135m --stack fot -o fot.local=8192 -o fot.chunk=256 -o fot.sinks=4 "${IVF[@]}" \
        "${DOCS[@]}" --contexts 16K,32K --room 32K --target 256 --out results/fot/ppl-safe/sinks --json
}
sinks_fixed() {  # the sinks candidate with memory keys at distance 1024 (positions=fixed): what passkey_far_fixed retrieves with
    $LCX eval compare ppl -m smollm2-135m --stack fot -o fot.local=8192 -o fot.chunk=256 -o fot.sinks=4 "${IVF[@]}" \
        -o fot.positions=fixed -o fot.fixed_distance=1024 \
        "${DOCS[@]}" --contexts 8K,16K,32K --room 32K --target 256 --out results/fot/ppl-safe/sinks-fixed1024 --json
}
sinks_fixed_gate() {  # sinks_fixed with gate 0: a memory key is read only where it beats every local key (16K)
    ppl16k sinks-fixed1024-gate0 -o fot.positions=fixed -o fot.fixed_distance=1024 -o fot.gate=0
}
heads_fixed() {  # sinks_fixed with memory read only by the heads that retrieve (memory_heads=auto: 21 of the 12 layers' 108)
    ppl16k heads-fixed1024 -o fot.positions=fixed -o fot.fixed_distance=1024 -o fot.memory_heads=auto
}
fixed4096() {  # sinks_fixed with memory keys at distance 4096: between first (about 8K back) and 1024 (16K)
    ppl16k sinks-fixed4096 -o fot.positions=fixed -o fot.fixed_distance=4096
}
fixed4096_gate() {  # fixed4096 with gate 0: a memory key is read only where it beats every local key (16K)
    ppl16k sinks-fixed4096-gate0 -o fot.positions=fixed -o fot.fixed_distance=4096 -o fot.gate=0
}
fixed4096_gate_m2() {  # fixed4096 with gate -2: memory keys within 2 (logits) of the best local key are read too (16K)
    ppl16k sinks-fixed4096-gate-2 -o fot.positions=fixed -o fot.fixed_distance=4096 -o fot.gate=-2
}
passkey() {  # the sinks candidate's retrieval: filler passkey, 5 depths x 5 keys at 16K and 32K (journaled)
    for len in 16K 32K; do
        $LCX eval passkey -m smollm2-135m --method fot -o fot.local=8192 -o fot.chunk=256 -o fot.sinks=4 "${IVF[@]}" \
            --lengths $len --out results/fot/ppl-safe/passkey-sinks-$len --resume
    done
}
passkey_far() {  # the cells whose needle is past the 8K local window (16K, depths 0.1 and 0.3): read from memory
    far passkey-sinks-16k-far 0.1,0.3
}
passkey_far_fixed() {  # as passkey_far, memory keys at distance 1024 (positions=fixed), as near as the passkey configuration's
    far passkey-sinks-fixed1024-16k-far 0.1,0.3 -o fot.positions=fixed -o fot.fixed_distance=1024
}
passkey_far_fixed_gate() {  # passkey_far_fixed with gate 0 (depth 0.1 only)
    far passkey-sinks-fixed1024-gate0-16k-far 0.1 -o fot.positions=fixed -o fot.fixed_distance=1024 -o fot.gate=0
}
passkey_far_heads() {  # passkey_far_fixed with memory_heads=auto (depth 0.1)
    far passkey-heads-fixed1024-16k-far 0.1 -o fot.positions=fixed -o fot.fixed_distance=1024 -o fot.memory_heads=auto
}
passkey_far_fixed4096() {  # passkey_far_fixed with memory keys at distance 4096 (depth 0.1)
    far passkey-sinks-fixed4096-16k-far 0.1 -o fot.positions=fixed -o fot.fixed_distance=4096
}
passkey_far_fixed4096_gate() {  # passkey_far_fixed4096 with gate 0 (depth 0.1)
    far passkey-sinks-fixed4096-gate0-16k-far 0.1 -o fot.positions=fixed -o fot.fixed_distance=4096 -o fot.gate=0
}
passkey_far_fixed4096_gate_m2() {  # passkey_far_fixed4096 with gate -2 (depth 0.1)
    far passkey-sinks-fixed4096-gate-2-16k-far 0.1 -o fot.positions=fixed -o fot.fixed_distance=4096 -o fot.gate=-2
}
fixed4096_gate_m1() {  # fixed4096 with gate -1: between gate -2 and gate 0 (16K)
    ppl16k sinks-fixed4096-gate-1 -o fot.positions=fixed -o fot.fixed_distance=4096 -o fot.gate=-1
}
passkey_far_fixed4096_gate_m1() {  # passkey_far_fixed4096 with gate -1 (depth 0.1)
    far passkey-sinks-fixed4096-gate-1-16k-far 0.1 -o fot.positions=fixed -o fot.fixed_distance=4096 -o fot.gate=-1
}
CANDIDATE=("${SINKS[@]}" -o fot.positions=fixed -o fot.fixed_distance=4096 -o fot.gate=-1)  # fixed4096_gate_m1: the cell to confirm
FRESH=(-d $BOOKS/austen_pride_and_prejudice.txt -d $BOOKS/dickens_tale_of_two_cities.txt)  # the first two MANIFEST books not used above
confirm_books() {  # the candidate beside truncation on the fresh books, 16K and 32K
    $LCX eval compare ppl -m smollm2-135m --stack fot --stack vanilla "${CANDIDATE[@]}" \
        "${FRESH[@]}" --contexts 16K,32K --room 32K --target 256 --out results/fot/ppl-safe/confirm-books --json
}
confirm_seed() {  # the candidate's far passkey (16K, depth 0.1) with other keys and filler draws (seed 1)
    $LCX eval passkey -m smollm2-135m --method fot "${CANDIDATE[@]}" --seed 1 \
        --lengths 16K --depths 0.1 --out results/fot/ppl-safe/confirm-seed1 --resume
}
confirm_32k() {  # the candidate's passkey at 32K, needles ~29K and ~16K back (depths 0.1, 0.5)
    $LCX eval passkey -m smollm2-135m --method fot "${CANDIDATE[@]}" \
        --lengths 32K --depths 0.1,0.5 --out results/fot/ppl-safe/confirm-32k --resume
}
PAST_SINKS=(-o fot.positions=fixed -o fot.fixed_distance=4096 -o fot.gate=0 -o fot.gate_sinks=false)
gate_past_sinks() {  # fixed4096 with gate 0 measured against the window's own keys, not the sinks (16K)
    ppl16k sinks-fixed4096-gate0-past-sinks "${PAST_SINKS[@]}"
}
passkey_mid_gate_past_sinks() {  # its passkey at the depths the defaults (gate -1 against every key) miss: 0.3, 0.5
    $LCX eval passkey -m smollm2-135m --method fot "${SINKS[@]}" "${PAST_SINKS[@]}" --samples 2 \
        --lengths 16K --depths 0.3,0.5 --out results/fot/ppl-safe/passkey-gate0-past-sinks-16k-mid --resume
}
passkey_mid_gate_off() {  # the same needles with no gate (distance 4096, every top-k memory key read: fixed4096)
    $LCX eval passkey -m smollm2-135m --method fot "${SINKS[@]}" -o fot.positions=fixed -o fot.fixed_distance=4096 \
        -o fot.gate=off --samples 2 --lengths 16K --depths 0.3,0.5 --out results/fot/ppl-safe/passkey-gate-off-16k-mid \
        --resume
}
passkey_edge_local7k() {  # depth 0.5 at 16K puts the needle ~8.15K back, inside the 8K local window at its far edge:
    # the past-sinks cell with a local window 1K under the model's, so that needle is read from memory instead
    $LCX eval passkey -m smollm2-135m --method fot "${SINKS[@]}" "${PAST_SINKS[@]}" -o fot.local=7168 --samples 1 \
        --lengths 16K --depths 0.5 --out results/fot/ppl-safe/passkey-gate0-past-sinks-local7k-16k-edge --resume
}
bare() {  # OUT DEPTHS: the bare model (no method), an 8,150-token filler passkey (as long as its window allows), 3 keys a depth
    local out=$1 depths=$2
    $LCX eval passkey -m smollm2-135m --samples 3 --lengths 8150 --depths $depths \
        --out results/fot/ppl-safe/$out --resume
}
bare_window_edge() {  # needles ~8.1K back (depth 0) and ~4K back (0.5, a control): whether SmolLM2 reads its window's far edge at all
    bare passkey-bare-8150-edge 0,0.5
}
bare_window_depths() {  # needles ~7.3K, ~6.5K and ~5.7K back: how far back the bare model reads
    bare passkey-bare-8150-depths 0.1,0.2,0.3
}
PAST_SINKS_M2=(-o fot.positions=fixed -o fot.fixed_distance=4096 -o fot.gate=-2 -o fot.gate_sinks=false)
gate_m2_past_sinks() {  # gate -2 measured against the window's own keys: what last_query.py found key 65125 with (16K)
    ppl16k sinks-fixed4096-gate-2-past-sinks "${PAST_SINKS_M2[@]}"
}
passkey_mid_gate_m2_past_sinks() {  # its passkey at depth 0.3 (~11.4K back, in memory), 3 keys: the first two are passkey_mid_*'s
    far passkey-gate-2-past-sinks-16k-mid 0.3 "${PAST_SINKS_M2[@]}" --samples 3
}
kname() { [ "$2" = off ] && echo "k$1-gate-off" || echo "k$1-gate$2"; }  # K GATE: a folder's name part
kppl() {  # K GATE: the sinks candidate at distance 4096, each query reading its K best memory keys (k; 32 is the
          # default) under gate GATE, perplexity at 16K
    ppl16k "sinks-fixed4096-$(kname "$1" "$2")" -o fot.positions=fixed -o fot.fixed_distance=4096 -o fot.gate="$2" -o fot.k="$1"
}
kmid() {  # K GATE: its passkey at depth 0.3 (~11.4K back, in memory), the 3 keys of passkey_mid_gate_m2_past_sinks
    far "passkey-$(kname "$1" "$2")-16k-mid" 0.3 -o fot.positions=fixed -o fot.fixed_distance=4096 -o fot.gate="$2" \
        -o fot.k="$1" --samples 3
}
k4_gate_off() { kppl 4 off; }  # no gate, k 4: less spare attention on memory than k 32
passkey_mid_k4_gate_off() { kmid 4 off; }
k_sweep() {  # k 1, 2 and 8 with no gate, and k 4 under fot's default gate (-1): perplexity at 16K
    kppl 1 off; kppl 2 off; kppl 8 off; kppl 4 -1
}
K2=("${SINKS[@]}" -o fot.positions=fixed -o fot.fixed_distance=4096 -o fot.gate=off -o fot.k=2)  # the k 2 cell, to confirm
confirm_k2_books() {  # the k 2 cell beside truncation on the fresh books (confirm_books's), 16K and 32K
    $LCX eval compare ppl -m smollm2-135m --stack fot --stack vanilla "${K2[@]}" \
        "${FRESH[@]}" --contexts 16K,32K --room 32K --target 256 --out results/fot/ppl-safe/confirm-k2-books --json
}
confirm_k2_seed() {  # its passkey with other keys and filler draws (seed 1), depths 0.1 and 0.3 at 16K, 3 keys each
    $LCX eval passkey -m smollm2-135m --method fot "${K2[@]}" --seed 1 --samples 3 \
        --lengths 16K --depths 0.1,0.3 --out results/fot/ppl-safe/confirm-k2-seed1 --resume
}
passkey_mid_k_small() {  # the passkey of the sweep's two cells under truncation's perplexity: k 1 and k 2, no gate
    kmid 1 off; kmid 2 off
}
spans16k() {  # STACK (vanilla|fot|fot-k2): perplexity at 16K over 4 spans a book, not the 1 of every cell above
    # (2 x 256 scored tokens); fot at its defaults (exact search), fot-k2 the k 2 cell; then results/paired_ppl.py results/fot/ppl-safe/spans-16k
    local out=results/fot/ppl-safe/spans-16k/$1 stack=$1 opts=()
    [ -f "$out/compare-ppl.json" ] && { echo "done before: $out"; return; }
    case $1 in
        vanilla | fot) ;;
        fot-k2) stack=fot; opts=(-o fot.k=2 -o fot.gate=off) ;;
        *) echo "spans16k: unknown stack $1" >&2; return 2 ;;
    esac
    $LCX eval compare ppl -m smollm2-135m --stack "$stack" "${opts[@]}" "${DOCS[@]}" --contexts 16K --samples 4 \
        --target 256 --out "$out"
}
spans() { spans16k vanilla; spans16k fot; spans16k fot-k2; }
[ $# -eq 0 ] && set -- local8k gate sinks passkey
for s in "$@"; do $s; done  # a step with its argument is one word: "spans16k fot"
