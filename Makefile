# Two entry points (see README): `make demo` and `make test`. Both set everything up first;
# re-running is fast once set up (scripts/setup.sh is idempotent).
.PHONY: setup demo test test-fast bench

VENV ?= .venv
# Every method runs its defaults (fot's memory layers are measured on the model at first use and cached beside
# it); `make demo DEMO_OPTIONS="-o fot.local=1024"` sets a row's options.
DEMO_OPTIONS ?=

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
