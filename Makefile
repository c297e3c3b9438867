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

.PHONY: install demo cluster-demo test lint report gpu-check figures clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/mpirun -n $(NP) $(BIN)/python -m mpipar.pipeline

# Two emulated hosts (network namespaces, so it needs root) joined by a 1 Gbit/s link: the
# ping-pong within a host and across the link, then data parallelism with 2 ranks per host.
# mpipar.tools.cluster removes the hosts again, also when the run fails or is interrupted.
cluster-demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m mpipar.tools.cluster --hosts 2 --bandwidth 1gbit \
	    sh -c "mpirun -n 4 python -m mpipar.tools.bench.link --pingpong && \
	           mpirun -n 4 python -m mpipar.data_parallel --sync allreduce --quiet"

lint: $(STAMP)
	$(BIN)/ruff check mpipar tests

test: lint
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q tests

report: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m mpipar.tools.report

# On a machine with a GPU: CuPy (the gpu extra, unless a CuPy is already importable), every
# scheme there against serial training (the tests marked gpu), the engine against bare CuPy and
# data parallelism on the GPU (engine_gpu.csv, dp_gpu.csv in plots/), and REPORT.md's section
# "On a GPU" rewritten from them, the rest of the report left as it is. Without a GPU it stops
# at the first step with the reason.
gpu-check: $(STAMP)
	$(BIN)/python -c "import cupy" 2>/dev/null || $(BIN)/pip install --quiet -e ".[gpu]"
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m mpipar.tools.bench engine --backend cupy --out plots
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -m gpu tests/test_gpu.py
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m mpipar.tools.bench dp --backend cupy --out plots
	$(BIN)/python -m mpipar.tools.report_gpu

# The course's pictures of the ideas, drawn from the code into lessons/figures/ (with data.json,
# the hashes the tests compare: rerun this after changing a schedule, the ring or the grid).
figures: $(STAMP)
	$(BIN)/python -m mpipar.tools.figures

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
