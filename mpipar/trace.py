"""Timestamped events per rank, for timelines, bubbles and ``--explain``.

Every MPI call made through :mod:`mpipar.comm` and every pipeline instruction records a span
(start, end, kind, label) with ``MPI.Wtime``. ``gather`` brings all ranks' spans to rank 0,
and ``gantt`` draws them: one row per rank, idle time left blank.
"""

from contextlib import contextmanager

from mpi4py import MPI


class Trace:
    def __init__(self):
        self.events = []  # (t0, t1, kind, label, info)
        self.enabled = True

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


def gantt(per_rank, path, title="", kinds_colors=None, row_label="stage", ax=None):
    """Draw per-rank events as a Gantt chart and save it to ``path`` (PNG); with ``ax``, draw
    into that matplotlib axes instead (several charts in one figure) and return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = kinds_colors or {"forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#55A868"}
    t_zero = min(e[0] for events in per_rank for e in events)
    t_last = max(e[1] for events in per_rank for e in events)
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(11, 0.6 * len(per_rank) + 1.4))
    for r, events in enumerate(per_rank):
        for t0, t1, kind, _label, info in events:
            if kind not in colors:
                continue
            x0, w = (t0 - t_zero) * 1e3, (t1 - t0) * 1e3
            ax.barh(r, w, left=x0, height=0.8, color=colors[kind], edgecolor="black", linewidth=0.4)
            if "micro" in info and w > 0.025 * (t_last - t_zero) * 1e3:
                ax.text(x0 + w / 2, r, str(info["micro"]), ha="center", va="center",
                        fontsize=7, color="white")
    ax.set_yticks(range(len(per_rank)))
    ax.set_yticklabels([f"{row_label} {r}" for r in range(len(per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), loc="upper right", fontsize=8, ncol=len(colors))
    ax.set_title(title)
    if not own:
        return ax
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

