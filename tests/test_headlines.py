"""The report's headlines: read from each launch's CSVs, summarised by median and range, and
judged against their targets by every launch (met), by the median only, or not met."""

import csv

from mpipar.tools import headlines


def write(folder, name, rows):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / name, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def launch(folder, engine_ratio, overlap_speedup, load):
    write(folder, "engine.csv", [dict(ratio=engine_ratio, bare_numpy_ms=1.3)])
    write(folder, "dp.csv", [dict(mode="master", ranks=1, speedup=1.0, loadavg_1min=load),
                             dict(mode="allreduce+overlap", ranks=2, speedup=overlap_speedup,
                                  loadavg_1min=load)])
    return folder


def test_median_range_and_verdicts(tmp_path):
    folders = [launch(tmp_path / "1", 1.10, 1.85, 0.5), launch(tmp_path / "2", 1.12, 1.79, 2.0),
               launch(tmp_path / "3", 1.20, 1.81, 1.0)]
    rows = headlines.collect(folders)
    assert [r["launch"] for r in rows if r["key"] == "engine_big"] == [1, 2, 3]
    assert not [r for r in rows if r["key"].startswith("pp")]  # no pp.csv: not measured
    summary = {h.key: rest for h, *rest in headlines.summary(rows)}
    assert summary["engine_big"] == [1.12, 1.10, 1.20, 3, "met by the median"]  # 1.20 > 1.15
    assert summary["dp2_overlap"] == [1.81, 1.79, 1.85, 3, "met by the median"]
    text = "\n".join(headlines.section(rows))
    assert "| engine / bare NumPy, the 784-128-...-10 MLP at 128 rows | 1.120 | 1.100 .. 1.200 " \
           "| 3 | <= 1.15 | met by the median |" in text
    assert "launch 2: load 2.00, bare-NumPy step 1.300 ms" in text
    assert "The sections below read the CSVs committed beside the plots, launch 1's" in text


def test_a_benchmark_run_again_into_plots_moves_launch_1_only(tmp_path):
    """report --plots-only after `bench dp --out plots`: launch 1's figure is the new dp.csv's,
    launches 2 and 3 keep theirs."""
    folders = [launch(tmp_path / "1", 1.10, 1.85, 0.5), launch(tmp_path / "2", 1.12, 1.79, 2.0),
               launch(tmp_path / "3", 1.20, 1.81, 1.0)]
    rows = headlines.collect(folders)
    launch(tmp_path / "1", 1.10, 1.50, 0.5)  # dp run again into launch 1's folder
    again = headlines.with_launch_1(rows, tmp_path / "1")
    overlap = {int(r["launch"]): r["value"] for r in again if r["key"] == "dp2_overlap"}
    assert overlap == {1: 1.5, 2: 1.79, 3: 1.81}
    assert len(again) == len(rows)
    assert headlines.with_launch_1(again, tmp_path / "1") == again  # nothing new: unchanged


def test_launch_1_is_the_committed_plots():
    """What the section says: make report's first launch writes plots/, the CSVs the other
    sections read; launches 2.. go to scratch folders."""
    from mpipar.tools import report

    assert report.launch_again(quick=True, launches=1) == [report.PLOTS]


def test_verdict():
    assert headlines.verdict([1.0, 1.1], ("<=", 1.15)) == "met"
    assert headlines.verdict([1.2, 1.3, 1.0], ("<=", 1.15)) == "not met"
    assert headlines.verdict([1.7, 1.5, 1.9], (">=", 1.6)) == "met by the median"
    assert headlines.verdict([1.0], None) == ""
    assert headlines.section([]) == []


def test_every_headline_reads_the_committed_plots():
    """Each headline's extractor finds its figure in the CSVs the report committed."""
    from mpipar.tools.bench.common import PLOTS

    missing = [h.key for h in headlines.HEADLINES if h.extract(PLOTS) is None]
    assert not missing, missing


def test_the_benchmarks_run_once_are_read_afresh(tmp_path):
    """bench wait runs on its own: its figures replace the report's older ones, as launch 1."""
    write(tmp_path, "wait.csv", [dict(scheme="main job (pipeline): 4 / 2 ranks", ratio=1.05),
                                 dict(scheme="dp allreduce: 4 / 2 ranks", ratio=1.4)])
    old = [dict(key="main_job", launch=1, value=2.0), dict(key="comm_8", launch=2, value=2.2)]
    rows = {r["key"]: r["value"] for r in headlines.with_once(old, tmp_path)}
    assert rows == {"comm_8": 2.2, "main_job": 1.05, "dp4_vs_2_small": 1.4}
    verdicts = {h.key: v for h, *_, v in headlines.summary(headlines.with_once(old, tmp_path))}
    assert verdicts["main_job"] == "met" and verdicts["dp4_vs_2_small"] == "not met"


def test_bench_wait_s_rounds_are_its_launches(tmp_path):
    """A wait.csv that keeps each round's ratio: the headline's median, range and verdict are
    over the rounds (one round above the target: met by the median, not met)."""
    write(tmp_path, "wait.csv", [dict(scheme="main job (pipeline): 4 / 2 ranks", ratio=1.01,
                                      round_ratios="1.011;0.960;1.230")])
    rows = headlines.with_once([], tmp_path)
    assert sorted(r["value"] for r in rows if r["key"] == "main_job") == [0.96, 1.011, 1.23]
    (h, med, lo, hi, n, verdict), = headlines.summary(rows)
    assert (h.key, med, lo, hi, n, verdict) == ("main_job", 1.011, 0.96, 1.23, 3,
                                                "met by the median")


def test_the_speed_section_sets_the_framework_beside_the_bare_floor(tmp_path):
    """wait.csv's pairs: each against its target, and the bare loop's (no target) as the
    floor the framework's data-parallel ratio is divided by."""
    from mpipar.tools import report_speed
    from mpipar.tools.bench.wait import BARE

    cell = dict(scheme="dp ring", strategy="spin", default="True", step_ms=2.0, min_ms=1.5,
                max_ms=2.5, loadavg_1min=0.3, ratio="", ratio_min="", ratio_max="", target="")
    pair = dict(cell, strategy="backoff", ratio_min=2.0, ratio_max=3.2)
    write(tmp_path, "wait.csv", [
        cell, dict(pair, scheme="main job (pipeline): 4 / 2 ranks", ratio=1.05, target=1.1),
        dict(pair, scheme="dp allreduce: 4 / 2 ranks", ratio=2.7, target=1.3),
        dict(pair, scheme=f"{BARE}: 4 / 2 ranks", ratio=3.0, step_ms=1.6)])
    text = "\n".join(report_speed.wait_lines(tmp_path))
    assert "main job (pipeline): 4 / 2 ranks 1.05 (2.00..3.20), target at most 1.1: met" in text
    assert "dp allreduce: 4 / 2 ranks 2.70 (2.00..3.20), target at most 1.3: **not met**" in text
    assert f"{BARE}: 4 / 2 ranks 3.00 (2.00..3.20), no target." in text
    assert "takes 3.00x as long on 4 ranks as on 2; mpipar's step 2.70x, 0.90 times the floor's" \
        in text
    assert "on 4 ranks 2.00 ms against the bare loop's 1.60 ms (1.25x;" in text
    write(tmp_path, "wait.csv", [cell, dict(pair, scheme="dp allreduce: 4 / 2 ranks", ratio=2.7,
                                            target=1.3)])
    assert "floor" not in "\n".join(report_speed.wait_lines(tmp_path))  # an older wait.csv
    main = dict(pair, scheme="main job (pipeline): 4 / 2 ranks", ratio=1.08, target=1.1)
    for rounds, verdict in [("1.07;1.08;1.09", "met"), ("1.07;1.08;1.25", "met by the median"),
                            ("1.07;1.12;1.25", "**not met**")]:  # as the headlines judge them
        write(tmp_path, "wait.csv", [dict(cell, round_ratios=""), dict(main, round_ratios=rounds)])
        assert f"target at most 1.1: {verdict}." in "\n".join(report_speed.wait_lines(tmp_path))


def test_the_main_job_is_set_beside_a_perfect_scheduler(tmp_path):
    """bench wait's ideal for the main job: the measured ratio and busy share beside it, and
    the verdict follows the data (busy cores: CPU time lost; idle cores: ranks woke late)."""
    from mpipar.tools import report_speed

    main = dict(scheme="main job (pipeline): 4 / 2 ranks", strategy="sleep", default="True",
                step_ms=50.0, min_ms="", max_ms="", loadavg_1min=0.3, ratio=1.08,
                ratio_min=1.01, ratio_max=1.22, target=1.1, cpu_ms=88.49, busy_share=0.874,
                ideal_ratio=0.925, ideal_busy_share=0.85)
    write(tmp_path, "wait.csv", [main])
    text = "\n".join(report_speed.wait_lines(tmp_path))
    assert "would take 0.93 of the 2-rank step, the cores 85% busy" in text
    assert "Measured, 1.08, with 88.5 ms of CPU time a step over the ranks: the cores 87% " \
        "busy, as busy as the perfect scheduler keeps them" in text
    write(tmp_path, "wait.csv", [dict(main, busy_share=0.7)])
    text = "\n".join(report_speed.wait_lines(tmp_path))
    assert "the cores 70% busy, less busy than the perfect scheduler keeps them" in text
    assert "Context switches" not in text  # a wait.csv from before they were counted
    write(tmp_path, "wait.csv", [dict(main, cpu2_ms=75.0, voluntary=301.4, involuntary=98.6,
                                      voluntary2=90.2, involuntary2=1.4)])
    text = "\n".join(report_speed.wait_lines(tmp_path))
    assert "88.5 ms of CPU time a step over the ranks (on 2 ranks that also sleep as they " \
        "wait, 75.0 ms: 4 ranks spend 1.18x the CPU time on the same step): the cores 87%" in text
    assert "Context switches a step over the ranks: 301 voluntary (a wait that sleeps) and 99 " \
        "involuntary (a rank preempted, as a waking rank takes the core) on 4 ranks, against " \
        "90 and 1 on 2" in text
    assert "ALONE" not in text  # not measured in this wait.csv
    write(tmp_path, "wait.csv", [dict(main, cpu2_ms=75.0, voluntary=301.4, involuntary=98.6,
                                      voluntary2=90.2, involuntary2=1.4, alone_cpu_ratio=1.1)])
    text = "\n".join(report_speed.wait_lines(tmp_path))
    assert "4 ranks on 2 cores spend 1.10x the CPU time a step and rank of 2: that much of the " \
        "difference is what sharing a core costs the work itself, with no wait in it." in text


def test_the_main_job_beside_busy_processes_is_tabled_and_judged(tmp_path):
    """wait_busy.csv: a row per strategy, a column per busy count, the default in bold, and
    the default beside 2 busy processes judged over the rounds, as the headline judges it."""
    from mpipar.tools import report_speed

    def row(busy, strategy, slowdown, rounds="", target=""):
        return dict(busy=busy, strategy=strategy, default=str(strategy == "sleep"),
                    slowdown=slowdown, slowdown_min=slowdown - 0.1, slowdown_max=slowdown + 0.1,
                    round_slowdowns=rounds, target=target, loadavg_1min=0.5)

    for rounds, verdict in [("1.4;1.5;1.6", "met"), ("1.4;1.5;2.6", "met by the median"),
                            ("1.4;2.1;2.6", "**not met**")]:
        write(tmp_path, "wait_busy.csv", [
            row(1, "spin", 1.3), row(2, "spin", 2.5), row(1, "sleep", 1.2),
            row(2, "sleep", 1.5, rounds, 2.0)])
        text = "\n".join(report_speed.busy_lines(tmp_path))
        assert "| strategy | N = 1 | N = 2 |" in text
        assert "| spin | 1.30 (1.20-1.40) | 2.50 (2.40-2.60) |" in text
        assert "| sleep | **1.20 (1.10-1.30)** | **1.50 (1.40-1.60)** |" in text
        assert ("Beside 2 busy processes the default (sleep) takes 1.50x the idle step, target "
                f"at most 2.0: {verdict}.") in text
        assert ("would take (4 + N) / 4 of its idle time: 1.25 for N = 1, 1.50 for N = 2. "
                "Fastest by the median: sleep beside 1, sleep beside 2.") in text
        (h, med, lo, hi, n, judged), = [s for s in headlines.summary(
            headlines.with_once([], tmp_path)) if s[0].key == "main_job_busy2"]
        assert (n, judged) == (3, verdict.strip("*"))
