"""The picture of expert parallelism's dispatch: the routing tables of the ranks, the counts
their Alltoall exchanges, and the rows that arrive at each expert's rank. It runs the real
layer, :class:`mpipar.expert_parallel.ExpertParallelMoE` with the hand-written
:func:`~mpipar.expert_parallel.pairwise_alltoallv`, on stand-in ranks
(:class:`~mpipar.tools.figures.draw.ThreadRanks`), and identifies every row that arrived."""

import numpy as np

from mpipar.tools.figures.draw import RANK_COLORS, ThreadRanks, pyplot, rounded, save


def dispatch_run(g=4, experts=8, k=2, tokens=3, width=4, seed=0):
    """One MoE layer of ``experts`` experts on g stand-in ranks, each routing ``tokens`` tokens
    of its own. Returns per rank its tokens' probabilities and chosen experts, the rows each
    rank sent to each (the dispatch's counts), what arrived at each rank as (source, token,
    expert) in arrival order (each row checked to be that token's), and the largest difference
    between the layer's output and the serial layer's."""
    from mpipar.engine.moe import MoE
    from mpipar.expert_parallel import ExpertParallelMoE, pairwise_alltoallv

    class Recorded(ExpertParallelMoE):
        def run_experts(self, h, p, rows, micro_id):
            self.log = dict(h=h.copy(), p=p.copy(), rows=[r.tolist() for r in rows], moves=[])
            return super().run_experts(h, p, rows, micro_id)

        def moved(self, rows, out_rows, in_rows, what):
            arrived = super().moved(rows, out_rows, in_rows, what)
            self.log["moves"].append((list(out_rows), arrived.copy()))
            return arrived

    xs = [30 * np.random.default_rng(seed + 1 + r).normal(size=(1, tokens, width))
          for r in range(g)]  # wide logits, so the routing spreads over the experts

    def body(comm):
        layer = Recorded(width, experts, k, 0.0, comm, pairwise_alltoallv).init(seed, "mlp.")
        return layer.forward(xs[comm.rank]), layer.log

    runs = ThreadRanks(g).run(body)
    serial = MoE(width, experts, k, 0.0).init(seed, "mlp.")
    error = max(float(np.abs(out - serial.forward(x)).max()) for (out, _), x in zip(runs, xs))
    logs = [log for _, log in runs]
    per = experts // g
    arrivals = []
    for d in range(g):  # by source, then expert, then token: the order the sources sent
        expect = [(s, t, e) for s in range(g) for e in range(d * per, (d + 1) * per)
                  for t in logs[s]["rows"][e]]
        got = logs[d]["moves"][0][1]  # the dispatch: the first all-to-all of the forward
        assert len(got) == len(expect) and all(
            np.array_equal(row, logs[s]["h"][t]) for row, (s, t, _) in zip(got, expect)), \
            f"rank {d} received other rows than its experts' tokens"
        arrivals.append(expect)
    return dict(g=g, experts=experts, k=k, tokens=tokens,
                p=[[[rounded(v) for v in row] for row in log["p"]] for log in logs],
                chosen=[[sorted(e for e in range(experts) if t in log["rows"][e])
                         for t in range(tokens)] for log in logs],
                sent=[log["moves"][0][0] for log in logs], arrivals=arrivals,
                serial_error=rounded(error))


def routing_panel(ax, plt, data):
    g, per = data["g"], data["experts"] // data["g"]
    row = 0
    for s in range(g):
        for t, (probs, chosen) in enumerate(zip(data["p"][s], data["chosen"][s])):
            for e, pe in enumerate(probs):
                on = e in chosen
                ax.add_patch(plt.Rectangle((e, row), 0.95, 0.9, edgecolor="black", linewidth=0.4,
                                           facecolor=RANK_COLORS[e // per] if on else "#EEEEEE"))
                ax.text(e + 0.47, row + 0.45, f"{pe:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if on else "#777777")
            ax.text(-0.2, row + 0.45, f"rank {s} token {t}", ha="right", va="center", fontsize=8,
                    color=RANK_COLORS[s])
            row += 1
        ax.axhline(row - 0.05, color="black", linewidth=0.8)
    for e in range(data["experts"]):
        ax.text(e + 0.47, -0.3, f"e{e}\nrank {e // per}", ha="center", va="bottom", fontsize=7)
    ax.set_xlim(-3.2, data["experts"])
    ax.set_ylim(row + 0.2, -1.3)
    ax.axis("off")
    ax.set_title(f"1. routing: each token's p over {data['experts']} experts; its top-{data['k']} "
                 "filled in\nthe colour of the rank that holds the expert", fontsize=9)


def counts_panel(ax, plt, data):
    g = data["g"]
    for s in range(g):
        for d in range(g):
            own = s == d
            ax.add_patch(plt.Rectangle((d, s), 0.95, 0.9, facecolor="#F4F4F4" if own else "white",
                                       edgecolor=RANK_COLORS[d], linewidth=1.5,
                                       hatch="//" if own else None))
            ax.text(d + 0.47, s + 0.45, str(data["sent"][s][d]), ha="center", va="center",
                    fontsize=11)
        ax.text(-0.15, s + 0.45, f"from rank {s}", ha="right", va="center", fontsize=8,
                color=RANK_COLORS[s])
    for d in range(g):
        ax.text(d + 0.47, -0.15, f"to {d}", ha="center", va="bottom", fontsize=8,
                color=RANK_COLORS[d])
    ax.text(g / 2, g + 0.35, "row s: what rank s sends (its routing table, summed by owner);\n"
            "column d: what rank d receives. The Alltoall of the counts gives\nrank d its column: "
            "the transpose. Hatched: the rank's own rows, copied", ha="center", va="top",
            fontsize=8)
    ax.set_xlim(-1.6, g)
    ax.set_ylim(g + 1.6, -0.8)
    ax.axis("off")
    ax.set_title("2. rows (token, expert pairs) from s to d", fontsize=9)


def arrivals_panel(ax, plt, data):
    g, tall = data["g"], max(len(a) for a in data["arrivals"])
    for d, arrived in enumerate(data["arrivals"]):
        for i, (s, t, e) in enumerate(arrived):
            ax.add_patch(plt.Rectangle((d, i), 0.9, 0.9, facecolor=RANK_COLORS[s], alpha=0.85))
            ax.text(d + 0.45, i + 0.45, f"r{s} t{t} -> e{e}", ha="center", va="center",
                    fontsize=7, color="white")
        ax.text(d + 0.45, -0.3, f"rank {d}", ha="center", va="bottom", fontsize=8,
                color=RANK_COLORS[d])
    ax.set_xlim(-0.1, g)
    ax.set_ylim(tall + 0.2, -1.0)
    ax.axis("off")
    ax.set_title("3. what arrives at each rank (colour: the sender), by source,\nthen expert, "
                 "then token: one run per expert follows", fontsize=9)


def dispatch_figure(path):
    data = dispatch_run()
    plt = pyplot()
    rows = data["g"] * data["tokens"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 1.5 + 0.42 * rows),
                             gridspec_kw=dict(width_ratios=[11, 6, 5]))
    routing_panel(axes[0], plt, data)
    counts_panel(axes[1], plt, data)
    arrivals_panel(axes[2], plt, data)
    fig.suptitle(f"expert parallelism's dispatch (ExpertParallelMoE with pairwise_alltoallv on "
                 f"{data['g']} stand-in ranks); its output differs from the serial layer's "
                 f"by {data['serial_error']:g}", fontsize=10)
    fig.tight_layout()
    save(fig, path)
    return data
