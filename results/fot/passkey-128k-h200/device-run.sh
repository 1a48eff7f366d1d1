#!/usr/bin/env bash
# How the committed 128K GPU run was made (device tool of this workplace: 64 MiB per call, no registry there).
# Here: fp16 copy of the weights, split into 46 MB pieces sent one per call and appended to /root/w16 there:
#   python -c "from safetensors.torch import load_file, save_file; import torch; t = load_file(\"$HOME/.cache/lcx/models/smollm2-135m/model.safetensors\"); save_file({k: v.to(torch.float16) for k, v in t.items()}, \"/tmp/w16.safetensors\", metadata={\"format\": \"pt\"})"
#   split -b 46000000 -d -a 1 /tmp/w16.safetensors gpu-kit/w/p      # + config.json and tokenizer files in gpu-kit/smollm2
# There (this script, after `pip install --no-deps --no-build-isolation --no-index -e .` and the 6 pieces):
# device run: fot passkey at 128K on SmolLM2-135M (weights carried as fp16, computed in fp32), exact torch memory
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
M=/root/smollm2-135m-fp16-weights
ls -l /root/w16; sha256sum /root/w16 | grep -q d8d8571b3af99053c8ad455ce009d8479eec5da515f80a417c075d0a7f317904 || { echo "weights damaged"; exit 1; }
python3 -c "
from safetensors.torch import load_file, save_file
t = load_file('/root/w16'); save_file({k: v.float() for k, v in t.items()}, '$M/model.safetensors', metadata={'format': 'pt'})
print(len(t), 'tensors to fp32')"
python3 -c "import lcx; print('lcx from', lcx.__file__)" || exit 1
mkdir -p /root/pk128
timeout 520 python3 -m lcx.cli eval compare passkey -m $M --stack fot --stack vanilla --lengths 128K \
  -o fot.local=1024 -o fot.chunk=256 -o fot.memory_layers=6,7,8,14,15,17,18,19,20,21,22,23 -o fot.backend=torch \
  -o fot.sinks=0 -o fot.positions=first -o fot.fixed_distance=0 -o fot.gate=off \
  --device cuda --out /root/pk128 --resume > /root/pk128/log.txt 2>&1
echo "eval rc $?"
tr '\r' '\n' < /root/pk128/log.txt | grep -v "sample/s\]$\|s/sample\]$" | tail -25
cp /root/pk128/* $OUT/; ls -l $OUT
