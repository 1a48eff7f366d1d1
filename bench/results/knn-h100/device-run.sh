#!/usr/bin/env bash
# How bench/results/knn-h100/ was made: faiss-gpu on one H100 lent through this workplace's device tool, where
# nothing can be fetched and a call carries at most 64 MiB.  Here, beforehand:
#   pip download faiss-gpu==1.15.1 nvidia-cublas-cu12==12.1.3.1 nvidia-cuda-runtime-cu12==12.1.105
#     nvidia-curand-cu12==10.3.7.77 zstandard==0.25.0 (cp312); faiss's files, cuBLAS's two libraries and cuRAND's
#     recompressed with zstd -19 --long=30 (cuBLAS 12.1 defines every cuBLAS/cudart symbol libfaiss.so needs);
#   tar cf kit.tar kit/ (SHA256SUMS inside), split -b 45700000 into 8 pieces, sent one per call in .gpukit/ and
#   appended to $KIT there.  This script runs with the last piece (the image has torch 2.11 + CUDA 13 and pytest).
# faiss-gpu-cu12 1.14.1 (lcx[gpu] until then) failed there: "CUDA error 209 no kernel image is available" (no sm_90).
set -u
cd "$(dirname "$0")/../../.."
KIT=${KIT:-/root/kit.tar}
S=${SITE:-/tmp/site}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cat .gpukit/p* >> "$KIT" && rm -rf .gpukit/p*
sha256sum "$KIT" | grep -q c13508633dcbea9ec7b43720ec1796f1ba7453fef826c5cfb60e4c3078cc67cc \
  || { ls -l "$KIT"; echo "kit damaged"; exit 1; }
rm -rf /tmp/k "$S" && mkdir -p /tmp/k && tar xf "$KIT" -C /tmp/k \
  && (cd /tmp/k/kit && sha256sum -c --quiet SHA256SUMS) || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target "$S" /tmp/k/kit/*.whl || exit 1
PYTHONPATH="$S" python3 - "$S" <<'PY' || exit 1
import os, sys, tarfile, zstandard
site, kit = sys.argv[1], "/tmp/k/kit"
d = zstandard.ZstdDecompressor(max_window_size=2**31)
for src, lib in (("cublas.zst", "cublas/lib/libcublas.so.12"), ("cublasLt.zst", "cublas/lib/libcublasLt.so.12"),
                 ("curand.zst", "curand/lib/libcurand.so.10")):  # nvidia-*-cu12's layout, where faiss preloads
    os.makedirs(os.path.dirname(f"{site}/nvidia/{lib}"), exist_ok=True)  # after pip: --target skips folders there
    with open(f"{kit}/{src}", "rb") as f, open(f"{site}/nvidia/{lib}", "wb") as o:
        d.copy_stream(f, o)
with open(f"{kit}/faiss115.tar.zst", "rb") as f, d.stream_reader(f) as r, tarfile.open(fileobj=r, mode="r|") as t:
    t.extractall(site)
print("kit unpacked into", site)
PY
export PYTHONPATH="$S"  # faiss preloads CUDA 12's libraries from nvidia/<name>/lib on the path
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null || exit 1
python3 -c "import faiss, torch, transformers as t; print('faiss', faiss.__version__, 'GPUs', faiss.get_num_gpus(), \
'| torch', torch.__version__, torch.cuda.get_device_name(), '| transformers', t.__version__)" || exit 1
O=${OUT:-/tmp/out}; mkdir -p "$O"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_memory.py tests/test_device.py 2>&1 | tee "$O/pytest.log" | tail -30
timeout 240 python3 bench/knn.py --gpu --out "$O/knn.json" 2>&1 | tee "$O/knn.log" | grep -v '^ \|^{\|^}'
