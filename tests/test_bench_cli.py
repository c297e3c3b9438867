"""Command lines of the tools around the schemes: the benchmarks' flags (a flag given beside
--quick wins; results go to --out, never over the committed plots/ unless asked) and
mpipar.mpi.grid's refusals. No benchmark is timed here: where a benchmark would start its mpirun
workers, the launch is caught and its flags are read."""

import csv
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MPI_SCRIPTS, ROOT

from mpipar.tools import report
from mpipar.tools.bench import __main__ as bench_cli
from mpipar.tools.bench import common, engine, link, net, warmup
from mpipar.tools.bench.common import cores
from mpipar.tools.bench.tp import HIDDEN

COMMITTED = ROOT / "plots"


class Launched(Exception):
    """Raised instead of starting the benchmark's mpirun workers."""


def worker_flags(monkeypatch, name, argv, via_dispatcher=False):
    """The flags the benchmark ``name`` would give its first mpirun launch."""
    module = importlib.import_module(f"mpipar.tools.bench.{name}")
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
    ("tp", ["--quick", "--hidden", "64,96", "--repeats", "5"],
     {"--hidden": "64,96", "--repeats": "5"}),
    ("tp", ["--quick"], {"--hidden": "32,64,128,256,512", "--repeats": "3"}),
    ("tp", [], {"--hidden": ",".join(map(str, HIDDEN)), "--repeats": "11"}),
    ("hybrid", ["--quick", "--rounds", "4"], {"--rounds": "4", "--warmup": "1"}),
    ("hybrid", ["--quick", "--warmup", "3"], {"--rounds": "2", "--warmup": "3"}),
    ("hybrid", [], {"--rounds": "8", "--warmup": "2"}),
    ("precision", ["--quick"], {"--precision": "fp32", "--steps": "20"}),
    ("precision", [], {"--precision": "fp32", "--steps": "250"}),
    ("context", ["--quick"], {"--warmup": "1", "--steps": "3"}),
    ("context", [], {"--warmup": "6", "--steps": "15"}),
    ("experts", ["--quick"], {"--warmup": "10", "--steps": "3"}),
    ("experts", [], {"--warmup": "60", "--steps": "30"}),
    ("experts", ["--quick", "--steps", "7"], {"--warmup": "10", "--steps": "7"}),
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
    """`python -m mpipar.tools.bench pp --quick --steps 20` once timed 3 steps."""
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
    engine = importlib.import_module("mpipar.tools.bench.engine")
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
    importlib.import_module("mpipar.tools.bench.tp").main(["--plot-only", "--out", str(tmp_path)])
    assert (tmp_path / "tp_comm_share.png").stat().st_size > 0


def test_make_report_runs_every_benchmark_into_plots(monkeypatch):
    """The report reads what the benchmarks wrote: it must send them to PLOTS explicitly, now
    that a benchmark's own default is a scratch folder."""
    calls = {}
    for name in report.BENCHES:
        module = importlib.import_module(f"mpipar.tools.bench.{name}")
        monkeypatch.setattr(module, "main", lambda argv, name=name: calls.setdefault(name, argv))
    report.run_benchmarks(quick=True)
    assert calls == {name: ["--out", str(report.PLOTS), "--quick"] for name in report.BENCHES}


def test_each_launch_starts_from_an_empty_folder(monkeypatch, tmp_path):
    """A benchmark that wrote nothing in a launch must not leave the report an older launch's
    CSV to read as this one's."""
    stale = tmp_path / "launch-2" / "pp.csv"
    stale.parent.mkdir()
    stale.write_text("an earlier report's\n")
    ran = []
    monkeypatch.setattr(report, "SCRATCH", tmp_path)
    monkeypatch.setattr(report, "run_benchmarks",
                        lambda quick, names, out, desc: ran.append((out, sorted(out.iterdir()))))
    folders = report.launch_again(quick=True, launches=2)
    assert folders == [report.PLOTS, tmp_path / "launch-2"] and not stale.exists()
    assert ran == [(tmp_path / "launch-2", [])]


# ----------------------------------------------------------------------------- bad input
def read_only_folder(tmp_path):
    """A folder this process cannot write in: one without write permission, or, for root (who
    writes there anyway), /sys; None where there is neither."""
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    for candidate in (folder, Path("/sys")):
        try:
            (candidate / "probe").mkdir()
            (candidate / "probe").rmdir()
        except OSError:
            return candidate
    return None


def assert_one_line_refusal(code, err, says):
    """Exit code 2, no traceback, and one line on stderr that says ``says``."""
    assert code == 2, (code, err)
    assert "Traceback" not in err and err.startswith("error: "), err
    assert "\n" not in err.strip() and says in err, err


@pytest.fixture
def nothing_runs(monkeypatch):
    """Every way a benchmark starts measuring raises Launched: a refusal must come first."""
    def launched(*args, **kwargs):
        raise Launched

    for name in bench_cli.BENCHES:
        module = importlib.import_module(f"mpipar.tools.bench.{name}")
        if hasattr(module, "run_ranks"):
            monkeypatch.setattr(module, "run_ranks", launched)
    for module, name in ((net, "measure_alpha_beta"), (net, "measure_gamma"),
                         (engine, "measure"), (link, "drive"), (link, "pingpong"),
                         (warmup, "run")):
        monkeypatch.setattr(module, name, launched)


def refusal(name, argv, capsys):
    """Run ``python -m mpipar.tools.bench NAME ARGV`` in this process: (exit code, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        bench_cli.main([name, *argv])
    return exit_info.value.code, capsys.readouterr().err


def not_a_number(flag, value, whole=True, zero_ok=False):
    kind = "a whole number" if whole else "a finite number"
    return f"argument {flag}: expected {kind} {'>= 0' if zero_ok else '> 0'}, got {value!r}"


def not_counts(flag, value, multiple_of=1):
    return (f"argument {flag}: expected whole numbers > 0"
            + (f", multiples of {multiple_of}" if multiple_of > 1 else "")
            + f", comma-separated (like {multiple_of},{2 * multiple_of},{4 * multiple_of}), "
            f"got {value!r}")


# (benchmark, flag, value): refused as not a count > 0, before any launch or measurement
NOT_COUNTS = [("ckpt", "--repeats", "0"), ("dp", "--rounds", "-1"), ("engine", "--repeats", "nan"),
              ("engine", "--batch-size", "0"), ("flops", "--repeats", "inf"),
              ("hybrid", "--rounds", ""), ("link", "--passes", "0"), ("link", "--repeats", "-1"),
              ("link", "--rounds", "abc"), ("memory", "--steps", "0"),
              ("memory", "--rounds", "1.5"), ("overhead", "--rounds", "0"), ("pp", "--steps", "0"),
              ("pp", "--rows", "-64"), ("pp_wide", "--rows", "0"), ("tp", "--repeats", "0"),
              ("wait", "--rounds", "0"), ("wait", "--steps", "-1"), ("warmup", "--launches", "0"),
              ("warmup", "--steps", "1.5")]
BAD_FLAGS = {
    **{f"{name} {flag} {value!r}": (name, [flag, value], not_a_number(flag, value))
       for name, flag, value in NOT_COUNTS},
    **{f"{name} --warmup -1": (name, ["--warmup", "-1"], not_a_number("--warmup", "-1",
                                                                      zero_ok=True))
       for name in ("dp", "hybrid", "pp")},
    **{f"tp --budget {value}": ("tp", ["--budget", value], not_a_number("--budget", value, False))
       for value in ("0", "-1", "nan", "inf", "")},
    **{f"{name} --{flag} {value!r}": (name, [f"--{flag}", value], not_counts(f"--{flag}", value))
       for name, flag, value in (("pp", "micro", ""), ("pp", "micro", "4,0"),
                                 ("pp", "ranks", "2,"), ("pp", "ranks", "nan"))},
    **{f"tp --hidden {value}": ("tp", ["--hidden", value], not_counts("--hidden", value, 32))
       for value in ("48", "0", "64,,128")},
    "link --rates fast": ("link", ["--rates", "1gbit,fast"], "--rates 'fast' is not a rate"),
    "link --rates ''": ("link", ["--rates", ""], "--rates '' is not a rate"),
    "warmup --rates fast": ("warmup", ["--rates", "none,fast"], "--rates 'fast' is not a rate"),
    "ckpt --scheme": ("ckpt", ["--scheme", "hybrid"],
                      "argument --scheme: invalid choice: 'hybrid'"),
    "memory --experiment": ("memory", ["--experiment", "x"],
                            "argument --experiment: invalid choice: 'x'"),
    "engine --batch-size huge": ("engine", ["--batch-size", str(10**12)],
                                 f"--batch-size {10**12}: a step would take"),
    "pp --rows huge": ("pp", ["--rows", str(10**8)], f"--rows {10**8}, --micro 1,2,4,8,16 and "
                                                     "--ranks 4: the batches alone would take"),
    "pp --ranks huge": ("pp", ["--ranks", str(10**8)], f"--ranks {10**8}: the batches alone"),
    "tp --hidden huge": ("tp", ["--hidden", str(2**20)], f"--hidden {2**20}: the blocks' weights"),
    "wait with stray words": ("wait", ["--quick", "again"], "unrecognized arguments: again"),
    "an unknown flag": ("dp", ["--bogus", "3"], "unrecognized arguments: --bogus 3"),
}


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_a_bad_flag_is_refused_in_one_line_before_anything_runs(case, nothing_runs, tmp_path,
                                                                  capsys):
    """Zero, negative or non-finite counts once died in a traceback from the mpirun workers
    (no median of no samples, a ZeroDivisionError), or were taken for the defaults; sizes too
    large for memory in a MemoryError; argparse's refusals came with its usage block."""
    name, argv, says = BAD_FLAGS[case]
    assert_one_line_refusal(*refusal(name, [*argv, "--out", str(tmp_path)], capsys), says)


@pytest.mark.parametrize("name", list(bench_cli.BENCHES))
def test_an_out_folder_that_cannot_be_written_is_refused(name, nothing_runs, tmp_path, capsys):
    """A file where the folder should be, a folder under a file, an empty name, a read-only
    folder: refused when parsed, not after the benchmark ran (once a FileExistsError at the
    end)."""
    (tmp_path / "a-file").write_text("")
    cases = {str(tmp_path / "a-file"): "a-file is a file, not a folder",
             str(tmp_path / "a-file" / "under"): "a-file is a file, not a folder",
             "": "argument --out: expected a folder, got ''"}
    if (read_only := read_only_folder(tmp_path)) is not None:
        cases[str(read_only / "results")] = f"argument --out: cannot write in {read_only}"
    for out, says in cases.items():
        assert_one_line_refusal(*refusal(name, ["--out", out], capsys), says)
    assert common.bench_parser("x").parse_args(["--out", str(tmp_path / "new" / "b")]).out == \
        tmp_path / "new" / "b"  # a folder to be made is fine, and not made yet
    assert not (tmp_path / "new").exists()


def test_tp_plot_only_refuses_a_folder_without_its_csv(nothing_runs, tmp_path, capsys):
    assert_one_line_refusal(*refusal("tp", ["--plot-only", "--out", str(tmp_path)], capsys),
                            f"--plot-only draws from {tmp_path / 'tp.csv'}, which is not there")


@pytest.mark.parametrize("argv, says", [
    ([], "error: the following arguments are required: which (see --help)"),
    (["bogus"], "error: argument which: invalid choice: 'bogus'"),
    (["pp", "--steps", "0"], "error: argument --steps: expected a whole number > 0, got '0'"),
    (["tp", "--budget", "nan"], "error: argument --budget: expected a finite number > 0"),
])
def test_the_command_line_refuses_in_one_line(argv, says, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mpipar.tools.bench", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert_one_line_refusal(proc.returncode, proc.stderr, says)
    assert proc.stdout == ""


@pytest.mark.parametrize("argv, prog", [
    (["--help"], "usage: python -m mpipar.tools.bench [-h]"),
    (["pp", "--help"], "usage: python -m mpipar.tools.bench pp [-h]"),
    (["--help", "wait"], "usage: python -m mpipar.tools.bench wait [-h]"),
])
def test_help_is_the_named_benchmarks(argv, prog):
    proc = subprocess.run([sys.executable, "-m", "mpipar.tools.bench", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith(prog), proc.stdout + proc.stderr


@pytest.mark.parametrize("argv, says", [
    (["mpipar.tools.report", "--launches", "0"],
     "error: argument --launches: expected a whole number > 0, got '0' (see --help)"),
    (["mpipar.tools.figures", "--bogus"], "error: unrecognized arguments: --bogus (see --help)"),
    (["mpipar.tools.cluster", "--hosts", "x"],
     "error: argument --hosts: invalid int value: 'x' (see --help)"),
])
def test_the_other_tools_refuse_in_one_line_too(argv, says):
    """Without argparse's usage block, as the benchmarks and the trainers refuse."""
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert_one_line_refusal(proc.returncode, proc.stderr, says)
    assert proc.stdout == ""


# ----------------------------------------------------------------------------- mpipar.mpi.grid
@pytest.mark.parametrize("flags, says", [
    (["--tp", "0"], "error: --tp must be at least 1, got 0"),
    (["--tp", "x"], "error: argument --tp: invalid int value: 'x' (see --help)"),
    (["--pp", "-2"], "error: --pp must be at least 1, got -2"),
    (["--dp", "0", "--tp", "2"], "error: --dp must be at least 1, got 0"),
    (["--cp", "0"], "error: --cp must be at least 1, got 0"),
    (["--cp", "3"], "error: --cp 3 must divide the 2 data-parallel replicas"),
])
def test_grid_refuses_a_size_below_one(flags, says, mpirun):
    """--tp 0 once died in a ZeroDivisionError traceback on every rank."""
    proc = mpirun(2, ["-m", "mpipar.mpi.grid", *flags], timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == says, proc.stderr  # one line, from rank 0 only
    assert proc.stdout == ""


def test_grid_prints_the_cp_groups_carved_from_each_dp_group(mpirun):
    out = mpirun(4, ["-m", "mpipar.mpi.grid", "--dp", "2", "--pp", "2", "--cp", "2"],
                 timeout=60).stdout
    assert "rank 1: dp=0 tp=0 pp=1   tp group [1]   pp group [0, 1]   dp group [1, 3]   " \
           "cp group [1, 3]" in out, out


# ----------------------------------------------------------------------------- bench wait
def test_wait_tables_every_strategy_and_the_shared_core_ratios(monkeypatch, tmp_path, capsys):
    """No launch here: step_time() is replaced by steps of 10 ms on 2 ranks, 13 ms on 4 with
    the default strategy and 20 ms with any other: the table, the 4/2 ratios and their verdicts
    must come out exactly."""
    from mpipar.mpi import waiting
    from mpipar.tools.bench import wait

    launched = []

    def step_time(n, command, steps, strategy=None):
        launched.append((n, command[0], steps, strategy))
        wall = 0.010 if n == 2 else 0.013 if strategy in (None, "backoff") else 0.020
        # CPU seconds over the ranks: 3/4 of n ranks' time; 2 ranks that sleep use 2/4
        cpu = (0.5 if n == 2 and strategy == "sleep" else 0.75) * n * wall
        if command[0] == "mpipar.alone":  # each rank a whole copy: 4 ranks 1.1x the CPU a rank
            cpu = (0.8 if n == 2 else 0.88) * n * wall
        return wait.Timing(wall, cpu, 10.0 * n + (strategy == "sleep"), 5.0 * n)

    monkeypatch.setattr(wait, "step_time", step_time)
    monkeypatch.setattr(waiting, "DEFAULT_OVERSUBSCRIBED", "backoff")
    wait.main(["--quick", "--out", str(tmp_path)])
    with open(tmp_path / "wait.csv") as f:
        rows = list(csv.DictReader(f))
    cells = {(r["scheme"], r["strategy"]): float(r["step_ms"]) for r in rows if not r["ratio"]}
    assert set(cells) == {(s, w) for s in wait.QUICK_SCHEMES for w in waiting.STRATEGIES}
    assert cells["dp ring", "backoff"] == pytest.approx(13.0)
    assert cells["pipeline", "spin"] == pytest.approx(20.0)
    pairs = {r["scheme"]: float(r["ratio"]) for r in rows if r["ratio"]}
    assert pairs == {"main job (pipeline): 4 / 2 ranks": 1.3, "dp allreduce: 4 / 2 ranks": 1.3,
                     f"{wait.BARE}: 4 / 2 ranks": 1.3}
    assert {r["scheme"]: r["target"] for r in rows if r["ratio"]}[f"{wait.BARE}: 4 / 2 ranks"] \
        == ""
    assert ("mpipar.bare", None) in {(module, strategy) for _, module, _, strategy in launched}
    main = next(r for r in rows if r["scheme"] == "main job (pipeline): 4 / 2 ranks")
    assert float(main["cpu_ms"]) == pytest.approx(39.0)  # 0.75 * 4 ranks * 13 ms
    assert float(main["busy_share"]) == pytest.approx(39.0 / (cores() * 13.0), abs=1e-3)
    assert float(main["cpu2_ms"]) == pytest.approx(10.0)  # 2 ranks that sleep: 0.5 * 2 * 10 ms
    assert [float(main[k]) for k in ("voluntary", "involuntary", "voluntary2", "involuntary2")] \
        == [40.0, 20.0, 21.0, 10.0]
    assert ("mpipar.pipeline", "sleep") in {(m, s) for n, m, _, s in launched if n == 2}
    assert float(main["alone_cpu_ratio"]) == pytest.approx(0.88 * 13 / (0.8 * 10))
    assert {n for n, m, *_ in launched if m == "mpipar.alone"} == {2, 4}
    ratio, busy = wait.ideal(wait.PAIRS["main job (pipeline)"], cores())
    assert (float(main["ideal_ratio"]), float(main["ideal_busy_share"])) == \
        (round(ratio, 3), round(busy, 3))
    assert not [r for r in rows if r["ratio"] and r is not main and r["ideal_ratio"]]
    out = capsys.readouterr().out
    assert f"{wait.BARE}: 4 ranks / 2 ranks per step 1.30 (1.30..1.30), the floor: no " \
        "framework" in out
    assert "main job (pipeline): 4 ranks / 2 ranks per step 1.30" in out and "NOT met" in out
    assert "dp allreduce: 4 ranks / 2 ranks per step 1.30 (1.30..1.30), target at most 1.3: met" \
        in out
    assert {steps for *_, steps, _ in launched} == {10}  # --quick
    assert (tmp_path / "wait.png").stat().st_size > 0
    assert wait.plot(rows, tmp_path / "again.png").stat().st_size > 0  # from the CSV read back


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_a_core_per_stage_replays_as_the_schedule_simulator_does(name):
    """With a core per stage, the shared-cores replay is schedules.simulate (free messages);
    with one core, the sum of every forward and backward; in between, neither bound broken."""
    from mpipar.parts import schedules
    from mpipar.tools.bench.wait import on_shared_cores

    fwd, m = [2.0, 1.0, 1.5, 0.5], 5
    bwd = [2.1 * f for f in fwd]
    timeline = schedules.simulate(schedules.schedule(name, 4, m), fwd, bwd)
    end = max(t1 for events in timeline for ins, _, t1 in events
              if isinstance(ins, (schedules.Forward, schedules.Backward)))
    work = m * (sum(fwd) + sum(bwd))
    assert on_shared_cores(name, fwd, bwd, m, 4)[0] == pytest.approx(end)
    assert on_shared_cores(name, fwd, bwd, m, 1) == pytest.approx((work, 1.0))
    span, busy = on_shared_cores(name, fwd, bwd, m, 2)
    assert max(end, work / 2) <= span < work and busy == pytest.approx(work / (2 * span))


def test_four_equal_stages_on_two_cores_finish_before_two_stages_on_two():
    """1F1B, 4 micro-batches, the same model cut into 2 stages (forward 2, backward 4) or 4
    (1 and 2): on 2 cores, 2 stages take (m + p - 1)(F + B) = 30 units; 4 stages sharing them
    finish sooner, as each fill and drain step is half as long, though never before 24 (all
    the work, 48 units, on 2 cores)."""
    from mpipar.tools.bench.wait import on_shared_cores

    assert on_shared_cores("1f1b", [2.0, 2.0], [4.0, 4.0], 4, 2)[0] == pytest.approx(30.0)
    assert 24.0 <= on_shared_cores("1f1b", [1.0] * 4, [2.0] * 4, 4, 2)[0] < 30.0
    with pytest.raises(ValueError, match="not zb-h1"):  # its W instructions are not replayed
        on_shared_cores("zb-h1", [1.0] * 4, [2.0] * 4, 4, 2)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_the_bare_floor_does_the_trainers_arithmetic(mpirun, n):
    """bench wait's floor, BareDP (bare NumPy and raw mpi4py), against the allreduce trainer:
    the same losses and parameters after 3 steps (tests/mpi/bare_dp.py)."""
    out = mpirun(n, [MPI_SCRIPTS / "bare_dp.py"], timeout=60)
    assert f"bare dp equals the trainer on {n} ranks" in out.stdout


def test_alone_trains_a_whole_copy_on_each_rank_without_waiting():
    """bench wait's ALONE, launched for real on 2 ranks: each rank runs the serial trainer on
    the main job's model and never waits (no voluntary context switch: nothing sleeps or
    blocks). How much CPU time that is beside the wall time depends on the machine's load, so
    it is the benchmark's to report, not a test's to assert."""
    from mpipar.tools.bench.wait import ALONE, step_time

    t = step_time(2, ALONE, "3")
    assert t.step > 0 and t.cpu > 0, t
    assert t.voluntary < 1, t


def test_wait_refuses_a_step_count_below_one(tmp_path):
    from mpipar.tools.bench import wait

    with pytest.raises(SystemExit):
        wait.main(["--steps", "0", "--out", str(tmp_path)])


def test_make_report_launches_the_headline_benchmarks_again(monkeypatch, tmp_path):
    """--launches R: launches 2..R of the headline benchmarks, each into its own folder."""
    from mpipar.tools import headlines

    calls = []
    for name in headlines.benches():
        module = importlib.import_module(f"mpipar.tools.bench.{name}")
        monkeypatch.setattr(module, "main", lambda argv, name=name: calls.append((name, argv)))
    monkeypatch.setattr(report, "SCRATCH", tmp_path)
    folders = report.launch_again(quick=False, launches=3)
    assert folders == [report.PLOTS, tmp_path / "launch-2", tmp_path / "launch-3"]
    assert calls == [(name, ["--out", str(tmp_path / f"launch-{k}")]) for k in (2, 3)
                     for name in headlines.benches()]
    assert "wait" not in headlines.benches()  # minutes a launch: once, on its own


# ----------------------------------------------------------------------------- bench wait --busy
def test_busy_processes_run_beside_the_block_and_are_gone_after_it():
    from mpipar.tools.bench import busy

    with busy.busy_processes(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
        assert all(p.args == [sys.executable, "-c", busy.LOOP] for p in procs)
    assert all(p.poll() is not None for p in procs)  # killed and reaped


def test_wait_busy_tables_each_strategy_beside_busy_processes(monkeypatch, tmp_path, capsys):
    """No launch, no busy process here: the step time is 10 ms idle, and beside N busy
    processes 10 ms * (1 + N / 4) with the default strategy, (1 + N) with any other: the
    slowdowns, the target's verdict and what the CSV says must come out exactly."""
    from contextlib import contextmanager

    from mpipar.mpi import waiting
    from mpipar.tools.bench import busy, wait

    beside, launched = [0], []

    @contextmanager
    def fake_busy(n):
        beside[0] = n
        yield []
        beside[0] = 0

    def step_time(n, command, steps, strategy=None):
        launched.append((n, command[0], steps, strategy, beside[0]))
        k = beside[0]
        return wait.Timing(0.010 * (1 + k / 4 if strategy == "sleep" else 1 + k), 0, 0, 0)

    monkeypatch.setattr(busy, "busy_processes", fake_busy)
    monkeypatch.setattr(wait, "step_time", step_time)
    wait.main(["--busy-only", "--busy", "1,2,4", "--rounds", "2", "--steps", "5",
               "--out", str(tmp_path)])
    assert {(n, m, s) for n, m, s, *_ in launched} == {(4, "mpipar.pipeline", 5)}
    assert len(launched) == 2 * 4 * 4  # rounds x strategies x (idle + 3 counts)
    with open(tmp_path / "wait_busy.csv") as f:
        rows = {(int(r["busy"]), r["strategy"]): r for r in csv.DictReader(f)}
    assert set(rows) == {(n, w) for n in (1, 2, 4) for w in waiting.STRATEGIES}
    assert float(rows[2, "sleep"]["slowdown"]) == 1.5 and rows[2, "sleep"]["default"] == "True"
    assert float(rows[4, "spin"]["slowdown"]) == 5.0 and rows[4, "spin"]["target"] == ""
    assert rows[2, "sleep"]["target"] == "2.0"
    out = capsys.readouterr().out
    assert "default (sleep) beside 2 busy processes: 1.50, target at most 2.0: met" in out, out
    assert (tmp_path / "wait_busy.png").stat().st_size > 0


def test_schedules_trains_every_schedule_and_reports_each_beside_its_formula(tmp_path):
    """bench schedules on 2 ranks, one launch of 2 timed steps: a row per schedule (dualpipev
    only where m >= 2p), each bubble a share, 1F1B's step its own baseline; the report's
    section names each schedule with its formula and says where dualpipev did not run. What
    the bubbles are is not asserted: they vary with the machine."""
    from mpipar.parts.schedules import bubble_formula
    from mpipar.tools.bench import schedules

    assert [n for n, _ in schedules.runs(2, 4)] == ["1f1b", "zb-h1", "interleaved", "zb-v",
                                                      "dualpipev"]
    assert "dualpipev" not in [n for n, _ in schedules.runs(4, 4)]
    subprocess.run([sys.executable, "-m", "mpipar.tools.bench", "schedules", "--quick",
                    "--micro", "2,4", "--warmup", "1", "--steps", "2", "--launches", "1",
                    "--out", str(tmp_path)], check=True, capture_output=True, timeout=300)
    with open(tmp_path / "schedules.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["schedule"], r["m"]) for r in rows) == sorted(
        [(n, "2") for n, _ in schedules.runs(2, 2)] + [(n, "4") for n, _ in schedules.runs(2, 4)])
    assert all(0 <= float(r[k]) < 1 for r in rows for k in ("bubble", "replayed"))
    assert {r["ratio_to_1f1b"] for r in rows if r["schedule"] == "1f1b"} == {"1.0"}
    text = "\n".join(schedules.section(tmp_path))
    assert f"formula {bubble_formula(2, 4, 'zb-v', 2):.3f}" in text and "; replayed 0." in text
    assert "- 2 stages, m = 2: 1f1b " in text and "dualpipev not run (it needs m >= 4)" in text
    assert (tmp_path / "schedules.png").stat().st_size > 0


def test_schedules_replay_of_equal_times_is_each_formula():
    """The replay the bench reports beside each measurement: with every F, B and W equal it is
    the formula, for each schedule; part_times reads a rank's spans as the replay needs them
    (a split backward is B + W, and W's share of it)."""
    from mpipar.parts.schedules import bubble_formula
    from mpipar.tools.bench import schedules

    for p, m in ((2, 4), (2, 8), (4, 8), (3, 9)):
        for name, v in schedules.runs(p, m):
            parts = [[(1.0, 2.0, 0.5)] * v for _ in range(p)]
            got = schedules.replayed(name, p, m, v, parts)
            assert got == pytest.approx(bubble_formula(p, m, name, v), abs=1e-12), (name, p, m)
    spans = [("forward", 0, False, 1.0), ("forward", 1, False, 3.0), ("backward", 0, True, 1.0),
             ("weight", 0, True, 3.0), ("backward", 1, False, 5.0), ("backward", 1, False, 7.0)]
    assert schedules.part_times(spans) == [(1.0, 4.0, 0.75), (3.0, 6.0, None)]
