"""Timestamped events per rank, for timelines, bubbles and ``--explain``.

Every pipeline instruction, every layer pass a trainer times and every "sync" region records a
span (start, end, kind, label) with ``MPI.Wtime``; every MPI call made through
:mod:`mpipar.mpi.comm` records one too while ``TRACE.calls`` is on (benchmarks and tests that read
the calls turn it on: off, a call saves about a microsecond, a third of an 8-byte message).
``gather`` brings all ranks' spans to rank 0, and ``gantt`` draws them: one row per rank, idle
time left blank.
"""

from contextlib import contextmanager

import numpy as np
from mpi4py import MPI


class Trace:
    now = staticmethod(MPI.Wtime)  # the clock of every span

    def __init__(self):
        self.events = []  # (t0, t1, kind, label, info)
        self.enabled = True
        self.calls = False  # also a "comm" span per MPI call (mpipar.mpi.comm._record)

    def clear(self):
        self.events.clear()

    def add(self, t0, t1, kind, label, **info):
        if self.enabled:
            self.events.append((t0, t1, kind, label, info))

    @contextmanager
    def span(self, kind, label, **info):
        t0 = MPI.Wtime()
        try:
            yield
        finally:
            self.add(t0, MPI.Wtime(), kind, label, **info)

    def gather(self, mpi_comm):
        """All ranks' events on rank 0 (a list per rank), None elsewhere. Small metadata, so the
        lower-case (pickling) gather is the right call here."""
        return mpi_comm.gather(self.events, root=0)


TRACE = Trace()  # this process's trace


def busy_fraction(events, kinds, t_begin, t_end):
    """Share of [t_begin, t_end] covered by events of the given kinds (events do not overlap)."""
    busy = sum(min(t1, t_end) - max(t0, t_begin)
               for t0, t1, kind, _, _ in events if kind in kinds and t1 > t_begin and t0 < t_end)
    return busy / (t_end - t_begin)


def gantt(per_rank, path, title="", kinds_colors=None, row_label="stage", ax=None, ranks=None):
    """Draw per-rank events as a Gantt chart and save it to ``path`` (PNG: a file name or a
    file open for writing); with ``ax``, draw
    into that matplotlib axes instead (several charts in one figure) and return it.

    A bar carries its micro-batch number in 7 pt where that fits, else in 5 pt, else none (a
    note under the chart counts those). The legend sits right of the chart, off the bars. When
    ``ranks`` (default: one per row) outnumber the cores, a note says the bars are stretched:
    a rank that waits for a core looks busy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mpipar.engine.backend import cores

    colors = kinds_colors or {"forward": "#4C72B0", "backward": "#DD8452", "weight": "#8172B3",
                              "optimizer": "#55A868"}  # weight: W, a backward's second part

    def shade(kind, info):  # W is traced as backward work (the bubble counts it busy)
        return info.get("part") or kind

    t_zero = min(e[0] for events in per_rank for e in events)
    t_last = max(e[1] for events in per_rank for e in events)
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(11, 0.6 * len(per_rank) + 1.4))
    span_ms = (t_last - t_zero) * 1e3
    ax.set_xlim(0, span_ms)
    box = ax.get_window_extent()
    pt_per_ms = box.width * 72 / ax.figure.dpi / span_ms  # a bar's width in points

    def font_size(label, width_ms):  # digits are about 0.65 em wide; 3 pt of margin
        fits = [s for s in (7, 5) if 0.65 * s * len(label) + 3 <= width_ms * pt_per_ms]
        return fits[0] if fits else None

    unlabelled = 0
    for r, events in enumerate(per_rank):
        for t0, t1, kind, _label, info in events:
            if shade(kind, info) not in colors:
                continue
            x0, w = (t0 - t_zero) * 1e3, (t1 - t0) * 1e3
            ax.barh(r, w, left=x0, height=0.8, color=colors[shade(kind, info)],
                    edgecolor="black", linewidth=0.4)
            micro = info.get("micro")  # None for the optimizer step: no number to write
            size = font_size(str(micro), w) if micro is not None else None
            unlabelled += micro is not None and size is None
            if size:
                ax.text(x0 + w / 2, r, str(micro), ha="center", va="center",
                        fontsize=size, color="white")
    ax.set_yticks(range(len(per_rank)))
    ax.set_yticklabels([f"{row_label} {r}" for r in range(len(per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    drawn = [k for k in colors if any(shade(e[2], e[4]) == k for ev in per_rank for e in ev)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in drawn]
    ax.legend(handles, drawn, loc="upper left", bbox_to_anchor=(1.005, 1), fontsize=8,
              borderaxespad=0)
    ranks = len(per_rank) if ranks is None else ranks
    notes = ([f"{ranks} ranks on {cores()} cores: a rank waiting for a core looks busy, so "
              "bars and gaps are stretched"] if ranks > cores() else []) + \
        ([f"micro-batch numbers left out on {unlabelled} bars too narrow to hold them"]
         if unlabelled else [])
    if notes:  # under the axis label, in points, whatever the chart's height
        ax.annotate("\n".join(notes), xy=(0, 0), xycoords="axes fraction", xytext=(0, -32),
                    textcoords="offset points", va="top", fontsize=8, style="italic")
    ax.set_title(title)
    if not own:
        return ax
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110, bbox_inches="tight")  # (legend and notes: outside)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- bubbles
def step_summary(events):
    """(first forward start, last backward end, busy seconds) of one rank's traced step."""
    spans = [(t0, t1) for t0, t1, kind, _, _ in events if kind in ("forward", "backward")]
    return (min(t0 for t0, _ in spans), max(t1 for _, t1 in spans),
            sum(t1 - t0 for t0, t1 in spans))


def measured_bubble(summaries):
    """Idle share of one step from every rank's summary: 1 - busy / (P * span)."""
    begin = min(s[0] for s in summaries)
    end = max(s[1] for s in summaries)
    return 1.0 - sum(s[2] for s in summaries) / (len(summaries) * (end - begin))


def median_bubble(per_rank_summaries, skip=1):
    """Median over steps (after ``skip`` warm-up steps) of the measured bubble."""
    n_steps = len(per_rank_summaries[0])
    steps = range(min(skip, n_steps - 1), n_steps)
    return float(np.median([measured_bubble([s[i] for s in per_rank_summaries]) for i in steps]))


def median_step(per_rank_summaries, skip=1):
    """The step whose span (first forward to last backward, over all ranks) is the median:
    a typical step to draw, not one that another process happened to interrupt."""
    n_steps = len(per_rank_summaries[0])
    spans = [(max(s[i][1] for s in per_rank_summaries) - min(s[i][0] for s in per_rank_summaries),
              i) for i in range(min(skip, n_steps - 1), n_steps)]
    return sorted(spans)[len(spans) // 2][1]
