#!/usr/bin/env bash
# The device runs of issue 49's GPU half (an H200 lent for minutes): `auto` on CUDA, the CUDA tests, the bf16
# parity tests on CUDA (tests/test_bf16.py, LCX_TEST_DEVICE=cuda) and bench/dtype.py on the GPU with random
# weights (SmolLM2-135M's and Gemma 3 270M's architectures: the configs and tokenizers travel in gpu-kit/,
# faiss-cpu and gguf as wheels in .whl/; the device has no package index).  $1: seconds the whole run may take.
cd "$(dirname "$0")/../.."
LIMIT=${1:-500}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TQDM_DISABLE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > $OUT/pip.log 2>&1 || { tail -5 $OUT/pip.log; exit 1; }
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> $OUT/pip.log 2>&1 || { tail -5 $OUT/pip.log; exit 1; }
gunzip -f gpu-kit/*/tokenizer.json.gz
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "
import torch, transformers, peft, faiss
from lcx.models import resolve_dtype
print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'faiss', faiss.__version__)
print('capability', torch.cuda.get_device_capability(), '-> auto on cuda:', resolve_dtype('auto', 'cuda'), '| auto on cpu:', resolve_dtype('auto', 'cpu'))
"
echo "== CUDA tests (tests/test_device.py), tests/test_dtype.py, bf16 parity on CUDA (tests/test_bf16.py) at ${SECONDS}s"
timeout 60 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/test_device.py tests/test_dtype.py > $OUT/tests-device-dtype.log 2>&1
tail -12 $OUT/tests-device-dtype.log
LCX_TEST_DEVICE=cuda timeout 45 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_bf16.py > $OUT/tests-bf16-cuda.log 2>&1
tail -4 $OUT/tests-bf16-cuda.log
for m in smollm2-135m gemma3-270m; do
    left=$(( LIMIT - SECONDS - 5 )); [ $left -gt 20 ] || break
    echo "== bench/dtype.py on the GPU, $m's architecture, 16K, at ${SECONDS}s (at most ${left}s)"
    timeout $left python3 bench/dtype.py --device cuda --random-weights --model gpu-kit/$m \
        --tokens 16K --new 8 --out $OUT/dtype-cuda-h200-$m.json > $OUT/bench-$m.log 2>&1
    grep -v "^fot: memory layers" $OUT/bench-$m.log | tail -12
done
echo "done at ${SECONDS}s"
