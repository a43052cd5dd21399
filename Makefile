# Two commands do everything on a fresh machine: `make test` and `make demo`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: test test-fast test-portability demo regen check bench lint venv clean gpu-check gpu-wheels

# Each step says what it installs before it starts (the whole takes minutes on a fresh machine; pip's own output is
# kept to its warnings and errors). pip would compile every installed module to bytecode one file after another
# (about 60 s of the build); compileall does the same on every core once everything is in (docs/performance.md).
# Like pip, it leaves a file whose syntax this Python cannot compile (torch ships one for Python 3.12) uncompiled.
$(STAMP): pyproject.toml
	@echo "make venv: 1/4 creating $(VENV) and upgrading pip"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "make venv: 2/4 installing the CPU build of torch 2.13.0 (the largest download)"
	# CPU torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q --no-compile torch==2.13.0
	@echo "make venv: 3/4 installing patchgen with the pinned transformers, diffusers and the test tools"
	$(BIN)/pip install -q --no-compile -e '.[runtime,dev]'
	@echo "make venv: 4/4 compiling the installed modules to bytecode on every core"
	$(BIN)/python -m compileall -q -j 0 -x 'py312_intrinsics' "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
	touch $(STAMP)
	@echo "make venv: done ($(VENV))"

venv: $(STAMP)

# Two pytest-xdist workers, a test file each at a time (tests/conftest.py: why loadfile, and the longest files first):
# the serial run left one of the two cores idle most of the time (docs/performance.md, "make test"). One intra-op
# thread per worker (OMP_NUM_THREADS=1, as the spawned test ranks already run): two workers of two threads each on
# two cores spin against each other (measured: 7% wall, 14% CPU on tests/dit + tests/parity).
XDIST := -n 2 --dist loadfile
PYTEST := OMP_NUM_THREADS=1 $(BIN)/pytest

# `patchgen check --full` (every body regenerated from its inputs: a header whose hashes were recomputed after an
# edit fails it) runs inside pytest, on a copy of the project, with `check` and without torch
# (tests/engine/test_cli.py::test_check_passes_and_never_imports_torch_or_transformers): not a second time here.
test: $(STAMP)
	$(BIN)/ruff check .
	$(PYTEST) $(XDIST)

# The edit loop's tier: the unit and single-process tests, under 3 minutes on 2 cores (docs/architecture.md, Tests).
# `slow` (torch.distributed ranks, new interpreters, the measured-long tests) is marked by tests/conftest.py itself.
test-fast: $(STAMP)
	$(PYTEST) $(XDIST) -m "not slow"

# The numerics-sensitive suites under every kernel level this machine can run (tests/cpu_capabilities.py: ATen's
# capability, MKL's instruction ceiling and code branch, oneDNN's ISA ceiling together, lowest first): each level sums in the orders
# of another CPU and its BLAS. NUMERICS run whole; LAYOUTS run their layout-parity tests (marked dist: ranks against
# one process). Not part of `make test` (docs/architecture.md, "Portability": what it covers and what it cannot).
NUMERICS := tests/test_rounding.py tests/parity tests/dit tests/parallel tests/fidelity tests/moe tests/omni
LAYOUTS  := tests/rl tests/train
KERNEL_VARS := ATEN_CPU_CAPABILITY MKL_ENABLE_INSTRUCTIONS MKL_CBWR ONEDNN_MAX_CPU_ISA
test-portability: $(STAMP)
	env $(addprefix -u ,$(KERNEL_VARS)) $(BIN)/python -m tests.cpu_capabilities | while read -r level; do \
		echo "== $$level =="; \
		env $$level $(PYTEST) $(XDIST) -p no:cacheprovider $(NUMERICS) || exit 1; \
		env $$level $(PYTEST) $(XDIST) -p no:cacheprovider -m dist $(LAYOUTS) || exit 1; \
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

# The wheels a GPU machine lacks (no network there), downloaded into .whl/ to be carried with the checkout, in place
# of the wheels there and pinned by hash in .whl/requirements.txt (installed with pip --require-hashes).
gpu-wheels: $(STAMP)
	PY=$(BIN)/python bash bench/gpu_check/wheels.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check --diff patchgen runtime tests bench

clean:
	rm -rf $(VENV) .pytest_cache
