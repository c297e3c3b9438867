"""Pictures of layouts: the pipeline schedules as simulated grids, and the DP x TP x PP
process grid with its communicators."""

from mpipar.tools.figures.draw import PART_COLORS, RANK_COLORS, SplitRecorder, pyplot, rounded, save

# ----------------------------------------------------------------------------- 5. schedules
SCHEDULE_CASES = [("naive", 1), ("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]
V_CASES = [("1f1b", 1), ("zb-h1", 1), ("zb-v", 2), ("dualpipev", 2)]  # 11. on 8 micro-batches


def schedule_cells(name, p=4, m=4, v=1):
    """Each stage's compute cells (code, micro-batch, chunk, start, end) as
    :func:`~mpipar.parts.schedules.simulate` times ``schedule(name, ...)``: forward 1 unit,
    backward 2 (B 1 + W 1 where split), a chunk's costs 1/v of that, so the spans compare."""
    from mpipar.parts.schedules import placement_of, schedule, simulate

    timeline = simulate(schedule(name, p, m, v), forward_cost=1 / v, backward_cost=2 / v,
                        placement=placement_of(name))
    return [[(ins.code, ins.micro, ins.chunk, rounded(t0), rounded(t1))
             for ins, t0, t1 in events if ins.code in PART_COLORS] for events in timeline]


def schedules_run(p=4, m=4, cases=SCHEDULE_CASES):
    """Per schedule of ``cases``: its cells, the bubble formula, the idle share drawn."""
    from mpipar.parts.schedules import bubble_formula

    data = {name: dict(v=v, cells=schedule_cells(name, p, m, v),
                       bubble=rounded(bubble_formula(p, m, name, v)))
            for name, v in cases}
    for d in data.values():  # the idle share of the grid as drawn: 1 - busy / (p * span)
        cells = [c for row in d["cells"] for c in row]
        span = max(c[4] for c in cells) - min(c[3] for c in cells)
        d["drawn_bubble"] = rounded(1 - sum(c[4] - c[3] for c in cells) / (p * span))
    return data


def schedules_figure(path, p=4, m=4, cases=SCHEDULE_CASES):
    """Every schedule of ``cases`` as a grid of its simulated compute cells, one row per
    stage, on one time axis."""
    data = schedules_run(p, m, cases)
    end = max(c[4] for d in data.values() for row in d["cells"] for c in row)
    plt = pyplot()
    fig, axes = plt.subplots(len(data), 1, figsize=(14, 1.2 + 1.25 * len(data)), sharex=True)
    for ax, (name, d) in zip(axes, data.items()):
        for s, row in enumerate(d["cells"]):
            for code, micro, chunk, t0, t1 in row:
                ax.barh(s, t1 - t0, left=t0, height=0.85, color=PART_COLORS[code],
                        alpha=1.0 if chunk == 0 else 0.55, edgecolor="black", linewidth=0.4)
                ax.text((t0 + t1) / 2, s, str(micro), ha="center", va="center", fontsize=7,
                        color="white" if chunk == 0 else "black")
        ax.set_yticks(range(p), [f"stage {s}" for s in range(p)], fontsize=7)
        ax.set_ylim(p - 0.5, -0.5)
        chunks = f", v = {d['v']} chunks (lighter: chunk 1)" if d["v"] > 1 else ""
        chunks += ", in a V: stage r holds pieces r and 2p-1-r" if name in ("zb-v", "dualpipev") \
            else ""
        ax.set_title(f"{name}{chunks}: idle share {d['drawn_bubble']:.3f} "
                     f"(formula {d['bubble']:.3f})", fontsize=9, loc="left")
    axes[-1].set_xlim(0, end)
    axes[-1].set_xlabel("time (forward of a whole stage = 1)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in PART_COLORS.values()]
    fig.legend(handles, ["F forward", "B backward (input gradient where W is apart)",
                         "W weight gradient"], loc="lower center", ncol=3, fontsize=8,
               bbox_to_anchor=(0.5, -0.02))
    fig.suptitle(f"pipeline schedules on {p} stages, {m} micro-batches (the number in a cell), "
                 "timed by schedules.simulate from schedules.schedule's instruction lists",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save(fig, path)
    return data


def v_schedules_figure(path):
    """The V-shaped schedules beside 1F1B and ZB-H1 on 4 stages and 8 micro-batches (DualPipeV
    needs 2p of them)."""
    return schedules_figure(path, 4, 8, V_CASES)


# ----------------------------------------------------------------------------- 10. warm-ups
LATENCIES = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)  # of a chunk's forward


def warmup_run(p=4, m=16, v=2):
    """The interleaved schedule's two warm-ups as :func:`~mpipar.parts.schedules.simulate`
    times them (a chunk's forward 1, backward 2) for each message latency of LATENCIES: the
    bubble, and each stage's most stashed chunk activations."""
    from mpipar.parts import schedules as S

    out = {}
    for warmup in S.WARMUPS:
        lists = S.schedule("interleaved", p, m, v, warmup)
        out[warmup] = dict(
            stash=[S.peak_in_flight(ins) for ins in lists],
            bubble=[rounded(S.simulated_bubble(S.simulate(lists, 1.0, 2.0, message_cost=x)))
                    for x in LATENCIES])
    return dict(p=p, m=m, v=v, latencies=list(LATENCIES), **out)


def warmup_figure(path, p=4, m=16, v=2):
    """Left: the bubble of each warm-up against the message latency; right: each stage's
    stash."""
    d = warmup_run(p, m, v)
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for warmup, style, color in (("production", "o-", RANK_COLORS[0]),
                                 ("lean", "s--", RANK_COLORS[1])):  # as in the right panel
        left.plot(d["latencies"], d[warmup]["bubble"], style, color=color,
                  label=f"--warmup {warmup}")
    left.set_xlabel("message latency (a chunk's forward = 1)")
    left.set_ylabel("idle share of the step (simulated)")
    left.set_title(f"interleaved 1F1B, p = {p}, m = {m}, v = {v}: bubble", fontsize=10)
    left.legend(fontsize=8, loc="upper left")
    left.grid(alpha=0.3)
    width = 0.38
    for i, (warmup, color) in enumerate((("production", RANK_COLORS[0]),
                                         ("lean", RANK_COLORS[1]))):
        xs = [s + (i - 0.5) * width for s in range(p)]
        right.bar(xs, d[warmup]["stash"], width, color=color, label=f"--warmup {warmup}")
    right.set_xticks(range(p), [f"stage {s}" for s in range(p)])
    right.set_ylabel("most chunk activations stashed at once")
    right.set_title("what the slack costs: the stash", fontsize=10)
    right.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    save(fig, path)
    return d


# ----------------------------------------------------------------------------- 6. the grid
def grid_layout(dp=2, tp=2, pp=2):
    """Per world rank: its (dp, pp, tp) coordinate and its tp, pp and dp colours from Grid."""
    from mpipar.mpi.grid import Grid

    out = []
    for rank in range(dp * tp * pp):
        comm = SplitRecorder(rank, dp * tp * pp)
        g = Grid(dp, tp, pp, mpi_comm=comm)
        out.append(dict(rank=rank, dp=g.dp_rank, pp=g.pp_rank, tp=g.tp_rank,
                        groups=dict(zip(("tp", "pp", "dp"), comm.colors))))
    return out


def grid_figure(path, dp=2, tp=2, pp=2):
    """Three copies of the layout (replicas side by side, stages down, tp ranks across), each
    coloured by one communicator's groups."""
    layout = grid_layout(dp, tp, pp)
    data = dict(dp=dp, tp=tp, pp=pp, ranks=layout)
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 1.8 + 1.1 * pp))
    for ax, kind in zip(axes, ("tp", "pp", "dp")):
        for e in layout:
            x, y = e["dp"] * (tp + 0.6) + e["tp"], e["pp"]
            ax.add_patch(plt.Rectangle((x, y), 0.9, 0.8, color=RANK_COLORS[e["groups"][kind]]))
            ax.text(x + 0.45, y + 0.4, f"rank {e['rank']}", ha="center", va="center",
                    color="white", fontsize=9)
        for d in range(dp):
            ax.text(d * (tp + 0.6) + tp / 2 - 0.05, -0.25, f"replica dp={d}", ha="center",
                    fontsize=8)
        ax.set_xlim(-0.2, dp * (tp + 0.6))
        ax.set_ylim(pp + 0.1, -0.5)
        ax.set_yticks([s + 0.4 for s in range(pp)], [f"stage pp={s}" for s in range(pp)])
        ax.set_xticks([d * (tp + 0.6) + t + 0.45 for d in range(dp) for t in range(tp)],
                      [f"tp={t}" for d in range(dp) for t in range(tp)], fontsize=8)
        n = len({e["groups"][kind] for e in layout})
        ax.set_title(f"{kind}_comm: {n} groups of {len(layout) // n} (one colour each)",
                     fontsize=10)
        for side in ax.spines.values():
            side.set_visible(False)
    fig.suptitle(f"the process grid of {dp * tp * pp} ranks, dp {dp} x tp {tp} x pp {pp} "
                 "(grid.Grid): world rank = dp*(PP*TP) + pp*TP + tp", fontsize=10)
    fig.tight_layout()
    save(fig, path)
    return data
