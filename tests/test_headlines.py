"""The report's headlines: read from each launch's CSVs, summarised by median and range, and
judged against their targets by every launch (met), by the median only, or not met."""

import csv

from mpipar import headlines


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


def test_verdict():
    assert headlines.verdict([1.0, 1.1], ("<=", 1.15)) == "met"
    assert headlines.verdict([1.2, 1.3, 1.0], ("<=", 1.15)) == "not met"
    assert headlines.verdict([1.7, 1.5, 1.9], (">=", 1.6)) == "met by the median"
    assert headlines.verdict([1.0], None) == ""
    assert headlines.section([]) == []


def test_every_headline_reads_the_committed_plots():
    """Each headline's extractor finds its figure in the CSVs the report committed."""
    from mpipar.bench.common import PLOTS

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
