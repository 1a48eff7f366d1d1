#!/usr/bin/env bash
# How results/fot/passkey-streaming-h100/ was made: the streaming baseline at 64K and 128K (one key per depth,
# as streaming32 in run.sh) on one H100 lent through this workplace's device tool for the last ~4 minutes of a
# session.  Carried beforehand, as for bench/results/knn-h100: SmolLM2-135M's weights rounded to fp16 (computed
# in fp32 there) with the model's config/tokenizer files, tarred with SHA256SUMS, sent in 6 pieces appended to
# $KIT; this script runs with the last one.
set -u
cd "$(dirname "$0")/../../.."
KIT=${KIT:-/root/gkit.tar} M=/root/smollm2-135m-fp16-weights O=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cat .gpukit/p* >> "$KIT" && rm -rf .gpukit/p*
sha256sum "$KIT" | grep -q 706a9f28e59c05402963bb70d1d67631918a52c5e04097e1839076a9706818a0 || { ls -l "$KIT"; echo "kit damaged"; exit 1; }
rm -rf /tmp/g && mkdir -p /tmp/g "$M" && tar xf "$KIT" -C /tmp/g && (cd /tmp/g/kit && sha256sum -c --quiet SHA256SUMS) || exit 1
cp /tmp/g/kit/model/*.json /tmp/g/kit/model/*.jinja "$M"/
python3 -c "
from safetensors.torch import load_file, save_file
t = load_file('/tmp/g/kit/model/w16.safetensors'); save_file({k: v.float() for k, v in t.items()}, '$M/model.safetensors', metadata={'format': 'pt'})" || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null || exit 1
timeout ${EVAL_S:-80} python3 -m lcx.cli eval passkey -m "$M" --method streaming --lengths 64K,128K --samples 1 \
  --device cuda --out "$O" --resume > "$O/log.txt" 2>&1
echo "eval rc $?"; tr '\r' '\n' < "$O/log.txt" | grep -v "sample/s\]$\|s/sample\]$\|tok/s\]" | tail -15; ls "$O"
