#!/usr/bin/env bash
# The device run behind bench/results/focusllm_*-cuda-h200.json (device tool of this workplace: the call carries
# the repo + gpu-kit/smollm2 (config.json, tokenizer) + gpu-kit/books; no SmolLM2 weights travel, so the model is
# SmolLM2-135M's architecture with random fp32 weights: speeds and memory only).
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi -L
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/pip.log 2>&1 || { tail -5 $OUT/pip.log; exit 1; }
python3 -c "import lcx, torch, transformers; print('lcx from', lcx.__file__, 'torch', torch.__version__, 'transformers', transformers.__version__)" || exit 1
[ -d ../shared/data/books ] || { mkdir -p ../shared/data && cp -r gpu-kit/books ../shared/data/; }
M=gpu-kit/smollm2
timeout 300 python3 bench/focusllm_scaling.py --model $M --random-weights --device cuda --lengths 8K,32K,128K \
  --parallel 8 --full-max 128K --out $OUT/focusllm_scaling-cuda-h200.json 2>&1 | grep -v 'it/s\]$'
echo "scaling done at ${SECONDS}s"
timeout 120 python3 bench/focusllm_generation.py --model $M --random-weights --device cuda \
  --out $OUT/focusllm_generation-cuda-h200.json 2>&1 | grep -v 'it/s\]$' | tail -30
echo "generation done at ${SECONDS}s"
left=$((440 - SECONDS))
if [ $left -gt 60 ]; then
  timeout $left python3 -m pytest -q -p no:cacheprovider tests/test_device.py -rs 2>&1 | tail -8
fi
ls -l $OUT
