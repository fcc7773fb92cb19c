# Workstation path: a local venv with the CPU torch wheel and MPICH from PyPI.
# Clusters: see docs/tutorials/pbs-cluster.md (system MPI + its mpi4py, preinstalled torch).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --quiet -c constraints/workstation.txt

.PHONY: install quickstart test lint bench clean docs docs-build gpu-check

# The quick start installs only what it runs: the package (CPU torch) and MPICH's mpiexec.
install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml constraints/workstation.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(PIP) -e '.[mpich]'
	touch $@

# The suite adds the test extra (transformers, memray, ...), the style gate and the docs site.
$(VENV)/.test-installed: $(VENV)/.installed setup.cfg
	$(PIP) -e '.[mpich,test,docs]'
	touch $@

quickstart: install
	$(BIN)/mpiexec -n 3 $(BIN)/mpifl run configs/quickstart.yaml

# The style gate: ruff (pycodestyle, pyflakes, import order, bugbear, pyupgrade, docstrings) and mypy.
lint: $(VENV)/.test-installed
	$(BIN)/ruff check mpifl tests profiling examples docs
	$(BIN)/mypy

# Two pytest workers: most of the suite's time is MPI jobs starting up (torch imports), which
# two workers overlap on two cores. Three were slower here (2026-11-25: half the suite in 18 min,
# against all of it in 23.5 min with two, and 5 failures; docs/benchmarks.md#reliability). Measured again
# 2026-12-03 (docs/explanation/testing.md): two workers keep the two cores 88% busy on a quiet machine, so a
# third could save at most about a tenth, and with a benchmark beside it three and four took the same 16 min.
# tests/test_docs.py builds the docs site with `mkdocs build --strict` and checks the generated reference.
# --durations: the 25 slowest tests close the log, where the suite's time goes.
test: lint
	$(BIN)/python -m pytest -n 2 --dist loadgroup --durations=25

# The documentation site (mkdocs.yml, docs/): `make docs` serves it at http://127.0.0.1:8000,
# `make docs-build` checks it and writes site/.
docs: $(VENV)/.test-installed
	$(BIN)/mkdocs serve

docs-build: $(VENV)/.test-installed
	$(BIN)/mkdocs build --strict

# The GPU check (docs/how-to/gpus.md) on a GPU node: a venv that sees the node's own CUDA torch
# (--system-site-packages; pip fetches torch only where none is installed), mpifl with the test extra (MPICH from
# PyPI only where the node has no mpiexec), then the device tests, cuda against cpu, two ranks per client on
# NCCL and client updates per second per GPU, in one table. `python profiling/gpu_check.py --device cpu --quick`
# runs the same steps on a CPU (tests/test_gpu_check.py).
GPU_VENV ?= .venv-gpu
comma := ,
gpu-check:
	$(PYTHON) -m venv --system-site-packages $(GPU_VENV)
	$(PYTHON) profiling/gpu_check.py --share-site-packages $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install --quiet -e '.[test$(if $(shell command -v mpiexec),,$(comma)mpich)]'
	$(GPU_VENV)/bin/python profiling/gpu_check.py --device cuda --bin $(GPU_VENV)/bin

bench: install
	$(BIN)/mpiexec -n 5 $(BIN)/mpifl bench exchange --model-mb 1000 --rounds 3 --pickle-rounds 1

clean:
	rm -rf $(VENV) runs site
