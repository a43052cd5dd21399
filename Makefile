# Two commands do everything on a fresh machine: `make test` and `make demo`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: test test-fast test-portability demo regen check bench lint venv clean gpu-check gpu-wheels

# Each step says what it installs before it starts (the whole takes minutes on a fresh machine; pip's own output is
# kept to its warnings and errors).
$(STAMP): pyproject.toml
	@echo "make venv: 1/3 creating $(VENV) and upgrading pip"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "make venv: 2/3 installing the CPU build of torch 2.13.0 (the largest download)"
	# CPU torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	@echo "make venv: 3/3 installing patchgen with the pinned transformers, diffusers and the test tools"
	$(BIN)/pip install -q -e '.[runtime,dev]'
	touch $(STAMP)
	@echo "make venv: done ($(VENV))"

venv: $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	# --full regenerates every body from its inputs: a header whose hashes were recomputed after an edit fails here.
	$(BIN)/patchgen check --full
	$(BIN)/pytest

# The edit loop's tier: the unit and single-process tests, under 3 minutes on 2 cores (docs/architecture.md, Tests).
# `slow` (torch.distributed ranks, new interpreters, the measured-long tests) is marked by tests/conftest.py itself.
test-fast: $(STAMP)
	$(BIN)/pytest -m "not slow"

# The numerics-sensitive suites under every CPU capability this machine can run (default, avx2, avx512): each selects
# other vectorised kernels, i.e. the summation orders of other CPUs. Not part of `make test` (about 2 x its time).
NUMERICS := tests/parity tests/rl tests/dit tests/parallel tests/fidelity
test-portability: $(STAMP)
	set -e; for cap in $$(env -u ATEN_CPU_CAPABILITY $(BIN)/python -m tests.cpu_capabilities); do \
		echo "== ATEN_CPU_CAPABILITY=$$cap =="; \
		ATEN_CPU_CAPABILITY=$$cap $(BIN)/pytest -p no:cacheprovider $(NUMERICS); \
	done

demo: $(STAMP)
	$(BIN)/python -m runtime.demo

regen: $(STAMP)
	$(BIN)/patchgen regen --all

check: $(STAMP)
	$(BIN)/patchgen check

bench: $(STAMP)
	$(BIN)/python bench/codegen.py
	$(BIN)/python bench/train_overhead.py
	$(BIN)/python bench/moe.py
	$(BIN)/python bench/dit.py
	$(BIN)/python bench/dit_train.py
	$(BIN)/python bench/flowgrpo.py
	$(BIN)/python bench/context_parallel.py

# One command for a lent H100/H200, under 8 minutes: versions, `pytest -m gpu` (tests/gpu), generated vs upstream
# measurements, plan vs measured memory (docs/performance.md, "GPU check"). Without CUDA it runs the dry run (tiny
# sizes on CPU, CUDA-only steps reported skipped). GPU_CHECK_OUT: the results folder.
GPU_CHECK_OUT ?= bench/results/gpu_check
gpu-check: $(STAMP)
	$(BIN)/python -m bench.gpu_check --out $(GPU_CHECK_OUT)

# The wheels a GPU machine lacks (no network there), downloaded into .whl/ to be carried with the checkout.
gpu-wheels: $(STAMP)
	PY=$(BIN)/python bash bench/gpu_check/wheels.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check --diff patchgen runtime tests bench

clean:
	rm -rf $(VENV) .pytest_cache
