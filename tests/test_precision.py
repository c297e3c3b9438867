"""Number formats and the dynamic loss scale: the formats' facts as their definitions give
them, where fp16 and bf16 overflow and round, and the scale's trajectory through a forced
sequence of overflows exactly as the rules of mpipar/engine/precision.py state them."""

import numpy as np
import pytest

from mpipar.engine import precision as P


@pytest.mark.parametrize("name, exponent, mantissa", [
    ("fp32", 8, 23), ("fp16", 5, 10), ("bf16", 8, 7), ("fp8_e4m3", 4, 3), ("fp8_e5m2", 5, 2)])
def test_the_facts_follow_from_the_bits(name, exponent, mantissa):
    """epsilon 2^-m, smallest normal 2^(2 - 2^(e-1)), smallest subnormal 2^-m times it, and the
    largest number just under 2^(2^(e-1)) (e4m3: 448, its top exponent holding numbers)."""
    f = P.facts(name)
    assert (f["exponent_bits"], f["mantissa_bits"]) == (exponent, mantissa)
    assert f["bits"] == 1 + exponent + mantissa
    bias = 2 ** (exponent - 1) - 1
    assert f["eps"] == 2.0 ** -mantissa
    assert f["smallest_normal"] == 2.0 ** (1 - bias)
    assert f["smallest_subnormal"] == 2.0 ** (1 - bias - mantissa)
    top = 448.0 if name == "fp8_e4m3" else (2 - 2.0 ** -mantissa) * 2.0 ** bias
    assert f["max"] == top


def test_where_fp16_and_bf16_overflow_and_round():
    """The module docstring's examples: in fp16 1e-8 rounds to 0 and 70,000 to inf; bf16
    holds both (fp32's range) but rounds 1 + 2^-9 back to 1."""
    fp16, bf16 = P.dtype_of("fp16"), P.dtype_of("bf16")
    with np.errstate(over="ignore"):
        assert np.array(1e-8, dtype=fp16) == 0 and np.isinf(np.array(7e4, dtype=fp16))
    assert np.array(1e-8, dtype=bf16) > 0 and np.isfinite(np.array(7e4, dtype=bf16))
    assert np.array(1 + 2.0 ** -9, dtype=bf16) == 1
    assert np.array(1 + 2.0 ** -7, dtype=bf16) > 1  # one epsilon is kept


def trajectory(scaler, overflows):
    out = []
    for overflow in overflows:
        taken = scaler.update(overflow)
        out.append((taken, scaler.scale))
    return out


def test_the_scale_follows_megatron_s_rules_with_hysteresis():
    """Growth after 3 finite steps; the first overflow after a growth keeps the scale
    (hysteresis 2), the second and every later one back off; every overflowing step is
    skipped; min_scale bounds the back-off."""
    s = P.LossScaler(init_scale=8.0, growth_interval=3, hysteresis=2, min_scale=2.0)
    got = trajectory(s, [False, False, False, True, False, True, True, True, False, False,
                         False])
    assert got == [(True, 8.0), (True, 8.0), (True, 16.0),  # grows after 3 finite
                   (False, 16.0),  # skipped; hysteresis keeps the scale
                   (True, 16.0),  # the count of finite steps restarted
                   (False, 8.0), (False, 4.0), (False, 2.0),  # out of hysteresis: back off
                   (True, 2.0), (True, 2.0), (True, 4.0)]  # growth resets the hysteresis
    assert s.skipped == 4


def test_hysteresis_1_is_pytorch_s_grad_scaler():
    """PyTorch: back off at every overflow, grow after growth_interval finite steps."""
    s = P.LossScaler(init_scale=2.0 ** 16, growth_interval=2, hysteresis=1, min_scale=0.0)
    got = trajectory(s, [True, False, False, True, True, False])
    assert [scale for _, scale in got] == [2.0 ** 15, 2.0 ** 15, 2.0 ** 16, 2.0 ** 15,
                                           2.0 ** 14, 2.0 ** 14]
    assert [taken for taken, _ in got] == [False, True, True, False, False, True]


def test_the_state_resumes_the_trajectory():
    a = P.LossScaler(init_scale=4.0, growth_interval=2)
    trajectory(a, [False, True])
    b = P.LossScaler(init_scale=1.0, growth_interval=2)  # the same rules, another state
    b.load(a.state())
    assert trajectory(b, [False, False, True]) == trajectory(a, [False, False, True])


@pytest.mark.parametrize("kwargs", [dict(init_scale=float("inf")), dict(init_scale=0.0),
                                    dict(init_scale=float("nan")), dict(growth_factor=1.0),
                                    dict(backoff_factor=1.0), dict(hysteresis=0)])
def test_a_scale_that_cannot_work_is_refused(kwargs):
    with pytest.raises(ValueError):
        P.LossScaler(**kwargs)


# ----------------------------------------------------------------------------- mixed precision
def serial(*flags):
    """The serial trainer's output, in a process of its own (the storage type is global)."""
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run([sys.executable, "-m", "mpipar.serial", "--model", "gpt", "--quiet",
                           *flags], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def val_loss(out):
    import re

    return float(re.search(r"val loss (\d+\.\d+)", out).group(1))


def test_bf16_and_fp16_train_as_fp32_does():
    """100 steps of the GPT: the 16-bit runs' validation loss within 0.05 of float32's (about
    2% of it; they differ in rounding only, and measured 0.008 for bf16 and 0.002 for fp16,
    while 100 steps move the loss by about 1.5). fp16's default scale never overflows here."""
    base = val_loss(serial("--steps", "100"))
    for precision in ("bf16", "fp16"):
        out = serial("--steps", "100", "--precision", precision)
        assert f"{precision} storage, float32 compute and master weights" in out, out
        assert abs(val_loss(out) - base) < 0.05, (precision, out, base)
    assert "0 of 100 steps skipped" in out, out


def test_the_ledger_holds_16_bytes_a_parameter_with_adam():
    """bf16 parameters 2 + bf16 gradients 2 + the float32 master 4 + Adam's two float32
    moments 8 (lessons/formulas.md#memory-per-zero-stage's mixed-precision count)."""
    import re

    out = serial("--steps", "1", "--precision", "bf16", "--memory")
    n = 114_270  # the default GPT's parameters
    row = re.search(r"^ +0  serial +([\d,]+) +([\d,]+) +([\d,]+) ", out, re.M).groups()
    assert [int(v.replace(",", "")) for v in row] == [2 * n, 2 * n, 12 * n], out


def test_forced_overflows_skip_steps_and_back_off_by_the_rules():
    """fp16 from a scale of 1e9: the scaled gradients overflow until the scale is small
    enough. Every overflowing step is skipped; the first keeps the scale (hysteresis 2), each
    later one halves it, and 20 steps never reach 1000 finite ones: scale 1e9 / 2^(k-1)."""
    import re

    out = serial("--steps", "20", "--precision", "fp16", "--loss-scale", "1e9")
    scale, k = re.search(r"loss scale (\S+) at the end; (\d+) of 20 steps skipped", out).groups()
    k = int(k)
    assert 2 <= k < 20 and float(scale) == pytest.approx(1e9 / 2 ** (k - 1), rel=1e-5), out


def test_master_weights_keep_an_update_below_half_a_bf16_unit():
    """SGD on a bf16 weight of 1 with steps of 1e-3, under half a bf16 unit (2^-8): added to
    the weight itself each step rounds back to 1; through the float32 master they add up."""
    from mpipar.engine import backend as B
    from mpipar.engine import optim
    from mpipar.engine.parameters import Parameter

    bf16 = P.dtype_of("bf16")
    w = np.ones(1, dtype=bf16)
    for _ in range(10):
        w -= np.asarray([1e-3], dtype=bf16)  # the update in bf16: lost every time
    assert w[0] == 1
    B.set_precision("bf16")
    try:
        p = Parameter(1)
        p.set(np.ones(1))
        opt = optim.SGD([p], lr=1e-3)
        for _ in range(10):
            p.grad[...] = 1.0
            opt.step()
        assert opt.state[p][-1][0] == pytest.approx(0.99, abs=1e-6)  # the float32 master
        assert float(p.data[0]) == float(np.array(0.99, dtype=bf16))  # 0.9921875, rounded
    finally:
        B.set_dtype("float64")


@pytest.mark.parametrize("scheme, flags, says", [
    ("serial", ["--precision", "fp16", "--loss-scale", "inf"],
     "--precision fp16 needs a positive, finite --loss-scale"),
    ("serial", ["--precision", "fp16", "--loss-scale", "0"],
     "--precision fp16 needs a positive, finite --loss-scale"),
    ("serial", ["--precision", "bf16", "--dtype", "float64"],
     "--precision bf16 stores in 16 bits and computes in float32 with NumPy"),
    ("data_parallel", ["--precision", "bf16"], "--precision bf16 is not in the seed's master "
                                               "update (--sync master, --update master)"),
    ("tensor_parallel", ["--precision", "fp16", "--update", "master"],
     "--precision fp16 is not in the seed's master update"),
    ("data_parallel", ["--precision", "fp16", "--sync", "ring", "--grad-sum", "bf16"],
     "--grad-sum bf16 sums bf16 gradients: it needs --precision bf16"),
])
def test_bad_precision_input_is_one_line(scheme, flags, says, capsys):
    from mpipar.runner.cli import parse_args

    with pytest.raises(SystemExit) as stop:
        parse_args(scheme, flags, 1 if scheme == "serial" else 2)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and says in err and err.count("error:") == 1, err


def test_bf16_without_ml_dtypes_is_one_line(monkeypatch, capsys):
    from mpipar.runner import cli

    monkeypatch.setattr(P, "bf16_problem", lambda: "--precision bf16 needs the "
                        "ml_dtypes package for NumPy's bf16: pip install ml_dtypes")
    with pytest.raises(SystemExit):
        cli.parse_args("serial", ["--precision", "bf16"], 1)
    assert "--precision bf16 needs the ml_dtypes package" in capsys.readouterr().err


def test_an_unknown_precision_is_refused_by_argparse(capsys):
    from mpipar.runner.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args("serial", ["--precision", "fp8"], 1)
    assert "argument --precision: invalid choice: 'fp8'" in capsys.readouterr().err


@pytest.mark.parametrize("ssend", ["0", "1"])
def test_data_and_tensor_parallel_in_16_bits_are_the_serial_trainer_s(mpirun, ssend):
    """tests/mpi/precision_checks.py: 4 and 2 replicas, tensor parallelism on 2 ranks, the
    float32 and the bf16 gradient sum, fp16 with and without overflows; bytes, bits across
    replicas, the serial masters within 3% of their change, the same skipped steps; a sum
    left out, and a rank's own overflow verdict in place of the job's, are caught."""
    from conftest import MPI_SCRIPTS

    out = mpirun(4, [MPI_SCRIPTS / "precision_checks.py"], timeout=180,
                 env={"MPIPAR_SSEND": ssend}).stdout
    assert "precision checks passed on 4 ranks" in out, out
    assert "planted Unsummed: caught" in out, out
    assert "planted LocalVerdict: caught, a rank updated with an overflowed gradient" in out
    assert "4 ranks, fp16, sum in fp32 --loss-scale 3e5: worst change off the serial" in out
    assert "2 of 3 steps skipped" in out, out
    assert "tensor parallel on 2 ranks, fp16 --loss-scale 3e5: 2 of 3 steps skipped" in out


@pytest.mark.parametrize("ssend", ["0", "1"])
def test_every_scheme_in_16_bits_is_the_serial_trainer_s(mpirun, ssend):
    """tests/mpi/precision_schemes.py: the pipeline (four schedules, recomputation), ZeRO 1-3,
    sequence parallelism, the hybrid (tp, pp, ZeRO-2, cp, experts), context and expert
    parallelism, in bf16 and fp16 with and without overflows: the serial loss scale on every
    rank, every parameter within its stated margin, a one-micro-batch pipeline bit for bit; a
    stage's own overflow verdict and an unscaled backward are caught."""
    from conftest import MPI_SCRIPTS

    out = mpirun(4, [MPI_SCRIPTS / "precision_schemes.py"], timeout=180,
                 env={"MPIPAR_SSEND": ssend}).stdout
    assert "precision scheme checks passed on 4 ranks" in out, out
    assert out.count("(bit for bit)") >= 6, out  # 2 pipelines x 3 precisions
    assert "fp16 --loss-scale 3e5: hybrid --dp 4 --cp 2 --cp-algo zigzag on 4 ranks" in out
    assert "planted StageVerdict: caught" in out and "planted UnscaledBackward: caught" in out


@pytest.mark.parametrize("precision, flags", [("bf16", []), ("fp16", ["--loss-scale", "1e9"])])
def test_a_16_bit_checkpoint_resumes_bit_for_bit(tmp_path, precision, flags):
    """3 steps, a checkpoint (16-bit values written as float32, exactly; the float32 masters
    and moments; fp16's scale and trackers in the manifest), 3 more: the parameters and the
    loss scale of 6 uninterrupted steps, to the bit."""
    from mpipar import train

    ckpt, resumed, whole = tmp_path / "ckpt", tmp_path / "resumed.npz", tmp_path / "whole.npz"
    common = ["--precision", precision, *flags]
    serial(*common, "--steps", "3", "--checkpoint", str(ckpt))
    a = serial(*common, "--steps", "6", "--resume", str(ckpt), "--save-params", str(resumed))
    b = serial(*common, "--steps", "6", "--save-params", str(whole))
    got, want = train.load_params(resumed), train.load_params(whole)
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(got[k], want[k]) for k in want)
    if precision == "fp16":  # the resumed run counts its own 3 steps' skips
        import re

        def scale(out):
            return re.search(r"loss scale (\S+) at the end", out).group(1)
        assert scale(a) == scale(b), (a, b)


def test_clipping_in_fp16_measures_the_unscaled_gradients():
    """The norm is of the gradients divided by the loss scale: fp16 clips about the steps
    float32 clips (8 of 20 at 1.5; the runs part as fp16 skips a few overflowing steps), where
    the norm of the scaled gradients, 65536 times larger, would clip all 20."""
    import re

    def clipped(out):
        return int(re.search(r"scaled down, in (\d+) of 20 steps", out).group(1))

    fp32 = serial("--steps", "20", "--clip-grad", "1.5")
    fp16 = serial("--steps", "20", "--clip-grad", "1.5", "--precision", "fp16")
    assert 0 < clipped(fp32) < 20 and abs(clipped(fp16) - clipped(fp32)) <= 3, (fp32, fp16)


@pytest.mark.parametrize("n, scheme, flags", [
    (2, "pipeline", ["--precision", "fp16", "--loss-scale", "1e9"]),
    (4, "hybrid", ["--dp", "2", "--tp", "2", "--sequence-parallel", "--precision", "bf16"]),
    (4, "data_parallel", ["--sync", "allreduce", "--zero", "3", "--precision", "fp16",
                          "--loss-scale", "1e9"]),
])
def test_a_16_bit_checkpoint_of_a_scheme_resumes_bit_for_bit(mpirun, tmp_path, n, scheme, flags):
    """3 steps, a checkpoint (each stage's or shard's float32 masters, fp16's scaler), 3 more:
    the parameters and the loss scale of 6 uninterrupted steps, to the bit."""
    import re

    from mpipar import train

    small = ["--model", "gpt", "--d-model", "16", "--n-heads", "2", "--n-layers", "2",
             "--seq-len", "8", "--batch-size", "12", "--quiet", *flags]
    ckpt, resumed, whole = tmp_path / "ckpt", tmp_path / "resumed.npz", tmp_path / "whole.npz"
    run = lambda *more: mpirun(n, ["-m", f"mpipar.{scheme}", *small, *more]).stdout  # noqa
    run("--steps", "3", "--checkpoint", str(ckpt))
    a = run("--steps", "6", "--resume", str(ckpt), "--save-params", str(resumed))
    b = run("--steps", "6", "--save-params", str(whole))
    got, want = train.load_params(resumed), train.load_params(whole)
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    if "fp16" in flags:
        scale = lambda out: re.search(r"loss scale (\S+) at the end", out).group(1)  # noqa
        assert scale(a) == scale(b), (a, b)
