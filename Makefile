# Workstation path: a local venv with the CPU torch wheel and MPICH from PyPI.
# Clusters: see docs/tutorials/pbs-cluster.md (system MPI + its mpi4py, preinstalled torch).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --quiet -c constraints/workstation.txt

.PHONY: install quickstart test lint bench clean docs docs-build

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
# two workers overlap on two cores; more would oversubscribe the ranks' own cores.
# tests/test_docs.py builds the docs site with `mkdocs build --strict` and checks the generated reference.
test: lint
	$(BIN)/python -m pytest -n 2

# The documentation site (mkdocs.yml, docs/): `make docs` serves it at http://127.0.0.1:8000,
# `make docs-build` checks it and writes site/.
docs: $(VENV)/.test-installed
	$(BIN)/mkdocs serve

docs-build: $(VENV)/.test-installed
	$(BIN)/mkdocs build --strict

bench: install
	$(BIN)/mpiexec -n 5 $(BIN)/mpifl bench exchange --model-mb 1000 --rounds 3 --pickle-rounds 1

clean:
	rm -rf $(VENV) runs site
