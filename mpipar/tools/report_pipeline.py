"""The report's pipeline paragraphs, from ``pp.csv`` and ``pp_rows256.csv``
(:mod:`mpipar.tools.bench.pp`, :mod:`mpipar.tools.bench.pp_wide`): the speedup over serial
split into its factors, ZB-H1 beside 1F1B with the measured F, B and W, and the pipeline with
micro-batches of 256 rows. Each returns its lines for
:func:`mpipar.tools.report_text.pipeline_section`."""

import statistics

from mpipar.tools.bench.pp import zb_formula


def zero_bubble_paragraph(pp):
    """For the report: ZB-H1 beside 1F1B from the same launch, P = 2 and 4, m = 4 and 16: the
    bubble measured from the trace beside each schedule's formula (empty without zb-h1 rows)."""
    from mpipar.tools.bench.common import csv_float as f

    def row(p, m, name):
        return next((r for r in pp if (r["ranks"], r["m"], r["schedule"], r["stage"])
                     == (str(p), str(m), name, "0")), None)

    parts, timed = [], []
    for p in (2, 4):
        for m in (4, 16):
            zb, ofb = row(p, m, "zb-h1"), row(p, m, "1f1b")
            if zb and ofb:
                parts.append(f"P = {p}, m = {m}: {f(zb, 'bubble_measured'):.3f} (formula "
                             f"{f(zb, 'bubble_formula'):.3f}) against 1F1B's "
                             f"{f(ofb, 'bubble_measured'):.3f} ({f(ofb, 'bubble_formula'):.3f})")
                if zb.get("bubble_replayed"):
                    timed.append(zb_timed(pp, p, m, zb, ofb))
    if not parts:
        return []
    return [("Zero-bubble ZB-H1 beside 1F1B in the same launch, the bubble measured from the "
             "trace (W counted as backward) against (p-1)/(3m+p-1) and (p-1)/(m+p-1): "
             + "; ".join(parts) + " (P = 4 oversubscribed; `pp.csv`)."), "",
            *([("Those formulas take F, B and W of equal times. With the times this run "
                "measured (one micro-batch, the mean over the stages; the last stage's forward "
                "includes the loss) ZB-H1's (p-1)(TF+TB-TW) / (m(TF+TB+TW) + (p-1)(TF+TB-TW)) "
                "and the schedule replayed stage by stage with each stage's own times "
                "(`schedules.simulate`, free messages) give: " + "; ".join(timed)
                + ". What the replay leaves between it and the measured bubble is the messages "
                "and the waits for them, and the ranks slowing each other."), ""]
              if timed else [])]


def zb_timed(pp, p, m, zb, ofb):
    """One (p, m) of the zero-bubble paragraph: the measured F, B, W, ZB-H1's formula with
    them, the replays of ZB-H1 and 1F1B and their measured bubbles."""
    from mpipar.tools.bench.common import csv_float as f

    stages = [r for r in pp if (r["ranks"], r["m"], r["schedule"]) == (str(p), str(m), "zb-h1")]
    tf, tb, tw = (statistics.mean(f(r, k) for r in stages)
                  for k in ("forward_ms", "backward_ms", "weight_ms"))
    formula = zb_formula(p, m, tf, tb, tw) if m >= p else float("nan")
    return (f"P = {p}, m = {m}: F {tf:.1f}, B {tb:.1f}, W {tw:.1f} ms, formula {formula:.3f}, "
            f"replayed {f(zb, 'bubble_replayed'):.3f}, measured {f(zb, 'bubble_measured'):.3f} "
            f"(1F1B replayed {f(ofb, 'bubble_replayed'):.3f}, measured "
            f"{f(ofb, 'bubble_measured'):.3f})")


def speedup_paragraph(pp):
    """For the report: 1F1B's speedup at P = 2, m = 16 factor by factor, from pp.csv's rows of
    stage 0, between blank lines (only the blank line for a pp.csv without the factors), and
    ZB-H1's bubble beside 1F1B's."""
    from mpipar.tools.bench.common import csv_float as f

    r = next((r for r in pp if (r["ranks"], r["m"], r["schedule"]) == ("2", "16", "1f1b")), None)
    if r is None or not r.get("micro_efficiency"):
        return ["", *zero_bubble_paragraph(pp)]
    bubble, eff, rows = f(r, "bubble_measured"), f(r, "micro_efficiency"), r["rows_per_micro"]
    return ["", (
        f"Speedup over the serial step at P = 2, m = 16 (1F1B): {f(r, 'speedup_vs_serial'):.2f} "
        f"= 2 x (1 - bubble {bubble:.3f}) x micro-batch efficiency {eff:.3f} x stage efficiency "
        f"{f(r, 'stage_efficiency'):.3f} x span share {f(r, 'span_share'):.3f} (target 1.6). The "
        "micro-batch efficiency is the serial step on the whole batch over the same model's step "
        f"accumulated over 16 micro-batches of {rows} rows, timed in the same rounds: products "
        "of few rows run slower per row, and each micro-batch adds its dW into the whole "
        f"gradient. With the bubble it leaves 2 x (1 - bubble) x efficiency = "
        f"{2 * (1 - bubble) * eff:.2f}, whatever the pipeline does. {blas_sentence(r, rows)}"
        "The stage efficiency (a "
        "stage's compute, from the trace, against half the accumulated step: below 1 when the "
        "two ranks slow each other through the shared memory and caches) and the span share "
        "(the optimizer step and the messages outside the first forward to the last backward) "
        "take the rest (`pp.csv`)."), "", *zero_bubble_paragraph(pp)]


def blas_sentence(r, rows):
    """What the BLAS library alone keeps of the micro-batch efficiency (pp.csv's
    blas_efficiency, where the run measured it; else nothing)."""
    from mpipar.tools.bench.common import csv_float as f

    if not r.get("blas_efficiency"):
        return ""
    blas, eff = f(r, "blas_efficiency"), f(r, "micro_efficiency")
    return (f"Of that efficiency the BLAS library alone sets {blas:.3f}: one Linear's forward, dx "
            f"and dW in bare NumPy, on the whole batch against over its 16 micro-batches of "
            f"{rows} rows (each dW added into the gradient), timed in the same rounds "
            f"(`SerialReference.products`); what the framework's layers keep of the rest is "
            f"{eff / blas:.3f}. ")


def wide_paragraph(wide, pp):
    """For the report: P = 2, m = 16 at the micro-batch size of ``wide`` (pp_rows256.csv's rows,
    from ``python -m mpipar.tools.bench pp_wide``), each schedule's speedup over serial, and 1F1B's
    factors beside those of ``pp`` (pp.csv's rows, 64 rows a micro-batch); between blank
    lines, or nothing without the CSV."""
    from mpipar.tools.bench.common import csv_float as f

    def at(rows, name):
        return next((r for r in rows if (r["ranks"], r["m"], r["stage"], r["schedule"])
                     == ("2", "16", "0", name)), None)

    r, narrow = at(wide, "1f1b"), at(pp, "1f1b")
    if r is None or narrow is None:
        return []
    names = {"1f1b": "1F1B", "zb-h1": "ZB-H1", "gpipe": "GPipe"}
    found = {names[n]: f(x, "speedup_vs_serial") for n in names if (x := at(wide, n))}
    best = max(found, key=found.get)
    rows, small = r["rows_per_micro"], narrow["rows_per_micro"]

    def factors(x):
        blas = f" (BLAS alone {f(x, 'blas_efficiency'):.3f})" if x.get("blas_efficiency") else ""
        return (f"micro-batch efficiency {f(x, 'micro_efficiency'):.3f}{blas}, stage efficiency "
                f"{f(x, 'stage_efficiency'):.3f}")

    return ["", (
        f"The same pipeline with micro-batches of {rows} rows (P = 2, m = 16, batch "
        f"{16 * int(rows)}; `python -m mpipar.tools.bench pp_wide`, `pp_rows{rows}.csv`): speedup "
        f"over serial {', '.join(f'{n} {v:.2f}' for n, v in found.items())} (target 1.6: "
        f"{'met' if found[best] >= 1.6 else 'not met'} by the best, {best}). 1F1B's factors "
        f"at {rows} rows: bubble {f(r, 'bubble_measured'):.3f}, {factors(r)}, span share "
        f"{f(r, 'span_share'):.3f}; at {small} rows (above): bubble "
        f"{f(narrow, 'bubble_measured'):.3f}, {factors(narrow)}. Taller micro-batches buy "
        "back most of what products of few rows lose (the micro-batch efficiency). A stage "
        "efficiency below 1 is the two stages slowing each other; above 1, as "
        + ("both are here" if min(f(r, "stage_efficiency"), f(narrow, "stage_efficiency")) > 1
           else "it can be") + ", each stage computed its half of the model in less than half "
        "the time one process took over the whole."), ""]
