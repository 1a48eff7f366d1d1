#!/usr/bin/env bash
# The second device run (bench/results/focusllm_scaling-cuda-h200-bf16*.json): as focusllm-cuda-run.sh, in bfloat16,
# parallel 8 and parallel 0 (all chunks in one forward).
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/pip.log 2>&1 || { tail -5 $OUT/pip.log; exit 1; }
[ -d ../shared/data/books ] || { mkdir -p ../shared/data && cp -r gpu-kit/books ../shared/data/; }
M=gpu-kit/smollm2
timeout 220 python3 bench/focusllm_scaling.py --model $M --random-weights --device cuda --dtype bfloat16 \
  --lengths 8K,32K,128K --parallel 8 --full-max 128K --out $OUT/focusllm_scaling-cuda-h200-bf16.json 2>&1 \
  | grep -v 'it/s\]$' | grep -v '^    \|^Traceback\|^  File'
echo "parallel 8 done at ${SECONDS}s"
timeout $((400 - SECONDS)) python3 bench/focusllm_scaling.py --model $M --random-weights --device cuda --dtype bfloat16 \
  --lengths 8K,32K,128K --parallel 0 --full-max 1K --out $OUT/focusllm_scaling-cuda-h200-bf16-all.json 2>&1 | grep -v 'it/s\]$'
echo "parallel 0 done at ${SECONDS}s"
ls -l $OUT
