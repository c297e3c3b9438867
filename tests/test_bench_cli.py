"""Command lines of the tools around the schemes: the benchmarks' flags (a flag given beside
--quick wins; results go to --out, never over the committed plots/ unless asked) and
mpipar.grid's refusals. No benchmark is timed here: where a benchmark would start its mpirun
workers, the launch is caught and its flags are read."""

import csv
import importlib

import pytest
from conftest import ROOT

from mpipar import report
from mpipar.bench import __main__ as bench_cli
from mpipar.bench import common, net
from mpipar.bench.tp import HIDDEN

COMMITTED = ROOT / "plots"


class Launched(Exception):
    """Raised instead of starting the benchmark's mpirun workers."""


def worker_flags(monkeypatch, name, argv, via_dispatcher=False):
    """The flags the benchmark ``name`` would give its first mpirun launch."""
    module = importlib.import_module(f"mpipar.bench.{name}")
    launches = []

    def run_ranks(n, worker_module, args=(), timeout=600):
        launches.append([str(a) for a in args])
        raise Launched

    monkeypatch.setattr(module, "run_ranks", run_ranks)
    monkeypatch.setattr(net, "measure_alpha_beta", lambda quick=False: (5e-6, 1e-10))
    monkeypatch.setattr(net, "measure_gamma", lambda *a, **kw: 1e-10)
    with pytest.raises(Launched):
        bench_cli.main([name, *argv]) if via_dispatcher else module.main(argv)
    flags = launches[0]
    return {f: flags[i + 1] for i, f in enumerate(flags[:-1]) if f.startswith("--")}


@pytest.mark.parametrize("name, argv, expected", [
    ("pp", ["--quick", "--steps", "20"], {"--steps": "20", "--micro": "1,4,16", "--warmup": "1"}),
    ("pp", ["--quick", "--micro", "2,8", "--warmup", "3"],
     {"--steps": "3", "--micro": "2,8", "--warmup": "3"}),
    ("pp", ["--quick"], {"--steps": "3", "--micro": "1,4,16", "--warmup": "1"}),
    ("pp", [], {"--steps": "8", "--micro": "1,2,4,8,16", "--warmup": "2"}),
    ("dp", ["--quick", "--rounds", "5"], {"--rounds": "5"}),
    ("dp", ["--quick"], {"--rounds": "3"}),
    ("dp", [], {"--rounds": "6"}),
    ("tp", ["--quick", "--hidden", "48,96", "--repeats", "5"],
     {"--hidden": "48,96", "--repeats": "5"}),
    ("tp", ["--quick"], {"--hidden": "32,64,128,256,512", "--repeats": "3"}),
    ("tp", [], {"--hidden": ",".join(map(str, HIDDEN)), "--repeats": "11"}),
    ("hybrid", ["--quick", "--rounds", "4"], {"--rounds": "4", "--warmup": "1"}),
    ("hybrid", ["--quick", "--warmup", "3"], {"--rounds": "2", "--warmup": "3"}),
    ("hybrid", [], {"--rounds": "8", "--warmup": "2"}),
    ("flops", ["--quick", "--repeats", "9"], {"--repeats": "9"}),
    ("flops", ["--quick"], {"--repeats": "5"}),
    ("flops", [], {"--repeats": "15"}),
    ("memory", ["--quick", "--rounds", "4"], {"--rounds": "4", "--steps": "1"}),
    ("memory", [], {"--rounds": "5", "--steps": "3", "--experiment": "zero"}),
])
def test_a_flag_given_beside_quick_wins(name, argv, expected, monkeypatch):
    flags = worker_flags(monkeypatch, name, argv)
    assert {f: flags.get(f) for f in expected} == expected


def test_quick_through_the_dispatcher_keeps_explicit_steps(monkeypatch):
    """`python -m mpipar.bench pp --quick --steps 20` once timed 3 steps."""
    assert worker_flags(monkeypatch, "pp", ["--quick", "--steps", "20"], True)["--steps"] == "20"


@pytest.fixture
def committed_untouched():
    """Fail (and put them back) if a test changed the committed plots/ files."""
    before = {p: p.read_bytes() for p in COMMITTED.iterdir() if p.is_file()}
    yield
    changed = [p.name for p, data in before.items() if p.read_bytes() != data]
    for p in changed:
        p.write_bytes(before[p])
    assert not changed, f"a benchmark overwrote the committed {changed}"


def test_engine_from_the_command_line_writes_to_scratch(monkeypatch, tmp_path, capsys,
                                                        committed_untouched):
    monkeypatch.delenv("MPIPAR_PLOTS", raising=False)
    monkeypatch.setattr(common, "SCRATCH", tmp_path / "scratch")
    engine = importlib.import_module("mpipar.bench.engine")
    engine.main(["--quick", "--repeats", "3"])
    with open(tmp_path / "scratch" / "engine.csv", newline="") as f:
        (row,) = csv.DictReader(f)
    assert row["repeats"] == "3"  # --quick alone would time 30
    assert (tmp_path / "scratch" / "engine.png").exists()
    assert "a scratch folder: --out plots replaces the committed results" in capsys.readouterr().out


def test_out_decides_where_the_results_go(monkeypatch, tmp_path):
    monkeypatch.delenv("MPIPAR_PLOTS", raising=False)
    assert common.bench_parser("x").parse_args([]).out == common.SCRATCH
    assert common.bench_parser("x").parse_args(["--out", "plots"]).out.name == "plots"
    monkeypatch.setenv("MPIPAR_PLOTS", str(tmp_path))  # not the committed folder: the default
    monkeypatch.setattr(common, "PLOTS", tmp_path)
    assert common.bench_parser("x").parse_args([]).out == tmp_path


def test_tp_plot_only_reads_and_draws_in_out(tmp_path, committed_untouched):
    (tmp_path / "tp.csv").write_bytes((COMMITTED / "tp.csv").read_bytes())
    importlib.import_module("mpipar.bench.tp").main(["--plot-only", "--out", str(tmp_path)])
    assert (tmp_path / "tp_comm_share.png").stat().st_size > 0


def test_make_report_runs_every_benchmark_into_plots(monkeypatch):
    """The report reads what the benchmarks wrote: it must send them to PLOTS explicitly, now
    that a benchmark's own default is a scratch folder."""
    calls = {}
    for name in report.BENCHES:
        module = importlib.import_module(f"mpipar.bench.{name}")
        monkeypatch.setattr(module, "main", lambda argv, name=name: calls.setdefault(name, argv))
    report.run_benchmarks(quick=True)
    assert calls == {name: ["--out", str(report.PLOTS), "--quick"] for name in report.BENCHES}


# ----------------------------------------------------------------------------- mpipar.grid
@pytest.mark.parametrize("flags, says", [
    (["--tp", "0"], "error: --tp must be at least 1, got 0"),
    (["--pp", "-2"], "error: --pp must be at least 1, got -2"),
    (["--dp", "0", "--tp", "2"], "error: --dp must be at least 1, got 0"),
])
def test_grid_refuses_a_size_below_one(flags, says, mpirun):
    """--tp 0 once died in a ZeroDivisionError traceback on every rank."""
    proc = mpirun(2, ["-m", "mpipar.grid", *flags], timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == says, proc.stderr  # one line, from rank 0 only
    assert proc.stdout == ""
