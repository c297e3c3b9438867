"""The section "On a GPU" of ``plots/REPORT.md``, read from ``plots/engine_gpu.csv`` and
``plots/dp_gpu.csv``, which ``make gpu-check`` writes on a machine with CuPy and a GPU.

    python -m mpipar.tools.report_gpu     # rewrite only this section of plots/REPORT.md, in place

``make report`` writes the whole report, this section included (:func:`gpu_section`); on the
GPU's machine ``make gpu-check`` rewrites this section alone (:func:`update`), so that the
rest of the report keeps the figures of the machine that measured them.

1. The device, as CUDA names it in the CSVs, and what ran there.
2. The engine's step against the same step in bare CuPy at each row count, with the target.
3. Data parallelism on the GPU: step time and speedup per rank count and mode, the ranks
   sharing the GPUs there are (each takes its local rank modulo the GPUs), MPI's buffers staged
   through host memory unless MPI is CUDA-aware.
"""

import re

from mpipar.tools.bench.common import PLOTS, csv_rows, write_atomically
from mpipar.tools.bench.common import csv_float as _f

TITLE = "## On a GPU"
TARGET = 1.15  # the engine's overhead target, as on the CPU (mpipar.tools.bench.overhead)


def gpu_section(folder=PLOTS):
    """The section's lines: the measured tables, or how to measure them."""
    engine, dp = csv_rows(folder, "engine_gpu.csv"), csv_rows(folder, "dp_gpu.csv")
    lines = [TITLE, ""]
    if not engine and not dp:
        return lines + [
            "No GPU run is recorded in this report. On a machine with CuPy and a GPU, `make "
            "gpu-check` runs every scheme there against serial training (tests/test_gpu.py: "
            "each layout equal to the serial trainer on CuPy and on NumPy within 1e-10), times "
            "the engine against bare CuPy and data parallelism on the GPU, and writes this "
            "section (`engine_gpu.csv`, `dp_gpu.csv`).", ""]
    devices = sorted({r["device"] for r in engine + dp})
    lines += [f"Measured on {', '.join(devices)} by `make gpu-check` (every scheme's layout "
              "there also equals serial training: tests/test_gpu.py).", ""]
    if engine:
        lines += ["![engine on the GPU](engine_gpu.png)", "",
                  "| rows | mpipar.engine.nn ms | bare CuPy ms | ratio | target |",
                  "|---:|---:|---:|---:|---|"]
        for r in engine:
            met = "met" if _f(r, "ratio") <= TARGET else "not met"
            lines.append(f"| {r['batch']} | {_f(r, 'engine_ms'):.3f} | "
                         f"{_f(r, 'bare_cupy_ms'):.3f} | {_f(r, 'ratio'):.3f} | "
                         f"<= {TARGET}: {met} |")
        lines += ["", "Both steps are timed on the wall clock up to the device's "
                  "synchronisation (`engine_gpu.csv`); at these sizes a step is mostly kernel "
                  "launches, so the ratio is the engine's Python against the bare calls'.", ""]
    if dp:
        lines += ["![data parallelism on the GPU](dp_gpu_speedup.png)", "",
                  "| ranks | mode | step ms | speedup over 1 rank |", "|---:|---|---:|---:|"]
        lines += [f"| {r['ranks']} | {r['mode']} | {_f(r, 'step_ms'):.2f} | "
                  f"{_f(r, 'speedup'):.2f} |" for r in dp]
        lines += ["", f"MLP {dp[0]['model'].split(' ', 1)[1]}, batch {dp[0]['batch']}, "
                  "float32 (`dp_gpu.csv`). The ranks share the GPUs the machine has. "
                  + ("MPI was CUDA-aware: it read and wrote the device buffers itself."
                     if all(r["cuda_aware"] == "True" for r in dp) else
                     "MPI was not CUDA-aware: each gradient exchange crossed to pinned host "
                     "memory and back (one counted copy each way, "
                     "`mpipar.engine.backend.host`), which "
                     "a step on a GPU feels far more than one on the CPU."), ""]
    return lines


def update(path=None, folder=PLOTS):
    """Replace the section in REPORT.md (up to the next "## " heading, or the end) with
    :func:`gpu_section`, or add it at the end; the rest stays as it was. Returns the path."""
    path = path or folder / "REPORT.md"
    text = path.read_text() if path.exists() else ""
    section = "\n".join(gpu_section(folder)) + "\n"
    pattern = re.compile(rf"^{re.escape(TITLE)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text, count=1)
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section
    return write_atomically(path, text)


if __name__ == "__main__":
    print(f"wrote {update()}")
