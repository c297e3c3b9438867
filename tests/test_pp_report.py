"""The report's paragraph on the pipeline with taller micro-batches reads every figure from
the rows it is given (pp_rows256.csv's and pp.csv's), and says whether the target is met."""

from mpipar.tools.report_pipeline import wide_paragraph


def row(schedule, speedup, rows=256, **factors):
    base = dict(ranks="2", m="16", stage="0", schedule=schedule, rows_per_micro=str(rows),
                speedup_vs_serial=str(speedup), bubble_measured="0.1", micro_efficiency="0.9",
                stage_efficiency="0.85", span_share="0.99")
    return dict(base, **{k: str(v) for k, v in factors.items()})


def test_the_wide_paragraph_sets_each_schedule_and_both_sizes_side_by_side():
    wide = [row("1f1b", 1.32), row("zb-h1", 1.61), row("gpipe", 1.3), row("1f1b", 9, m="4")]
    narrow = [row("1f1b", 1.2, rows=64, micro_efficiency=0.618, stage_efficiency=1.127)]
    (text,) = [line for line in wide_paragraph(wide, narrow) if line]
    assert "batch 4096" in text and "`pp_rows256.csv`" in text
    assert "speedup over serial 1F1B 1.32, ZB-H1 1.61, GPipe 1.30" in text
    assert "(target 1.6: met by the best, ZB-H1)" in text
    assert "at 256 rows: bubble 0.100, micro-batch efficiency 0.900, stage efficiency 0.850" in text
    assert "at 64 rows (above): bubble 0.100, micro-batch efficiency 0.618, stage efficiency " \
           "1.127" in text
    assert "above 1, as it can be, each stage computed its half" in text  # 0.85 at 256 rows
    (text,) = [line for line in wide_paragraph([row("1f1b", 1.32, stage_efficiency=1.07)],
                                               narrow) if line]
    assert "BLAS" not in text  # rows from before it was timed
    narrow = [dict(narrow[0], blas_efficiency="0.671")]
    (text,) = [line for line in wide_paragraph([row("1f1b", 1.5, blas_efficiency=0.907)],
                                               narrow) if line]
    assert "micro-batch efficiency 0.900 (BLAS alone 0.907), stage efficiency 0.850" in text
    assert "micro-batch efficiency 0.618 (BLAS alone 0.671), stage efficiency 1.127" in text
    (text,) = [line for line in wide_paragraph([row("1f1b", 1.32, stage_efficiency=1.07)],
                                               narrow) if line]
    assert "above 1, as both are here, each stage computed its half of the model in less " \
        "than half the time one process took over the whole." in text


def test_not_met_below_the_target_and_nothing_without_the_rows():
    text = "".join(wide_paragraph([row("1f1b", 1.32)], [row("1f1b", 1.2, rows=64)]))
    assert "(target 1.6: not met by the best, 1F1B)" in text
    assert wide_paragraph([], [row("1f1b", 1.2, rows=64)]) == []


def test_rows_default_to_64_even_after_a_run_with_taller_micro_batches(monkeypatch):
    """make report runs bench pp after bench pp_wide in one process, launch after launch:
    pp_wide's 256 rows must not become pp's default (it did once: launches 2 and 3 of the
    64-row benchmark ran at 256 rows and the report read an older pp.csv for them)."""
    from mpipar.tools.bench import pp

    monkeypatch.setattr(pp, "ROWS", 256)
    assert pp.parser().parse_args([]).rows == 64 == pp.DEFAULT_ROWS


def test_the_blas_reference_adds_the_micro_batches_dw_into_the_whole_batch_s():
    """SerialReference.products: over the micro-batches, each dW added into the gradient, the
    same dW as the whole batch's one product (float64: equal to rounding); every round times
    the serial and accumulated steps and both ways of the products."""
    import numpy as np

    from mpipar.tools.bench.pp import SerialReference

    ref = SerialReference(1, [2])
    ref.products_whole(2)
    whole = ref.dW.copy()
    ref.products_micro(2)
    assert np.abs(whole).max() > 0
    np.testing.assert_allclose(ref.dW, whole, rtol=1e-12, atol=1e-12 * np.abs(whole).max())
    ref.time_round(keep=True)
    assert set(ref.medians(2)) == {"serial", "accumulated", "products_whole", "products_micro"}


def test_the_speedup_paragraph_says_what_the_blas_library_alone_keeps():
    from mpipar.tools.report_pipeline import speedup_paragraph

    r = row("1f1b", 1.09, rows=64, micro_efficiency=0.644, stage_efficiency=1.01)
    text = "".join(speedup_paragraph([dict(r, blas_efficiency="0.700")]))
    assert "Of that efficiency the BLAS library alone sets 0.700: one Linear's forward, dx and " \
        "dW in bare NumPy, on the whole batch against over its 16 micro-batches of 64 rows" in text
    assert "what the framework's layers keep of the rest is 0.920." in text
    assert "BLAS" not in "".join(speedup_paragraph([r]))  # a pp.csv from before it was timed
