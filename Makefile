# Two entry points (see README): `make demo` and `make test`. Both set everything up first;
# re-running is fast once set up (scripts/setup.sh is idempotent).
.PHONY: setup demo test test-fast bench

VENV ?= .venv
# fot in the configuration results/fot measured on SmolLM2-135M (25/25 passkeys at 16K and 32K): local window
# 1024, chunk 256, memory in the 12 layers `lcx analyze retrieval` found retrieving (results/README.md).
# Every other method runs its defaults.  `make demo DEMO_OPTIONS=` runs fot's defaults too.
DEMO_OPTIONS ?= -o fot.local=1024 -o fot.chunk=256 -o fot.memory_layers=6,7,8,14,15,17,18,19,20,21,22,23

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/lcx demo $(DEMO_OPTIONS)

test: setup
	$(VENV)/bin/python -m pytest -q

test-fast: setup
	$(VENV)/bin/python -m pytest -q -m "not slow and not vllm"

bench: setup
	$(VENV)/bin/python bench/overhead.py
