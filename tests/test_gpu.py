"""Every scheme on a GPU: run only where CuPy and a GPU are present (``make gpu-check``), and
skipped elsewhere with the reason (``make test`` passes on a machine without one; the strict
stand-in, tests/test_strict_backend.py, catches most CuPy breakage there).

Each layout trains 3 steps in float64 with ``--backend cupy`` under mpirun, several ranks
sharing the GPU as a learner's do, and must equal the serial trainer on CuPy and the serial
trainer on NumPy: every parameter within relative 1e-10 (a GPU's reductions add in another
order than the CPU's BLAS, so not bit for bit). The run says where its arrays live and how MPI
reached them, and counts the staged copies.
"""

import re

import pytest
from conftest import assert_params_close, run_mpi

from mpipar import train
from mpipar.engine.backend import cupy_problem

PROBLEM = cupy_problem()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(PROBLEM is not None, reason=f"no GPU run here: {PROBLEM}")]

MLP = ["--model", "mlp", "--sizes", "64,32,24,10", "--batch-size", "16", "--optim", "adam"]
GPT = ["--model", "gpt", "--d-model", "16", "--n-heads", "4", "--n-layers", "2",
       "--seq-len", "8", "--batch-size", "8", "--optim", "adam"]
COMMON = ["--dtype", "float64", "--steps", "3"]
LAYOUTS = {  # name: (ranks, module, model, the scheme's flags)
    "dp master": (2, "data_parallel", MLP, ["--sync", "master"]),
    "dp allreduce, 4 ranks": (4, "data_parallel", MLP, ["--sync", "allreduce"]),
    "dp ring": (2, "data_parallel", GPT, ["--sync", "ring"]),
    "dp buckets, overlap": (2, "data_parallel", GPT, ["--sync", "allreduce", "--bucket-mb", "0.002",
                                                       "--overlap"]),
    "dp zero 1": (2, "data_parallel", MLP, ["--sync", "allreduce", "--zero", "1"]),
    "dp zero 2": (2, "data_parallel", MLP, ["--sync", "allreduce", "--zero", "2"]),
    "dp zero 3": (2, "data_parallel", GPT, ["--sync", "allreduce", "--zero", "3"]),
    "tp": (2, "tensor_parallel", GPT, []),
    "tp, sequence parallel": (2, "tensor_parallel", GPT, ["--sequence-parallel"]),
    "pp gpipe": (2, "pipeline", MLP, ["--schedule", "gpipe", "--micro-batches", "4"]),
    "pp 1f1b": (2, "pipeline", GPT, ["--schedule", "1f1b", "--micro-batches", "4"]),
    "pp interleaved": (2, "pipeline", MLP, ["--schedule", "interleaved", "--micro-batches", "4"]),
    "pp zb-h1": (2, "pipeline", GPT, ["--schedule", "zb-h1", "--micro-batches", "4"]),
    "hybrid dp x tp": (4, "hybrid", GPT, ["--dp", "2", "--tp", "2"]),
    "hybrid dp x pp": (4, "hybrid", GPT, ["--dp", "2", "--pp", "2", "--micro-batches", "2"]),
}


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    """The serial trainer's parameters per model, on NumPy (in this process) and on CuPy."""
    folder, found = tmp_path_factory.mktemp("serial"), {}
    for name, model in (("mlp", MLP), ("gpt", GPT)):
        train.main("serial", [*model, *COMMON, "--quiet", "--save-params",
                              str(folder / f"{name}-numpy.npz")])
        run_mpi(1, ["-m", "mpipar.serial", *model, *COMMON, "--quiet", "--backend", "cupy",
                    "--save-params", folder / f"{name}-cupy.npz"])
        found[name] = {backend: train.load_params(folder / f"{name}-{backend}.npz")
                       for backend in ("numpy", "cupy")}
    return found


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_scheme_on_the_gpu_equals_serial_training(layout, serial, tmp_path):
    ranks, module, model, flags = LAYOUTS[layout]
    saved = tmp_path / "params.npz"
    out = run_mpi(ranks, ["-m", f"mpipar.{module}", *model, *flags, *COMMON, "--backend", "cupy",
                          "--save-params", saved], timeout=300).stdout
    assert re.search(r"backend cupy: local rank 0 on GPU 0 of \d+; ", out), out
    assert re.search(r"staged for MPI on this rank: [1-9]\d* copies", out) or \
        "CUDA-aware" in out, out
    got = train.load_params(saved)
    for backend, want in serial["mlp" if model is MLP else "gpt"].items():
        assert_params_close(got, want, f"{layout} against serial on {backend}")


def test_the_engine_benchmark_runs_on_the_gpu(tmp_path):
    run_mpi(1, ["-m", "mpipar.tools.bench", "engine", "--backend", "cupy", "--quick", "--out",
                tmp_path], timeout=300)
    text = (tmp_path / "engine_gpu.csv").read_text()
    assert "bare_cupy_ms" in text and text.count("\n") == 4  # a header and 16, 32, 128 rows
