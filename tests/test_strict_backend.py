"""The serial step runs on an array module that refuses implicit host conversions (as CuPy
does) and gives NumPy's parameters bit for bit: no layer, loss, optimizer or data path turns
a device array into a host one behind the code's back."""

import numpy as np
import pytest
import strict_xp

from mpipar import serial
from mpipar.engine import backend as B
from mpipar.runner.cli import parse_args

FLAGS = {
    "mlp": ["--model", "mlp", "--optim", "adam", "--batch-size", "16"],
    "gpt": ["--model", "gpt", "--optim", "adam", "--batch-size", "4", "--d-model", "16",
            "--n-layers", "2", "--seq-len", "8"],
}


@pytest.fixture
def strict(monkeypatch):
    """``backend.xp`` set to the strict module for one test (the autouse fixture restores
    NumPy afterwards; monkeypatch restores it too)."""
    monkeypatch.setattr(B, "xp", strict_xp)
    return strict_xp


def test_strict_module_refuses_what_cupy_refuses(strict):
    a, host = strict.arange(3.0), np.arange(3.0)
    for convert in (np.asarray, np.array):
        with pytest.raises(TypeError):
            convert(a)
    for mix in (lambda: a + host, lambda: np.exp(host) * a, lambda: strict.exp(host),
                lambda: strict.concatenate([a, host]), lambda: a.dot(host)):
        with pytest.raises(TypeError):
            mix()
    b = np.exp(a) * a + 1.0
    assert isinstance(b, strict.ndarray) and isinstance(b.get(), np.ndarray)
    assert np.array_equal(b.get(), np.exp(host) * host + 1.0) and float(b.sum()) > 0
    assert type(B.to_numpy(b)) is np.ndarray and B.host(b) is not b


def one_step(args):
    """The parameters (host copies), the loss and the held-out evaluation after one serial
    step."""
    trainer = serial.Serial(serial.Task(args), None, args)
    loss = trainer.step(0)
    on_device = {type(p.data) for p in trainer.model.parameters()}
    assert on_device == {B.xp.ndarray}, on_device
    return trainer.full_params(), float(loss), trainer.task.evaluate(trainer.model.forward)


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_one_step_on_the_strict_module_equals_numpy(kind, monkeypatch):
    # parse_args selects the module of --backend (numpy), so the strict one is set after it
    args = parse_args("serial", FLAGS[kind] + ["--dtype", "float64", "--steps", "1"])
    reference, reference_loss, reference_quality = one_step(args)
    monkeypatch.setattr(B, "xp", strict_xp)
    params, loss, quality = one_step(args)
    assert loss == reference_loss and quality == reference_quality
    assert sorted(params) == sorted(reference)
    for name, value in params.items():
        assert type(value) is np.ndarray, name
        np.testing.assert_array_equal(value, reference[name], err_msg=name, strict=True)


def test_staging_is_one_counted_copy_each_way(strict, monkeypatch):
    """MPI without CUDA support reads a host copy of a device array and writes into a host
    buffer that is then copied to the device: each crossing is counted; host arrays (the
    pipeline's headers) and, with a CUDA-aware MPI, device arrays go to MPI as they are."""
    monkeypatch.setattr(B, "STAGED", dict.fromkeys(B.STAGED, 0))
    a = strict.arange(6.0).reshape(2, 3)
    sent = B.host(a)
    assert type(sent) is np.ndarray and np.array_equal(sent, np.arange(6.0).reshape(2, 3))
    buf, dev = B.host_out(a)
    assert type(buf) is np.ndarray and dev is a
    buf[...] = 7.0
    B.copy_back(buf, dev)
    assert np.array_equal(a.get(), np.full((2, 3), 7.0))
    assert B.STAGED == {"copies": 2, "to host": 48, "to device": 48}
    assert B.staged_line() == ("staged for MPI on this rank: 2 copies, 0.000 MB device->host, "
                               "0.000 MB host->device")
    header = np.zeros(3)
    assert B.host(header) is header and B.host_out(header) == (header, None)
    monkeypatch.setattr(B, "CUDA_AWARE", True)
    assert B.host(a) is a and B.host_out(a) == (a, None)
    assert B.STAGED["copies"] == 2 and "staged through" not in B.describe()


def test_each_rank_takes_its_local_rank_modulo_the_gpus():
    assert [B.device_for(r, 1) for r in range(4)] == [0, 0, 0, 0]  # a learner's one GPU
    assert [B.device_for(r, 4) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_a_pip_mpich_is_not_cuda_aware_unless_told(monkeypatch):
    monkeypatch.delenv("MPIPAR_CUDA_AWARE", raising=False)
    assert B.cuda_aware() is False  # MPIX_Query_cuda_support answers 0
    monkeypatch.setenv("MPIPAR_CUDA_AWARE", "1")
    assert B.cuda_aware() is True


def test_distributed_schemes_on_the_strict_module_equal_numpy(mpirun, tmp_path):
    """Every scheme's staging of device arrays through host buffers for MPI, against NumPy
    bit for bit (tests/mpi/strict_checks.py: the schemes and layouts it runs)."""
    for n, wait in ((2, "spin"), (4, "backoff")):
        proc = mpirun(n, ["tests/mpi/strict_checks.py", tmp_path], timeout=60,
                      env={"MPIPAR_WAIT": wait})
        assert "strict checks passed:" in proc.stdout and "hybrid" in proc.stdout


def test_the_engine_benchmark_runs_both_steps_on_a_device_module(strict, monkeypatch):
    """`bench engine --backend cupy`'s timed part on the stand-in: the engine's step and the
    bare step (written with the module's calls) on device arrays, agreeing on the loss."""
    from mpipar.tools.bench import engine

    monkeypatch.setattr(B, "dtype", np.float32)
    engine_s, bare_s, ratio, fastest = engine.measure(16, repeats=2)
    assert engine_s > 0 and bare_s > 0 and ratio > 0 and fastest > 0
