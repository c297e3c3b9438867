"""REPORT.md's GPU section: how to measure it where no GPU run is recorded, the device and the
tables from the CSVs where one is, and `python -m mpipar.tools.report_gpu` rewriting only that
section of a report (the rest keeps the figures of the machine that measured them)."""

from mpipar.tools.bench.common import write_csv
from mpipar.tools.report_gpu import TITLE, gpu_section, update


def gpu_csvs(folder):
    write_csv("engine_gpu.csv", [dict(device="NVIDIA H200", batch=b, engine_ms=e,
                                      bare_cupy_ms=0.5, ratio=r)
                                 for b, e, r in ((16, 0.55, 1.1), (128, 0.6, 1.2))], folder)
    write_csv("dp_gpu.csv", [dict(device="NVIDIA H200", cuda_aware=False, ranks=p, mode="ring",
                                  model="mlp 64,1024,10", batch=1024, step_ms=t, speedup=s)
                             for p, t, s in ((1, 2.0, 1.0), (2, 1.6, 1.25))], folder)


def test_without_a_gpu_run_the_section_says_how_to_make_one(tmp_path):
    text = "\n".join(gpu_section(tmp_path))
    assert text.startswith(TITLE) and "No GPU run is recorded" in text
    assert "make gpu-check" in text and "|" not in text


def test_the_section_names_the_device_and_reads_every_row(tmp_path):
    gpu_csvs(tmp_path)
    text = "\n".join(gpu_section(tmp_path))
    assert "Measured on NVIDIA H200 by `make gpu-check`" in text
    assert "| 16 | 0.550 | 0.500 | 1.100 | <= 1.15: met |" in text
    assert "| 128 | 0.600 | 0.500 | 1.200 | <= 1.15: not met |" in text
    assert "| 2 | ring | 1.60 | 1.25 |" in text and "MPI was not CUDA-aware" in text


def test_update_rewrites_only_the_gpu_section(tmp_path):
    report = tmp_path / "REPORT.md"
    report.write_text(f"# report\n\n## Before\nkept 1\n\n{TITLE}\n\nold text\n\n## After\nkept 2\n")
    gpu_csvs(tmp_path)
    text = update(report, tmp_path).read_text()
    assert "old text" not in text and "Measured on NVIDIA H200" in text
    assert text.startswith("# report\n\n## Before\nkept 1\n\n## On a GPU\n")
    assert text.endswith("## After\nkept 2\n") and text.count(TITLE) == 1
    fresh = tmp_path / "fresh-report"
    fresh.write_text("# report\n")
    assert update(fresh, tmp_path).read_text().startswith(f"# report\n\n{TITLE}\n")
