#!/bin/bash
# before (f30c367) and after (HEAD) side by side, float32 as the recorded figures, nothing else running
FOT="--method fot -o fot.local=1024 -o fot.chunk=256 -o fot.memory_layers=6,7,8,14,15,17,18,19,20,21,22,23 --length 2048 --new 64 --rounds 1"
FOC="--method focusllm -o focusllm.refresh=0 --length 4096 --new 64 --rounds 1"
before() { (cd /tmp/before && LCX_DTYPE=float32 PYTHONPATH=/tmp/before_site /work/main/.venv/bin/python bench/serve_throughput.py "$@"); }
after() { (cd /work/main && LCX_DTYPE=float32 .venv/bin/python bench/serve_throughput.py "$@"); }
echo "== fot before"; before $FOT --out /tmp/bench/fot-before.json
echo "== fot after (2)"; after $FOT --out /tmp/bench/fot-after2.json
echo "== focusllm after"; after $FOC --out /tmp/bench/focusllm-after.json
echo "== focusllm before"; before $FOC --out /tmp/bench/focusllm-before.json
echo done
