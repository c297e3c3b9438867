# mpipar: `make demo` trains a model on 4 ranks, `make test` runs the whole suite.
# Each target installs what it needs into .venv first, so a fresh clone needs nothing else.

PYTHON  ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
NP      ?= 4

# One BLAS thread per rank: several ranks share the cores, and threads beyond them only fight.
export OMP_NUM_THREADS := 1
export OPENBLAS_NUM_THREADS := 1
export MKL_NUM_THREADS := 1

.PHONY: install demo test lint report clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/mpirun -n $(NP) $(BIN)/python -m mpipar.pipeline

lint: $(STAMP)
	$(BIN)/ruff check mpipar tests

test: lint
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q tests

report: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m mpipar.report

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
