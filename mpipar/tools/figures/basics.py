"""The picture of the basic collectives: Scatter, Gather, Allgather, Reduce_scatter and Alltoall
on 4 stand-in ranks (:class:`~mpipar.tools.figures.draw.ThreadRanks`), each rank's buffer
before and after, and the binomial-tree broadcast of lesson 0 on 8. The tree is the script's
own ``bcast_tree`` (``lessons/code/00_bcast_reduce.py``), run on stand-in ranks: the picture
shows the order of that code's messages, not a redrawing of the rule."""

import ast
from pathlib import Path

import numpy as np

from mpipar.tools.figures.draw import RANK_COLORS, ThreadRanks, pyplot, save

NAMES = ["Scatter", "Gather", "Allgather", "Reduce_scatter", "Alltoall"]
TITLES = {
    "Scatter": "Scatter, root 0: block r of the\nroot's buffer to rank r",
    "Gather": "Gather, root 0: every rank's buffer\nto the root, in rank order",
    "Allgather": "Allgather: every rank's buffer to\nevery rank, in rank order",
    "Reduce_scatter": "Reduce_scatter: the element-wise sum,\nblock r of it to rank r",
    "Alltoall": "Alltoall: block d of rank s's buffer\nto rank d, as its block s (a transpose)",
}
SCRIPT = Path(__file__).resolve().parents[3] / "lessons" / "code" / "00_bcast_reduce.py"


# ----------------------------------------------------------------------------- the runs
def sizes(name, rank, p):
    """Elements ``rank`` sends and receives in collective ``name`` on p ranks, root 0 (0: a
    buffer MPI does not read or write on that rank, passed as None)."""
    root = rank == 0
    return {"Scatter": (p if root else 0, 1), "Gather": (1, p if root else 0),
            "Allgather": (1, p), "Reduce_scatter": (p, 1), "Alltoall": (p, p)}[name]


def labelled(rank, n):
    """Rank r's n elements 10 r + i: drawn as two digits, a value names the rank it started on
    and its place there (at most 10 ranks and 10 elements)."""
    return np.array([10 * rank + i for i in range(n)])


def collective_run(name, p):
    """Each rank's send buffer and receive buffer ([] where it passes None) after one call."""
    def body(comm):
        n_send, n_recv = sizes(name, comm.rank, p)
        send = labelled(comm.rank, n_send) if n_send else None
        recv = np.full(n_recv, -1) if n_recv else None  # -1: an element the call did not fill
        getattr(comm, name)(send, recv)
        return [[] if b is None else b.tolist() for b in (send, recv)]

    runs = ThreadRanks(p).run(body)
    return dict(before=[b for b, _ in runs], after=[a for _, a in runs])


def script_functions(comm):
    """The script's own ``send``, ``recv``, ``bcast_tree`` and ``reduce_tree``, compiled without
    its top level (which needs MPI and times a 1 MiB buffer), their globals being one stand-in
    rank's: ``comm``, ``rank``, ``p`` and ``count`` as the script defines them."""
    wanted = {"send", "recv", "bcast_tree", "reduce_tree"}
    tree = ast.parse(SCRIPT.read_text(), str(SCRIPT))
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    scope = dict(np=np, comm=comm, rank=comm.rank, p=comm.size, count=dict(sent=0, received=0))
    exec(compile(ast.Module(body, type_ignores=[]), str(SCRIPT), "exec"), scope)
    return scope


def tree_run(p=8, root=0, reduce=False):
    """The script's ``bcast_tree`` (or ``reduce_tree``) on p stand-in ranks. Returns every
    message as [round, source, dest] sorted by round then source, and each rank's buffer after
    it: for the broadcast, root's value 1 where it arrived (0 elsewhere); for the reduce, on
    root, the sum of 2**r over the ranks (each rank's share one bit)."""
    ranks = ThreadRanks(p)

    def body(comm):
        fns, me = script_functions(comm), comm.rank
        if reduce:
            out = np.zeros(1)
            fns["reduce_tree"](np.array([2.0 ** me]), out, root=root)
        else:
            out = np.array([1.0 if me == root else 0.0])
            fns["bcast_tree"](out, root=root)
        return int(out[0])

    got = ranks.run(body)
    return dict(p=p, root=root, sends=[list(s) for s in sorted(ranks.sends)], got=got)


def collectives_run(p=4):
    """Every collective of the picture on p stand-in ranks, and the broadcast tree on 8."""
    data = {name: collective_run(name, p) for name in NAMES}
    data["tree"] = tree_run(8)
    return dict(p=p, **data)


# ----------------------------------------------------------------------------- the drawing
def cell(ax, plt, x, y, value, summed_from=None):
    """One element: coloured by the rank it came from (value // 10); a sum striped with the
    colours of every rank it adds."""
    if summed_from:
        w = 1 / len(summed_from)
        for k, r in enumerate(summed_from):
            ax.add_patch(plt.Rectangle((x + k * w, y), w, 0.8, color=RANK_COLORS[r], alpha=0.45))
        ax.add_patch(plt.Rectangle((x, y), 1, 0.8, fill=False, ec="black", lw=0.8))
        ax.text(x + 0.5, y + 0.4, f"{value}", ha="center", va="center", fontsize=9,
                weight="bold")
        return
    ax.add_patch(plt.Rectangle((x, y), 1, 0.8, color=RANK_COLORS[value // 10], ec="white"))
    ax.text(x + 0.5, y + 0.4, f"{value:02d}", ha="center", va="center", fontsize=9,
            color="white", weight="bold")


def collective_panel(ax, plt, name, run, p):
    """Rank r's row: its send buffer (left), an arrow, its receive buffer (right)."""
    after_x = p + 1.4
    for r in range(p):
        ax.text(-0.15, r + 0.4, f"rank {r}", ha="right", va="center", fontsize=9)
        for i, v in enumerate(run["before"][r]):
            cell(ax, plt, i, r, v)
        summed = name == "Reduce_scatter"
        for i, v in enumerate(run["after"][r]):
            cell(ax, plt, after_x + i, r, v, list(range(p)) if summed else None)
        if summed:  # spell the sum out beside it, from the send buffers drawn on the left
            terms = "+".join(f"{run['before'][s][r]:02d}" for s in range(p))
            ax.text(after_x + 1.15, r + 0.4, f"= {terms}", va="center", fontsize=8)
        if not run["before"][r] or not run["after"][r]:
            side = 0 if not run["before"][r] else after_x
            ax.text(side + 0.1, r + 0.4, "(not used)", va="center", fontsize=8, color="#888888")
    for x, label in ((0, "before: send buffer"), (after_x, "after: receive buffer")):
        ax.text(x, -0.25, label, fontsize=8.5, va="bottom")
    ax.annotate("", xy=(after_x - 0.15, p / 2 - 0.1), xytext=(p + 0.15, p / 2 - 0.1),
                arrowprops=dict(arrowstyle="-|>", lw=1.5, color="#555555"))
    ax.set_xlim(-1.5, 2 * p + 1.5)
    ax.set_ylim(p, -0.9)
    ax.axis("off")
    ax.set_title(TITLES[name], fontsize=10)


def tree_panel(ax, plt, tree):
    """Rank r's column, one row per round: a filled circle once r has the root's data, and an
    arrow for each message, from the sender's circle in the round before to the receiver's."""
    p, sends = tree["p"], tree["sends"]
    rounds, gap = max(k for k, _, _ in sends), 1.5  # gap: the long arrows clear the circles
    got_in = {tree["root"]: 0} | {d: k for k, _, d in sends}
    for k in range(rounds + 1):
        for r in range(p):
            has = got_in[r] <= k
            ax.add_patch(plt.Circle((r, k * gap), 0.3, zorder=3, lw=1,
                                    fc=RANK_COLORS[0] if has else "white", ec=RANK_COLORS[0]))
            ax.text(r, k * gap, str(r), ha="center", va="center", fontsize=9, zorder=4,
                    color="white" if has else RANK_COLORS[0])
        n = sum(got_in[r] <= k for r in range(p))
        ax.text(p - 0.3, k * gap, f"{n} rank{'s' * (n > 1)}", va="center", fontsize=9)
    for k, s, d in sends:
        ax.annotate("", xy=(d, k * gap), xytext=(s, (k - 1) * gap), zorder=2, arrowprops=dict(
            arrowstyle="-|>", lw=1.6, color="#C44E52", shrinkA=9, shrinkB=9))
    ax.set_yticks([k * gap for k in range(rounds + 1)],
                  ["start"] + [f"round {k}" for k in range(1, rounds + 1)], fontsize=9)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_xticks([])
    ax.set_xlim(-0.6, p - 0.4)
    ax.set_ylim(rounds * gap + 0.5, -0.5)
    ax.set_aspect("equal")
    ax.set_xlabel("filled: has the data (the right column counts them). Reduce\n(reduce_tree) "
                  "runs the same arrows backwards, last round first", fontsize=8.5)
    ax.set_title(f"binomial-tree Bcast from rank {tree['root']} on {p} ranks\n"
                 f"(lesson 0's bcast_tree): {rounds} rounds", fontsize=10)


def collectives_figure(path):
    """One panel per collective, each rank's buffers before and after, and the broadcast tree."""
    data = collectives_run()
    p = data["p"]
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.4), gridspec_kw=dict(hspace=0.3, wspace=0.25))
    for ax, name in zip(axes.flat, NAMES):
        collective_panel(ax, plt, name, data[name], p)
    tree_panel(axes.flat[-1], plt, data["tree"])
    fig.suptitle(f"the basic collectives on {p} stand-in ranks: a cell's label rk is element k "
                 "of rank r's buffer, its colour rank r's; a striped cell is a sum", fontsize=11)
    save(fig, path)
    return data
