#!/usr/bin/env bash
# Reproduces results/fot/ (issue: FoT part 1, training-free). 2 CPU cores: retrieval ~4 min, passkey 16K ~1 h.
set -euo pipefail
cd "$(dirname "$0")/../.."
# 1. which layers copy from far context (keys from seed 12345, not the eval's): suggests memory_layers
.venv/bin/lcx analyze retrieval -m smollm2-135m --keys 2 --out results/fot/retrieval
# 2. passkey at 16K: fot with those layers vs the vanilla and streaming baselines, 5 depths x 5 keys each
.venv/bin/lcx eval compare passkey -m smollm2-135m --stack fot --stack vanilla --stack streaming --lengths 16K \
    -o fot.local=1024 -o fot.chunk=256 -o fot.memory_layers=6,7,8,14,15,17,18,19,20,21,22,23 \
    --out results/fot/passkey-16k
