# Two entry points (see README): `make demo` and `make test`. Both set everything up first;
# re-running is fast once set up (scripts/setup.sh is idempotent).
.PHONY: setup demo test test-fast bench

VENV ?= .venv
# fot runs the passkey configuration results/fot measured on SmolLM2-135M (local 1024, chunk 256, FoT's own
# positions, no sinks, no gate): its defaults keep perplexity near truncation's but miss this key
# (results/fot/defaults).  Its memory layers are its default, auto: measured on the model at first use and cached
# beside it.  focusllm runs over the candidate adapter results/focusllm trained for SmolLM2-135M, with the inference
# options its passkey grids were measured with (topk 4, overlap 64).  `make demo DEMO_OPTIONS=` runs every default.
DEMO_OPTIONS ?= -o fot.local=1024 -o fot.chunk=256 -o fot.sinks=0 -o fot.positions=first -o fot.gate=off \
	--adapter focusllm=results/focusllm/adapter-recall-local -o focusllm.topk=4 -o focusllm.overlap=64

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
