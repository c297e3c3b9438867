"""The course's statements of fact, each checked against the code or a committed CSV.

A lesson that quotes a number from ``plots/*.csv``, a list the code defines or a claim about
what the tests prove is checked here, so that the text cannot drift from what it describes.
Citations of a Markdown file anywhere in the project (code, tests, lessons, README,
``plots/REPORT.md``) must resolve to a file, and to a heading when they name one
(``lessons/formulas.md#collectives``).
"""

import ast
import csv
import inspect
import json
import re
import subprocess
import sys
import textwrap

import pytest
from conftest import MPI_SCRIPTS, ROOT

from mpipar.runner import cli
from mpipar.tools import simulate as S

PLOTS = ROOT / "plots"
LESSONS = ROOT / "lessons"
MD_CITE = re.compile(r"(?<![\w/.:-])((?:\.\./)?[\w./-]*\w\.md)(#[\w-]+)?")


def rows(name):
    with open(PLOTS / name, newline="") as f:
        return list(csv.DictReader(f))


def lesson(name):
    return next(LESSONS.glob(f"{name}*.md")).read_text()


def flat(text):
    """Text with its line breaks as spaces, so that a phrase may span two lines."""
    return " ".join(text.split())


# ----------------------------------------------------------------------------- citations
def slug(heading):
    """The anchor a Markdown renderer gives a heading (GitHub's rule)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def cited_files():
    files = [ROOT / "README.md", PLOTS / "REPORT.md", *LESSONS.rglob("*.md")]
    return files + sorted((ROOT / "mpipar").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))


def md_citations():
    for path in cited_files():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if "://" in line:  # a web address is not a file of the project
                line = re.sub(r"\S+://\S+", "", line)
            for target, anchor in MD_CITE.findall(line):
                yield path, i, target, anchor


def test_md_citations_are_found():
    """The scan sees the citations it is meant to check (a regex that matches nothing passes)."""
    found = {(p.name, t) for p, _, t, _ in md_citations()}
    assert ("REPORT.md", "lessons/formulas.md") in found, sorted(found)[:20]
    assert ("README.md", "lessons/README.md") in found


@pytest.mark.parametrize("path,line,target,anchor",
                         [pytest.param(*c, id=f"{c[0].relative_to(ROOT)}:{c[1]}:{c[2]}{c[3]}")
                          for c in md_citations()])
def test_md_citation_resolves(path, line, target, anchor):
    where = f"{path.relative_to(ROOT)}:{line} cites {target}{anchor}"
    bases = [path.parent, ROOT, PLOTS, LESSONS]
    found = [b / target for b in bases if (b / target).is_file()]
    assert found, f"{where}: no such file (looked beside it, at the root, in plots/ and lessons/)"
    if anchor:
        headings = re.findall(r"^#+ (.+)$", found[0].read_text(), re.M)
        assert anchor[1:] in {slug(h) for h in headings}, \
            f"{where}: no heading with that anchor in {found[0].relative_to(ROOT)}"


# ----------------------------------------------------------------------------- lesson 1
def comm_mpi_methods():
    """Public methods of mpipar.mpi.comm.Comm (its own and inherited) that issue an MPI call: they
    use ``self.mpi``, or call a method of the class that does (``Send`` posts ``Isend``)."""
    from mpipar.mpi.comm import Comm

    sources = {name: textwrap.dedent(inspect.getsource(f)) for name, f in
               inspect.getmembers(Comm, inspect.isfunction) if f.__module__.startswith("mpipar")}
    called = {name: {node.attr for node in ast.walk(ast.parse(src))
                     if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                     and node.value.id == "self"} for name, src in sources.items()}
    issuing = {name for name, attrs in called.items() if "mpi" in attrs}
    while more := {name for name, attrs in called.items() if attrs & issuing} - issuing:
        issuing |= more
    return {name for name in issuing if not name.startswith("_")}


def test_lesson_1_lists_every_mpi_call_of_comm():
    text = lesson("01")
    table = text.split("| call | who sends what | used by |")[1].split("\n\n")[0]
    listed = set()
    for row in table.splitlines()[2:]:
        listed |= set(re.findall(r"`(\w+)`", row.split("|")[1]))
    methods = comm_mpi_methods()
    assert {"Send", "Gatherv", "Iallreduce", "allgather_obj"} <= methods, methods
    assert listed == methods, f"lesson 1 lists {sorted(listed - methods)} too many, " \
                              f"{sorted(methods - listed)} missing"
    assert "eight MPI calls" not in text


# ----------------------------------------------------------------------------- lesson 3
def test_lesson_3_master_against_its_model_is_read_from_the_csv():
    """At 16 MiB on 2 ranks the master sits much further above its model than MPI's Allreduce
    and the ring above theirs, as lesson 3 says; the lesson says where to read the ratios
    (plots/net.csv) instead of quoting one run's."""
    net = {r["algo"]: float(r["seconds"]) / float(r["predicted_seconds"]) for r in rows("net.csv")
           if r["kind"] == "allreduce" and r["ranks"] == "2" and r["bytes"] == str(16 * 2**20)}
    text = flat(lesson("03"))
    assert "divide `seconds` by `predicted_seconds` in the `allreduce` rows of `plots/net.csv` " \
        "at 16 MiB (16,777,216 bytes) on 2 ranks" in text
    assert net["master"] > 3 * max(net["mpi"], net["ring"]) / 1.7
    assert "as the models predict" not in text


# ----------------------------------------------------------------------------- lesson 4
def test_lesson_4_exercise_6_crossover_is_in_the_data():
    tp = rows("tp.csv")
    two = {tokens: [r for r in tp if r["ranks"] == "2" and r["tokens"] == tokens]
           for tokens in ("256", "16")}
    # 4 x 64 tokens: 2 ranks pay off at every width measured, so no crossover in range
    assert all(float(r["speedup"]) > 1 for r in two["256"])
    widths = [int(r["hidden"]) for r in two["256"]]
    assert int(two["256"][0]["predicted_crossover_hidden"]) < min(widths)
    # 1 x 16 tokens: the crossover the exercise asks for lies inside the measured widths
    small = two["16"]
    widths = [int(r["hidden"]) for r in small]
    # the measurement crosses inside the widths measured; the model's crossover (its search
    # starts at h = 4) may lie below them, in a run where the Allreduces measured cheap
    assert min(widths) <= int(small[0]["measured_crossover_hidden"]) < max(widths)
    assert int(small[0]["predicted_crossover_hidden"]) < max(widths)
    speedup = {int(r["hidden"]): float(r["speedup"]) for r in small}
    below = max(h for h in speedup if h <= int(small[0]["measured_crossover_hidden"]))
    above = min(h for h in speedup if h > below)
    assert speedup[below] < 1 < speedup[above]
    solution = flat((ROOT / "lessons" / "solutions" / "04-tensor-parallel.md").read_text())
    assert "the `predicted_crossover_hidden` column" in solution  # read there, not quoted
    assert "(`measured_crossover_hidden`;" in solution
    text = flat(lesson("04"))
    assert "with the small step, b*s = 1 x 16 tokens" in text


# ----------------------------------------------------------------------------- lesson 5
def test_lesson_5_warm_up_numbers_are_the_simulator_s():
    """Exercise 10 and the warm-up paragraph: stashes, and the bubbles at latencies 0.1 and
    0.5 of a chunk's forward (the lesson's 0.130 and 0.098 are test_schedules')."""
    from mpipar.tools.figures.layouts import warmup_run

    d = warmup_run()
    half = d["latencies"].index(0.5)
    text = (LESSONS / "solutions" / "05-pipeline-parallel.md").read_text()
    assert d["lean"]["stash"][0] == 8 and d["production"]["stash"][0] == 11
    assert f"{d['lean']['bubble'][half]:.3f} against {d['production']['bubble'][half]:.3f}" \
        in text


def test_lesson_5_says_the_pipeline_gpt_has_4_blocks():
    assert cli.parse_args("pipeline", ["--timeline", "none"], n_ranks=4).n_layers == 4
    assert cli.parse_args("serial", ["--model", "gpt"], n_ranks=1).n_layers == 2
    text = flat(lesson("05"))
    assert "pipeline's default is `--n-layers 4`" in text
    assert "`python -m mpipar.serial --model gpt --n-layers 4`" in text


# ----------------------------------------------------------------------------- lesson 6
def test_lesson_6_reads_every_scheme_s_2_rank_speedup_from_the_csv():
    """The schemes lesson 6 compares on 2 ranks are the rows of plots/scaling.csv, where it
    sends the reader for their speedups (one launch's, so not quoted)."""
    two = {r["scheme"] for r in rows("scaling.csv") if r["ranks"] == "2"}
    dp = {k[len("data parallel ("):-1] for k in two if k.startswith("data parallel")}
    assert "tensor parallel (block, h=1024)" in two and dp == \
        {"master", "allreduce", "allreduce+overlap"}, two
    text = flat(lesson("06"))
    assert "compare one tensor-parallel block at h = 1024 with the data-parallel modes (master, " \
        "allreduce, allreduce with overlap): the `speedup` of the 2-rank rows of " \
        "`plots/scaling.csv`" in text
    assert "the only scheme here that divides the work" not in text


def test_lesson_6_sharing_the_cores_is_the_replay_s():
    """The perfect scheduler's ratio and busy share lesson 6 quotes are the replay's (FLOPs, not
    timings); the measured ones, and the CPU time and switches, it leaves to the report."""
    from mpipar.tools.bench.wait import PAIRS, ideal

    ratio, busy = ideal(PAIRS["main job (pipeline)"], 2)
    text = flat(lesson("06"))
    assert f"would take {ratio:.2f} of its time on 2 ranks, with the cores {busy:.0%} busy" in text
    assert "[The report](../plots/REPORT.md#speed-at-learners-sizes) gives the measured ratio " \
        "and busy share beside the replay's" in text


def test_lesson_6_cost_model_beside_megatron():
    """The lesson's command, run, gives the days the lesson states for 300e9 tokens."""
    text = flat(lesson("06"))
    command = re.search(r"\$ python -m mpipar\.tools\.simulate --preset gpt3 ([^$]*?"
                        r"--micro-batches 192 [^$]*?--recompute)", text)
    argv = ["--preset", "gpt3", *command.group(1).split(), "--json"]
    out = subprocess.run([sys.executable, "-m", "mpipar.tools.simulate", *argv], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    r = json.loads(out)
    days = 300e9 / r["tokens_per_s"] / 86400
    assert (r["dp"], r["tp"], r["pp"], r["n_micro"]) == (8, 8, 16, 192)
    assert f"300 billion tokens take {days:.1f} days" in text
    assert f"{round(100 * (days / 34 - 1))}% longer than the paper's 34" in text
    # the paper's 34 days, read back as a rate per GPU with its 8 T P / (n X)
    assert round(8 * 300e9 * 175e9 / (1024 * 34 * 86400) / 1e12) == 140
    assert "about 140 teraFLOP/s per GPU" in text


def test_simulate_this_machine_reads_the_measured_csvs(tmp_path):
    one = next(r for r in rows("flops.csv") if r["ranks"] == "1")
    ping = next(r for r in rows("net.csv") if r["kind"] == "pingpong")
    hw = S.measured_machine()
    assert hw.flops == float(one["gflops_per_rank"]) * 1e9
    assert (hw.tp_alpha, hw.tp_beta) == (float(ping["alpha"]), float(ping["beta"]))
    assert hw.name.startswith("this machine (measured: ")
    assert S.measured_machine(flops=1e9).name.startswith("this machine (measured, flags given")
    assert S.measured_machine(flops=1e9).flops == 1e9
    default = S.measured_machine(folder=tmp_path)  # no CSVs: the defaults, and it says so
    assert default.name.startswith("this machine (defaults: ") and default.flops == 20e9
    assert re.fullmatch(r"this machine \(measured: [\d.]+ GFLOP/s, alpha [\d.]+ us, "
                        r"beta [\d.]+ ns/B\)", hw.name), hw.name
    assert "this machine (measured: ... GFLOP/s, alpha ... us, beta ... ns/B)" in lesson("06")


# ----------------------------------------------------------------------------- lesson 7
def test_lesson_7_hybrid_memory_claims_are_the_csv():
    hybrid = {r["layout"]: r for r in rows("hybrid.csv")}
    model_parallel = [k for k, r in hybrid.items() if r["dp"] == "1"]
    assert len(model_parallel) == 3
    params = {k: int(hybrid[k]["param_bytes"]) for k in model_parallel}
    assert max(params, key=params.get) == "DP1 TP1 PP4"  # the largest share, not the smallest
    total = {k: int(r["total_bytes_max"]) for k, r in hybrid.items()}
    assert max(total, key=total.get) == "DP1 TP1 PP4"
    text = flat(lesson("07"))
    assert "even though its parameters are the smallest share" not in text
    for k in model_parallel:
        assert f"{params[k]:,}" in text, k
    assert "fails at the *second* step's loss" in text
    assert "for p in bucket.params:" in text


def test_lesson_7_averaging_mistake_fails_at_the_second_step_s_loss(mpirun):
    """The lines lesson 7 shows, put where it says (tests/mpi/averaging_mistake.py), on 2
    replicas: the first step's loss is the serial one (to the 1e-12 the hybrid checks ask), the
    second is not. With SGD it differs by more than 1e-6; with Adam by far more than 1e-12 and
    yet under 1e-6 (relative), the nearly invisible difference the lesson describes."""
    out = mpirun(2, [MPI_SCRIPTS / "averaging_mistake.py"], timeout=60).stdout
    found = re.findall(r"^(\w+) step (\d) loss (\S+) serial (\S+)$", out, re.M)
    rel = {(optim, int(step)): abs(float(got) - float(want)) / abs(float(want))
           for optim, step, got, want in found}
    assert sorted(rel) == [("adam", 0), ("adam", 1), ("sgd", 0), ("sgd", 1)], out
    assert rel["adam", 0] <= 1e-12 and rel["sgd", 0] <= 1e-12, rel
    assert rel["sgd", 1] > 1e-6, rel
    assert 1e-10 < rel["adam", 1] < 1e-6, rel


# ----------------------------------------------------------------------------- lesson 11
def test_lesson_11_parameter_counts_are_the_model_s():
    """Lesson 11 and its exercise 5 count the default MoE GPT's numbers: 33,088 an expert,
    49,118 outside the experts, 578,526 in all, and a rank's share for ep 2 and 4."""
    from mpipar import serial

    args = cli.parse_args("serial", ["--model", "gpt", "--experts", "8", "--top-k", "2"])
    model = serial.Task(args).build_model().init(0)
    sizes = {name: p.data.size for name, p in model.named_parameters()}
    expert = sum(n for name, n in sizes.items() if ".mlp.experts.0." in name and "blocks.0" in name)
    dense = sum(n for name, n in sizes.items() if ".mlp.experts." not in name)
    assert (expert, dense, sum(sizes.values())) == (33_088, 49_118, 578_526)
    text = flat(lesson("11-") + (LESSONS / "solutions" / "11-expert-parallel.md").read_text())
    for g, numbers in ((2, "313,822"), (4, "181,470")):
        assert f"{dense + 2 * 8 // g * expert:,}" == numbers and numbers in text
    assert "1,451,760" in text and (dense + 4 * expert) * 8 == 1_451_760


def test_lesson_11_exercise_3_table_is_what_the_runs_print():
    """Each row of the aux-loss coefficient table (20 float64 steps, deterministic) is what
    the serial trainer prints for that coefficient."""
    text = (LESSONS / "solutions" / "11-expert-parallel.md").read_text()
    table = re.findall(r"^\| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
                       text, re.M)
    assert [row[0] for row in table] == ["0", "0.01", "0.1", "1"], table
    for coef, train, val, first, second in table:
        out = subprocess.run([sys.executable, "-m", "mpipar.serial", "--model", "gpt",
                              "--experts", "8", "--top-k", "2", "--steps", "20", "--dtype",
                              "float64", "--quiet", "--aux-loss-coef", coef], cwd=ROOT,
                             capture_output=True, text=True, timeout=120).stdout
        assert f"final train loss {train}, val loss {val}," in out, out
        assert re.findall(r"max / mean (\S+)", out) == [first, second], out


def test_lesson_11_exercise_7_all_to_alls_are_the_cost_model_s():
    """The hand count of exercise 7 (1.086528 ms, and 1.479744 ms at --imbalance 1.5) is what
    the cost model predicts for the command the exercise gives."""
    text = (LESSONS / "solutions" / "11-expert-parallel.md").read_text()
    spec = S.GPTSpec(96, 64, 4, 2, 32, experts=8, top_k=2)
    hw = S.this_machine(1e9, 1e-5, 1e-9)
    for imbalance, seconds, shown in ((1.0, 1.086528e-3, "1.087 ms"),
                                      (1.5, 1.479744e-3, "1.480 ms")):
        r = S.predict(spec, hw, dp=4, global_batch=32, dtype_bytes=4, ep=4,
                      imbalance=imbalance)
        assert r["ep_comm_s"] == pytest.approx(seconds, rel=1e-12)
        assert f"{seconds * 1e3:.6f} ms" in text and shown in text
    assert "98,304 bytes" in text and "147,456 bytes" in text


# ----------------------------------------------------------------------------- lesson 12
def test_lesson_12_activation_bytes_are_the_attention_weights_arithmetic(mpirun):
    """Lesson 12 and its exercise 6: a ring rank on cp G holds the serial activations over G,
    less, per layer, its share of the s x s weights (B H s s / G values) plus its output and a
    log-sum-exp per query instead; the cp 2 ledger shows it."""
    text = flat(lesson("12-") + (LESSONS / "solutions" / "12-context-parallel.md").read_text())
    serial, b, h, s, d, w, layers = 25_452_544, 32, 4, 32, 16, 8, 2
    for g, held in ((4, 6_117_376), (2, 12_234_752)):
        n = s // g
        weights, kept = b * h * n * s * w, b * h * n * d * w + b * h * n * w
        assert serial // g - layers * (weights - kept) == held and f"{held:,}" in text
        assert f"{weights:,}" in text and f"{layers * (weights - kept):,}" in text
    out = mpirun(2, ["-m", "mpipar.context_parallel", "--steps", "1", "--quiet", "--memory",
                     "--dtype", "float64"], timeout=90).stdout
    assert re.search(r"^ +1  cp 1 .* 12,234,752 ", out, re.M), out


def test_lesson_12_exercise_2_is_the_picture_s_run():
    from mpipar.tools.figures.context import ring_run

    d = ring_run("ring", g=8, seq_len=32)
    text = (LESSONS / "solutions" / "12-context-parallel.md").read_text()
    assert f"{d['work']} {d['balance']}" in text
    assert d["balance"] == pytest.approx(8 / 15, abs=1e-6)


# ----------------------------------------------------------------------------- lesson 13
def test_lesson_13_exercise_2_scales_are_the_rules():
    """Megatron's rules (hysteresis 2) and PyTorch's (1) after 14 overflows from 1e9."""
    from mpipar.engine import precision as P

    text = (LESSONS / "solutions" / "13-mixed-precision.md").read_text()
    for hysteresis, shown in ((2, "122,070.3"), (1, "61,035.2")):
        s = P.LossScaler(init_scale=1e9, hysteresis=hysteresis, min_scale=0.0)
        for _ in range(14):
            s.update(True)
        assert f"{s.scale:,.1f}" == shown and shown in text


def test_lesson_13_exercise_5_is_the_ledger_s(mpirun):
    """ZeRO-1 in bf16 with Adam on 4 ranks: 12 bytes a value of a padded 2,456-value shard."""
    out = mpirun(4, ["-m", "mpipar.data_parallel", "--sync", "allreduce", "--zero", "1",
                     "--model", "gpt", "--d-model", "16", "--n-heads", "2", "--n-layers", "2",
                     "--seq-len", "8", "--batch-size", "12", "--steps", "1", "--quiet",
                     "--precision", "bf16", "--memory"], timeout=90).stdout
    assert re.search(r"^ +0  dp 0 +19,648 +19,648 +29,472 ", out, re.M), out
    n = 9822
    assert -(-n // 4) * 12 == 29472 and n * 12 == 117864
    text = (LESSONS / "solutions" / "13-mixed-precision.md").read_text()
    assert "29,472" in text and "2,456" in text and "117,864" in text and "19,648" in text


# ----------------------------------------------------------------------------- lesson 9
def test_lesson_9_link_numbers_are_the_csv():
    """The table lesson 9 shows is plots/link.csv's run (each rate's DP steps, exposed
    communication, predictions and errors). Its text quotes none of the run's times, rates or
    errors: it reads them from the table and points to the report's section."""
    from mpipar.tools.cluster import burst_bytes, format_rate, parse_rate

    link = rows("link.csv")
    dp = {(r["bandwidth"], r["mode"]): r for r in link if r["kind"] == "dp"}
    text = lesson("09")
    table = text.split("$ python -m mpipar.tools.bench.link\n")[1].split("```")[0].splitlines()
    for rate in {rate for rate, _ in dp}:
        row = next(line for line in table if line.strip().startswith(
            format_rate(parse_rate(rate))))
        numbers = re.findall(r"(-?\d+) ms|([+-]\d+)%", row.split("Gb/s")[1])
        expect = []
        for mode in ("allreduce", "allreduce+overlap"):
            r = dp[rate, mode]
            expect += [f"{float(r[k]) * 1e3:.0f}" for k in
                       ("seconds", "exposed_seconds", "predicted_seconds")]
            expect.append(f"{100 * float(r['prediction_error']):+.0f}")
        assert ["".join(n) for n in numbers] == expect, (rate, row)
    text = flat(text)
    assert f"({burst_bytes(10**10) / 1e6:.2f} MB)" in text
    assert text.count("(../plots/REPORT.md#across-an-emulated-link)") >= 3


def test_lesson_9_speedup_table_is_the_csv():
    """The speedup table lesson 9 shows (the last of bench link's output) is link.csv's."""
    from mpipar.tools.cluster import format_rate, parse_rate

    link = rows("link.csv")
    table = lesson("09").split("$ python -m mpipar.tools.bench.link\n")[1].split("```")[0]
    table = table.split("speedup over one process")[1].splitlines()
    modes = table[1].split()[1:]
    at = {(r["bandwidth"], r["mode"]): r for r in link if r.get("speedup")}
    for rate in {rate for rate, _ in at}:
        row = next(line for line in table if line.strip().startswith(
            format_rate(parse_rate(rate))))
        shown = re.findall(r"([\d.]+)x", row)
        assert shown == [f"{float(at[rate, m]['speedup']):.2f}" for m in modes], (rate, row)


def test_lesson_9_other_schemes_are_the_csv():
    """Lesson 9's paragraph on the other schemes across the link quotes the bytes per step of
    plots/link.csv's rows of kind "scheme" (counted, the same in every run); the rates, steps
    and errors it leaves to the table and the report."""
    link = rows("link.csv")
    at = {(r["bandwidth"], r["mode"]): r for r in link if r["kind"] == "scheme"}
    text = flat(lesson("09").split("**The other schemes across the same link**")[1])
    tp, pp = at["none", "tensor_parallel"], at["none", "pipeline"]
    assert f"{tp['messages']} Allreduces, {float(tp['bytes']) / 1e6:.2f} MB per step" in text
    assert f"{float(pp['bytes']) / 1e6:.2f} MB per stage and step" in text


# ----------------------------------------------------------------------------- README
TINY_GPT = ["--model", "gpt", "--d-model", "16", "--n-heads", "4", "--n-layers", "2",
            "--seq-len", "8", "--batch-size", "8", "--dtype", "float64", "--steps", "3", "--quiet"]
BITWISE = {  # the README's claim: two runs (ranks, scheme and flags) that end in the same bits
    "ZB-H1 and 1F1B": ((2, "pipeline", ["--schedule", "zb-h1", "--timeline", "none"]),
                       (2, "pipeline", ["--schedule", "1f1b", "--timeline", "none"])),
    "a run with `--recompute` and one without": ((1, "serial", ["--recompute"]),
                                                 (1, "serial", [])),
    "tensor parallelism's local and master updates": ((2, "tensor_parallel", []),
                                                      (2, "tensor_parallel",
                                                       ["--update", "master"])),
}


def test_readme_claims_only_what_the_tests_prove():
    text = flat((ROOT / "README.md").read_text())
    assert "to the last bit" not in text
    assert "relative error of at most 1e-10" in text
    assert "1e-10" in (ROOT / "tests" / "mpi" / "hybrid_checks.py").read_text()
    for claim in BITWISE:
        assert claim in text, claim


@pytest.mark.parametrize("claim", BITWISE)
def test_readme_bitwise_claims_hold(claim, tmp_path):
    """Each pair of runs the README says end bit for bit alike does, parameter by parameter."""
    import numpy as np
    from conftest import run_mpi

    from mpipar import train

    got = []
    for i, (ranks, scheme, flags) in enumerate(BITWISE[claim]):
        saved = tmp_path / f"{i}.npz"
        run_mpi(ranks, ["-m", f"mpipar.{scheme}", *TINY_GPT, *flags, "--save-params", saved])
        got.append(train.load_params(saved))
    assert sorted(got[0]) == sorted(got[1])
    for name in got[0]:
        assert np.array_equal(got[0][name], got[1][name]), (claim, name)


def test_readme_says_how_a_rank_waits_as_waiting_does():
    from mpipar.mpi import waiting

    text = flat((ROOT / "README.md").read_text())
    assert (f"polls for {waiting.SPIN_S * 1e6:g} us, then yields its core between polls for up "
            f"to {waiting.YIELD_S * 1e3:g} ms, then sleeps between polls (a pipeline stage, whose "
            "waits are long, sleeps at once)") in text
    assert waiting.default(True) == "backoff" and waiting.default(True, long_waits=True) == \
        "sleep" and waiting.default(False, long_waits=True) == "spin"


# ----------------------------------------------------------------------------- solutions
def exercises(text):
    """The numbers of a lesson's exercises (the numbered list under '## Exercises')."""
    part = text.split("## Exercises", 1)
    if len(part) < 2:
        return []
    section = part[1].split("\n## ", 1)[0]
    return [int(n) for n in re.findall(r"^(\d+)\. ", section, re.M)]


@pytest.mark.parametrize("path", sorted(LESSONS.glob("[0-9]*.md")), ids=lambda p: p.stem)
def test_every_exercise_has_a_worked_solution(path):
    """Each exercise is solved: in ``lessons/solutions/<lesson>.md`` (a heading per exercise),
    or in a collapsed section of the lesson itself (``## Solutions``, a <details> each)."""
    text = path.read_text()
    numbers = exercises(text)
    if not numbers:
        pytest.skip(f"{path.name} has no exercises")
    if "\n## Solutions" in text:
        section = text.split("\n## Solutions", 1)[1]
        solved = [int(n) for n in re.findall(r"<summary>(\d+)\.", section)]
    else:
        solution = LESSONS / "solutions" / path.name
        assert solution.exists(), f"{path.name} has exercises {numbers} but no solutions"
        assert f"solutions/{path.name}" in text, f"{path.name} does not link its solutions"
        solved = [int(n) for n in re.findall(r"^## Exercise (\d+)", solution.read_text(), re.M)]
    assert solved == numbers, f"{path.name}: solutions for {solved}, exercises {numbers}"


def test_benchmarks_in_lessons_never_write_the_committed_plots():
    """A lesson command that runs a benchmark writes a scratch folder (the default); one that
    names ``--out plots`` or writes into plots/ is never a run (console) command."""
    for path in LESSONS.rglob("*.md"):
        for block in re.findall(r"```console\n(.*?)```", path.read_text(), re.S):
            for line in block.splitlines():
                if line.strip().startswith("$ "):
                    writes = r"(--out|--timeline|--save-params|--checkpoint)[ =](\./)?plots\b"
                    assert not re.search(writes + r"|>\s*(\./)?plots/", line), \
                        f"{path.name}: {line}"


def test_lesson_6_exercise_5_is_the_replay():
    """The ratios and busy shares of the worked solution are ideal()'s; the limit is the stages'
    FLOPs as plan_stages cuts the default GPT."""
    from mpipar import serial
    from mpipar.parts import plan
    from mpipar.runner.cli import parse_args
    from mpipar.tools.bench.wait import ideal

    text = (LESSONS / "solutions" / "06-performance.md").read_text()
    values = [ideal(["mpipar.pipeline", "--micro-batches", str(m)]) for m in (1, 2, 4, 16, 32)]
    assert "    ratio  " + "  ".join(f"{r:.3f}" for r, _ in values) in text
    assert "    busy   " + "  ".join(f"{b:.3f}" for _, b in values) in text
    args = parse_args("pipeline", ["--quiet"], 2)
    counts, flops = plan.plan_stages(serial.Task(args), 2, args.micro_batches)
    fwd = [sum(flops[lo:hi]) / 1e6 for lo, hi in plan.stage_bounds(counts)]
    assert f"forwards of {fwd[0]:.2f} and {fwd[1]:.2f} MFLOP" in text and fwd[1] > fwd[0]
    assert f"{sum(fwd):.2f} / 2\n= {sum(fwd) / 2:.2f} MFLOP" in text
    assert f"tends to {sum(fwd) / 2:.2f} / {fwd[1]:.2f} = {sum(fwd) / 2 / fwd[1]:.3f}" in text
    assert values[0][0] == 1.0 and min(r for r, _ in values) == values[1][0]


def test_lesson_6_exercise_6_v_cut_numbers_are_the_plans():
    """The V's pieces of the 6-block GPT, its stages' sums and the replayed idle shares of the
    default cut and of the balanced one, as solutions/06 quotes them."""
    from mpipar.engine import nn
    from mpipar.parts import plan, schedules

    text = " ".join((LESSONS / "solutions" / "06-performance.md").read_text().split())
    flops = plan.layer_flops(nn.GPT(94, 64, 4, 6, 32), (8, 32))  # 32 rows / 4 micro-batches
    assert plan.partition(flops, 4) == [2, 2, 2, 2] and plan.partition(flops, 2) == [4, 4]
    idle = []
    for cut in ([2, 2, 2, 2], [3, 2, 1, 2]):
        piece = [sum(flops[lo:hi]) / 1e6 for lo, hi in plan.stage_bounds(cut)]
        stages = [[piece[0], piece[3]], [piece[1], piece[2]]]  # rank r: pieces r and 2p-1-r
        timeline = schedules.simulate(schedules.schedule("zb-v", 2, 4, 2), stages,
                                      [[2 * f for f in s] for s in stages], placement="v")
        idle.append(schedules.simulated_bubble(timeline))
        sums = f"({sum(stages[0]):.2f} MFLOP)" if cut[0] == 3 else f"{sum(stages[0]):.2f} MFLOP"
        assert sums in text, sums
    piece = [sum(flops[lo:hi]) / 1e6 for lo, hi in plan.stage_bounds([2, 2, 2, 2])]
    assert "forwards of " + ", ".join(f"{f:.2f}" for f in piece[:3]) + \
        f" and {piece[3]:.2f} MFLOP" in text
    assert f"idles {idle[1]:.3f} of the step, the default cut {idle[0]:.3f}" in text
    assert f"a quarter of the step: the {idle[0]:.3f}" in text



def test_lesson_9_link_times_are_the_formula():
    """1 MiB x 8 / R at 1 Gbit/s and 100 Mbit/s, as lesson 9 gives them."""
    text = " ".join((LESSONS / "09-cluster.md").read_text().split())
    fast, slow = (8 * 2**20 / rate * 1e3 for rate in (1e9, 1e8))
    assert f"= {fast:.2f} ms at 1 Gbit/s and {slow:.1f} ms at 100 Mbit/s" in text


def test_the_dp_benchmark_s_gradient_bytes_are_its_parameters():
    """Psi = 4 bytes x the dp benchmark's parameters (a count): lesson 9's 8.7 MB and its
    8 Psi / R at 10 Gbit/s, 1 Gbit/s and 100 Mbit/s, and the n of solutions/06's exercise 2."""
    params = {int(r["params"]) for r in rows("dp.csv")}
    assert params == {2_176_010}, params
    psi = 4 * params.pop()
    text = flat(lesson("09"))
    assert f"Psi = {psi / 1e6:.1f} MB" in text
    ms = [8 * psi / rate * 1e3 for rate in (1e10, 1e9, 1e8)]
    assert f"8 Psi / R is {ms[0]:.0f} ms at 10 Gbit/s, {ms[1]:.0f} ms at 1 Gbit/s and " \
           f"{ms[2] / 1e3:.1f} s at 100 Mbit/s" in text
    assert f"8 Psi / R = {ms[0]:.0f} ms" in text and f"8 Psi / R = {ms[1]:.0f} ms" in text
    assert f"8 Psi / R = {ms[2] / 1e3:.1f} s" in text
    solution = flat((LESSONS / "solutions" / "06-performance.md").read_text())
    assert f"2,176,010 parameters (`params`), so n = {psi:,} bytes" in solution
    assert f"0.5 x {psi:,} B x gamma = {psi // 2:,} B x gamma" in solution


def test_lesson_3_zero1_exercise_blocks_are_the_model_s():
    """Lesson 3's exercise 9 and its solution: the student track's MLP has 1,754 parameters,
    3 blocks of 585 on 3 ranks, one value of padding."""
    from mpipar import serial
    from mpipar.tools.exercises import ZERO_MLP, find

    args = cli.parse_args("serial", ZERO_MLP)
    n = sum(p.data.size for p in serial.Task(args).build_model().init(0).parameters())
    ranks = find("zero1-shards").ranks
    block = -(-n // ranks)
    assert (n, ranks, block, ranks * block - n) == (1_754, 3, 585, 1)
    text = flat(lesson("03-") + (LESSONS / "solutions" / "03-data-parallel.md").read_text())
    assert "1,754 parameters make 3 blocks of 585 and one value of padding" in text
    assert "1,754 values on 3 ranks are 3 blocks of 585" in text


def test_every_exercise_is_graded_in_a_lesson_at_its_table_s_minutes():
    """Each student exercise is named in one lesson exercise's grade command, with the minutes
    of :mod:`mpipar.tools.exercises` ("about N" or "about an hour", the only time of its item
    or the one beside its function), and the lessons README counts the small and the larger
    ones as the table does."""
    from mpipar.tools.exercises import EXERCISES

    items = [(p.name, flat(item)) for p in sorted(LESSONS.glob("[0-9]*.md"))
             for item in re.split(r"\n(?=\d+\. )", p.read_text())]
    for ex in EXERCISES:
        where = [(name, item) for name, item in items if re.search(
            rf"student grade \.\./my-mpipar [\w -]*\b{re.escape(ex.name)}(?![\w-])", item)]
        assert len(where) == 1, f"{ex.name} is graded in {[n for n, _ in where] or 'no lesson'}"
        name, item = where[0]
        times = re.findall(r"about (an hour|\d+)", item)
        said = "an hour" if ex.minutes == 60 else str(ex.minutes)
        function = re.escape(ex.functions[-1].split(".")[-1])
        beside = re.search(rf"{function}`?, about (an hour|\d+)", item)
        got = beside[1] if beside else times[0] if len(times) == 1 else None
        assert got == said, f"{name}: {ex.name} takes about {said} minutes, the lesson says {got}"
    large = [ex.minutes for ex in EXERCISES if ex.name.endswith(("-dp", "-shards", "-mlp"))]
    small = [ex.minutes for ex in EXERCISES if not ex.name.endswith(("-dp", "-shards", "-mlp"))]
    words = {3: "Three", 9: "Nine"}
    readme = flat((LESSONS / "README.md").read_text())
    assert (f"{words[len(small)]} exercises write the core of one piece each "
            f"({min(small)} to {max(small)} minutes)") in readme
    assert f"{words[len(large)]} build a scheme ({min(large)} to {max(large)} minutes)" in readme


def test_lesson_5_exercise_13_idles_are_the_replays():
    """The worked answer's idle times on 4 ranks (F 1, B 2, W 1): the published bubble with no
    overlap and with full overlap, as the report's pairs replay, and the order run here."""
    from test_schedules import pair_replay, rank_idle

    from mpipar.parts.schedules import schedule, simulate
    from mpipar.parts.v_schedules import published_bubble

    none, full = (rank_idle(pair_replay(4, 8, 1.0, 2.0, 1.0, fb)[0]) for fb in (3.0, 2.0))
    ours = rank_idle(simulate(schedule("dualpipev", 4, 8, 2), placement="v")[0])
    assert (none, full, ours) == (published_bubble(4, 1, 2, 1, 3), published_bubble(4, 1, 2, 1, 2),
                                  3.0) == (6.0, 3.0, 3.0)
    text = flat((LESSONS / "solutions" / "05-pipeline-parallel.md").read_text())
    assert "3 x (3 + 2 - 3) = 6 chunk-units of idle on rank 0" in text
    assert "F&B = B = 2: 3 x (2 + 2 - 3) = 3" in text and "idles p - 1 = 3 chunk-units" in text


def test_lesson_11_pairs_and_lesson_13_layouts_are_the_code_s():
    """Lesson 11: rank 0's tokens and pairs are its rows x the default sequence length x top-k,
    and Step 3's counts add up to them; lesson 13: the layouts precision_schemes.py runs, and
    how many of them fp16 runs (all but the bf16 gradient sum)."""
    a = cli.parse_args("expert_parallel", [])
    tokens = 8 * a.seq_len
    text = flat(lesson("11-"))
    assert f"8 rows of {a.seq_len} tokens are {tokens} tokens, {a.top_k * tokens} pairs" in text
    assert sum([153, 135, 130, 94]) == a.top_k * tokens
    assert "Alltoall of the pair counts [153, 135, 130, 94] by expert" in text
    tree = ast.parse((MPI_SCRIPTS / "precision_schemes.py").read_text())
    layouts = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", "") == "LAYOUTS")
    bf16_only = sum("--grad-sum" in flags for _, _, flags in layouts)
    assert (f"It runs {len(layouts)} layouts in bf16, and {len(layouts) - bf16_only} of them (all "
            "but the bf16 gradient sum) in fp16") in flat(lesson("13-"))


def test_lesson_12_exercise_1_counts_are_the_explain_lines(mpirun):
    """Exercise 1's answer: rank 1 of the ring on cp 4 sends 12 K, V blocks by Isend and 8 dK,
    dV by Sendrecv in a step, each 256.0 KiB, as its --explain lines show."""
    out = mpirun(4, ["-m", "mpipar.context_parallel", "--explain", "--steps", "1", "--quiet",
                     "--dtype", "float64"], timeout=90).stdout
    mine = [line for line in out.splitlines() if line.startswith("[rank 1, cp 1] ")]
    done = [line for line in mine if line.startswith("[rank 1, cp 1] Isend done")]
    pairs = [line for line in mine if line.startswith("[rank 1, cp 1] Sendrecv")]
    assert (len(done), len(pairs)) == (12, 8), mine
    assert all("256.0 KiB" in line for line in done + pairs), done + pairs
    text = flat((LESSONS / "solutions" / "12-context-parallel.md").read_text())
    assert "12 `Isend done` (6 forward and 6 backward" in text and "8 `Sendrecv` (dK, dV)" in text
