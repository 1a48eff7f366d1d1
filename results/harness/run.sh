#!/usr/bin/env bash
# Reproduces results/harness/ (issue: training and evaluation harness). ~35 min on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
BOOKS=../shared/data/books
.venv/bin/lcx eval compare ppl -m smollm2-135m --stack none --stack vanilla --stack rope -o rope.factor=2 \
    -d $BOOKS/wells_invisible_man.txt -d $BOOKS/doyle_hound_of_the_baskervilles.txt \
    --contexts 2K,4K,8K,16K --target 256 --out results/harness/ppl --json
.venv/bin/lcx analyze attention -m smollm2-135m -d $BOOKS/austen_pride_and_prejudice.txt --length 4096 \
    --out results/harness/attention --json
