"""The serial trainer learns, and --save-params round-trips."""

import subprocess
import sys

import numpy as np
import pytest

from mpipar import serial, train
from mpipar.engine import backend as B
from mpipar.engine import data
from mpipar.runner.cli import parse_args


def test_mlp_reaches_95_percent(capsys):
    train.main("serial", ["--model", "mlp", "--quiet"])
    out = capsys.readouterr().out
    acc = float(out.split("test accuracy")[1].split()[0])
    assert acc >= 0.95, out


def test_gpt_beats_character_frequencies(capsys):
    train.main("serial", ["--model", "gpt", "--quiet", "--steps", "120"])
    out = capsys.readouterr().out
    val = float(out.split("val loss")[1].split(",")[0])
    unigram = float(out.split("unigram loss")[1].split()[0])
    assert val < unigram - 0.3, out


def test_save_params_round_trip(tmp_path, capsys):
    path = tmp_path / "p.npz"
    train.main("serial", ["--model", "gpt", "--quiet", "--steps", "2", "--dtype", "float64",
                 "--d-model", "16", "--n-layers", "2", "--seq-len", "8",
                 "--save-params", str(path)])
    saved = train.load_params(path)
    args = parse_args("serial", ["--model", "gpt", "--dtype", "float64", "--d-model", "16",
                                 "--n-layers", "2", "--seq-len", "8", "--steps", "2"])
    task = serial.Task(args)
    model = task.build_model().init(0)
    opt = serial.make_optimizer(args, model.parameters())
    for step in range(2):
        serial.train_step(model, task.loss_fn, opt, *task.to_device(*task.batch(step)))
    names = [n for n, _ in model.named_parameters()]
    assert sorted(saved) == sorted(names)
    for n, p in model.named_parameters():
        np.testing.assert_array_equal(saved[n], B.to_numpy(p.data), err_msg=n)
    assert saved["blocks.1.attn.qkv.W"].dtype == np.float64


def test_digits_are_scikit_learns_without_importing_it():
    """data.digits_table reads the file load_digits reads, to the same values, in a process
    that never imports scikit-learn (its import is most of a short run's start-up)."""
    from sklearn.datasets import load_digits

    table, reference = data.digits_table(), load_digits()
    assert np.array_equal(table[:, :-1], reference.data)
    assert np.array_equal(table[:, -1].astype(int), reference.target)
    code = ("import sys; from mpipar.engine import data; data.Digits(); "
            "print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_batches_depend_on_seed_and_step_only():
    a, b = data.Digits(3), data.Digits(3)
    np.testing.assert_array_equal(a.batch(7, 32)[0], b.batch(7, 32)[0])
    assert not np.array_equal(a.batch(7, 32)[0], a.batch(8, 32)[0])
    t = data.Text(0)
    x, y = t.batch(0, 4, 16)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # the target is the next character


@pytest.mark.parametrize("module", ["data_parallel", "tensor_parallel", "pipeline", "hybrid"])
def test_an_unknown_flag_is_one_message_and_exit_2_on_every_rank(mpirun, module):
    proc = mpirun(2, ["-m", f"mpipar.{module}", "--no-such-flag"], timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("error: unrecognized arguments: --no-such-flag") == 1, proc.stderr
    assert "usage:" not in proc.stderr


def test_the_reference_does_not_start_mpi():
    """Importing the one-process reference (and the model, data and optimizer) loads no MPI."""
    code = ("import sys, mpipar.serial, mpipar.engine.nn, mpipar.engine.optim, mpipar.engine.data; "
            "print(sorted(m for m in sys.modules if m.startswith(('mpi4py', 'mpipar.mpi.comm'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == "[]", out


def test_synthetic_rows_depend_on_their_shape_and_batches_on_seed_and_step():
    a, b = data.Synthetic(30, 5, 200, seed=0), data.Synthetic(30, 5, 200, seed=1)
    np.testing.assert_array_equal(a.x_train, b.x_train)  # the data set: its shape alone
    assert a.x_train.shape == (160, 30) and set(a.y_train) == set(range(5))
    assert not np.array_equal(a.batch(0, 8)[0], b.batch(0, 8)[0])  # the batches: the seed
    np.testing.assert_array_equal(a.batch(3, 8)[0], data.Synthetic(30, 5, 200).batch(3, 8)[0])
