#!/usr/bin/env bash
# results/ruler/: RULER's nine tasks (lcx eval ruler) over the 8 books, bfloat16, 5 samples per task and cell (issue 51).
# Output: results/ruler/MODEL/STACK/LENGTHS/ (a journal per run; summarize.py reads them all).
#   bash results/ruler/run.sh crosscheck gemma3-270m      # chosen steps (every step journals: rerun continues)
#   bash results/ruler/run.sh                             # every step, cheapest first
# Cells (planned at ~6 hours a model's table; results/ruler/README.md says what they took): the bare model at the
# largest length inside its window (the headline's denominator) and below it; every memory method (fot, focusllm,
# streaming) at 2x the window; truncation (vanilla) and YaRN x2 / x4 at 2x the window after those; on SmolLM2 also the
# adapters lcx trained for it (focusllm-adapter: results/focusllm; smt-adapter: results/smt, YaRN x4 + SMT).
set -euo pipefail
cd "$(dirname "$0")/../.."
LCX=${LCX:-.venv/bin/lcx}
BOOKS=../shared/data/books
COMMON=(--haystack $BOOKS --samples 5 --dtype bfloat16 --resume)

fot_options() {  # fot's per-model options (results/models, results/fot): memory layers and windows
    case $1 in
        smollm2-135m) echo "-o fot.local=1024 -o fot.chunk=256 -o fot.memory_layers=6,7,8,14,15,17,18,19,20,21,22,23" ;;
        qwen2.5-0.5b) echo "-o fot.local=4096 -o fot.chunk=1024 -o fot.memory_layers=all" ;;
        *) echo "-o fot.local=4096 -o fot.chunk=1024" ;;  # gemma3: auto = its full-attention layers
    esac
}
bare() {  # $1 model, $2 lengths: the model alone, inside its window
    $LCX eval ruler -m "$1" --lengths "$2" "${COMMON[@]}" --out "results/ruler/$1/none/$2"
}
beyond() {  # $1 model, $2 stack, $3 lengths[, $4 rope's YaRN factor]: one stack past the window
    local opts=() stack=$2
    case $2 in
        fot) read -ra opts <<< "$(fot_options "$1")"
             # fot's defaults before issue 52 (these results were made with them)
             opts+=(-o fot.sinks=0 -o fot.positions=first -o fot.fixed_distance=0 -o fot.gate=off) ;;
        rope) opts=(-o rope.type=yarn -o rope.factor="$4") ;;
        # the candidate adapter results/focusllm trained for SmolLM2, with the options its passkey grids used
        focusllm-adapter) stack=focusllm@results/focusllm/adapter-recall-local
             opts=(-o focusllm.topk=4 -o focusllm.overlap=64) ;;
        smt-adapter) stack=@results/smt/adapter ;;  # results/smt's adapter for SmolLM2: YaRN x4 + SMT's LoRA
    esac
    $LCX eval compare ruler -m "$1" --stack "$stack" "${opts[@]}" --lengths "$3" "${COMMON[@]}" \
        --out "results/ruler/$1/$2${4:+-x$4}/$3"
}
crosscheck() {  # $1 model: lm-eval's niah_single_1 through the lcx model next to lcx's own single-needle task
    $LCX eval ruler -m "$1" --tasks niah_single_number --lengths 4K,8K "${COMMON[@]}" \
        --out "results/ruler/$1/crosscheck-lcx"
    for n in 4096 8192; do  # one length per run: lm-eval's --limit takes the first samples of all lengths
        HF_DATASETS_OFFLINE=1 LCX_DTYPE=bfloat16 $LCX eval lm-eval run --model lcx --tasks niah_single_1 \
            --model_args "model=$1" --limit 5 \
            --metadata "{\"max_seq_lengths\": [$n]}" --log_samples --output_path "results/ruler/$1/crosscheck-lm-eval-$n"
    done
}

served() {  # $1 model: lm-eval's niah_single_1 at 4K through `lcx serve` (the bare model) and lm-eval's local-completions
    local port=8123 dir="results/ruler/$1/served-lm-eval-4096"
    $LCX serve "$1" --port $port --max-model-len 8192 --dtype bfloat16 > "/tmp/lcx-serve-$1.log" 2>&1 &
    local pid=$!
    trap 'kill $pid 2>/dev/null' RETURN
    until curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null; do
        kill -0 $pid 2>/dev/null || { cat "/tmp/lcx-serve-$1.log"; return 1; }
        sleep 5
    done
    HF_DATASETS_OFFLINE=1 .venv/bin/lm_eval run --model local-completions --tasks niah_single_1 --limit 5 \
        --model_args "model=$1,base_url=http://127.0.0.1:$port/v1/completions,tokenizer=$HOME/.cache/lcx/models/$1,tokenized_requests=False,num_concurrent=1,max_retries=1" \
        --metadata '{"max_seq_lengths": [4096]}' --log_samples --output_path "$dir"
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=("crosscheck gemma3-270m" "served gemma3-270m" "bare gemma3-270m 8K" "bare gemma3-270m 32K"
    "beyond gemma3-270m fot 64K" "beyond gemma3-270m streaming 64K" "beyond gemma3-270m focusllm 64K"
    "bare qwen2.5-0.5b 8K" "bare qwen2.5-0.5b 32K" "beyond qwen2.5-0.5b fot 64K"
    "beyond qwen2.5-0.5b streaming 64K" "beyond qwen2.5-0.5b focusllm 64K"
    "bare smollm2-135m 4K,8K" "beyond smollm2-135m fot 16K,32K" "beyond smollm2-135m streaming 16K,32K"
    "beyond smollm2-135m focusllm 16K,32K" "beyond smollm2-135m focusllm-adapter 16K,32K"
    "bare gemma3-270m 16K" "beyond gemma3-270m vanilla 64K" "beyond gemma3-270m rope 64K 2"
    "beyond gemma3-270m rope 64K 4" "beyond smollm2-135m vanilla 16K" "beyond smollm2-135m vanilla 32K"
    "beyond smollm2-135m rope 16K 2" "beyond smollm2-135m rope 16K 4" "beyond smollm2-135m smt-adapter 16K")
for s in "${steps[@]}"; do echo "== $s"; $s; done
