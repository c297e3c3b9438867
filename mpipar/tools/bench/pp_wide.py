"""The pipeline benchmark with micro-batches of 256 rows: P = 2, m = 16, GPipe, 1F1B and ZB-H1.

    python -m mpipar.tools.bench pp_wide      # pp_rows256.csv in --out

:mod:`mpipar.tools.bench.pp` with ``--ranks 2 --micro 16 --rows 256``: the same balanced stages,
schedules, rounds and speedup factors, with micro-batches four times as tall (batch 4096), so
that the micro-batch efficiency (the serial step on the whole batch over the same step
accumulated over the micro-batches) no longer holds the speedup down as at 64 rows. The
report sets it beside the 64-row figure (:func:`mpipar.tools.report_pipeline.wide_paragraph`).
"""

from mpipar.tools.bench import pp

ROWS, MICRO, RANKS = 256, 16, 2


def main(argv=None):
    argv = list(argv or [])
    quick = ["--steps", "2", "--warmup", "1"] if "--quick" in argv else ["--steps", "4"]
    pp.main(["--ranks", str(RANKS), "--micro", str(MICRO), "--rows", str(ROWS), *quick, *argv])


if __name__ == "__main__":
    main()
