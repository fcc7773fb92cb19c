# Workstation path: a local venv with the CPU torch wheel and MPICH from PyPI.
# Clusters: see README "On a cluster" (system MPI + its mpi4py, preinstalled torch).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: install quickstart test bench clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml constraints/workstation.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install -c constraints/workstation.txt -e '.[mpich,test]'
	touch $@

quickstart: install
	$(BIN)/mpiexec -n 3 $(BIN)/mpifl run configs/quickstart.yaml

# Two pytest workers: most of the suite's time is MPI jobs starting up (torch imports), which
# two workers overlap on two cores; more would oversubscribe the ranks' own cores.
test: install
	$(BIN)/python -m pytest -n 2

bench: install
	$(BIN)/mpiexec -n 5 $(BIN)/mpifl bench exchange --model-mb 1000 --rounds 3 --pickle-rounds 1

clean:
	rm -rf $(VENV) runs
