"""Pictures of the collectives: the ring allreduce, the master scheme against the ring,
Megatron's f and g around an MLP block, and the vocabulary-parallel cross-entropy. Each runs
the real function on stand-in ranks (:class:`~mpipar.tools.figures.draw.ThreadRanks`)."""

import re
import textwrap
from types import SimpleNamespace

import numpy as np

from mpipar.tools.figures.draw import RANK_COLORS, ThreadRanks, pyplot, rounded, save


# ----------------------------------------------------------------------------- 1. the ring
def ring_run(p=4):
    """Run ring_allreduce on p stand-in ranks, rank r contributing 2**r to each of p one-element
    chunks, so a chunk's value names the ranks summed in it. Returns the holdings before every
    step and after the last (per step, rank, chunk: the ranks summed), what each rank sent at
    each step (its chunk), and the elements each rank sent in all."""
    from mpipar.data_parallel import ring_allreduce

    bufs = [np.full(p, 2.0 ** r) for r in range(p)]
    log = {r: [] for r in range(p)}  # per rank: (holdings before the step, chunk sent)

    def ranks_in(value):
        return [r for r in range(p) if int(value) >> r & 1]

    def on_send(rank, sendbuf):
        chunk = next(c for c in range(p) if np.shares_memory(sendbuf, bufs[rank][c:c + 1]))
        log[rank].append(([ranks_in(v) for v in bufs[rank]], chunk, sendbuf.size))

    ThreadRanks(p, on_send).run(lambda comm: ring_allreduce(comm, bufs[comm.rank]))
    steps = len(log[0])
    holds = [[log[r][k][0] for r in range(p)] for k in range(steps)]
    holds.append([[ranks_in(v) for v in bufs[r]] for r in range(p)])
    return dict(p=p, holds=holds, sent=[[log[r][k][1] for r in range(p)] for k in range(steps)],
                elements_sent=[sum(e[2] for e in log[r]) for r in range(p)])


def ring_panel(ax, plt, state, sent):
    """One step: a cell per (rank, chunk) shaded by how many ranks it has summed; with ``sent``
    (the chunk each rank sent in the step), that cell outlined and an arrow to the next rank."""
    p = len(state)
    for r in range(p):
        for c in range(p):
            n = len(state[r][c])
            ax.add_patch(plt.Rectangle((c, r), 1, 1, color=RANK_COLORS[0],
                                       alpha=0.15 + 0.85 * (n - 1) / (p - 1), lw=0))
            label = "all" if n == p else "+".join(map(str, state[r][c]))
            ax.text(c + 0.5, r + 0.5, label, ha="center", va="center", fontsize=8,
                    color="white" if n > p // 2 else "black")
    for r, c in enumerate(sent or []):
        inset = 0.07  # inside the cell: the outlines of neighbouring sends stay apart
        ax.add_patch(plt.Rectangle((c + inset, r + inset), 1 - 2 * inset, 1 - 2 * inset,
                                   fill=False, ec="#C44E52", lw=2.4, zorder=3))
        ax.annotate("", xy=(c + 0.5, (r + 1) % p + 0.15), xytext=(c + 0.5, r + 0.85),
                    arrowprops=dict(arrowstyle="->", color="#C44E52", lw=1.2,
                                    connectionstyle="arc3,rad=0.5" if r == p - 1 else "arc3"))
    ax.set_xlim(0, p)
    ax.set_ylim(p, 0)
    ax.set_xticks([c + 0.5 for c in range(p)], [f"chunk {c}" for c in range(p)], fontsize=7)
    ax.set_yticks([r + 0.5 for r in range(p)], [f"rank {r}" for r in range(p)], fontsize=7)


def ring_figure(path):
    """Small multiples: the start, then the state after each reduce-scatter and allgather step
    (2 rows of p panels: the last one explains the others)."""
    data = ring_run()
    p, holds, sent = data["p"], data["holds"], data["sent"]
    plt = pyplot()
    fig, axes = plt.subplots(2, p, figsize=(3.1 * p, 7.2), gridspec_kw=dict(hspace=0.45))
    for i, ax in enumerate(axes.flat[:len(holds)]):  # panel 0: the start; i: after step i
        ring_panel(ax, plt, holds[i], sent[i - 1] if i else None)
        phase = "reduce-scatter" if i < p else "allgather"
        title = "start: rank r holds its own\nvalue of every chunk" if i == 0 else \
            f"{phase} step {(i - 1) % (p - 1) + 1}" + \
            ("\n(done: every chunk summed)" if i == len(holds) - 1 else "")
        ax.set_title(title, fontsize=9)
    for ax in axes.flat[len(holds):]:
        ax.axis("off")
    axes.flat[-1].text(0, 0.5, f"n bytes in {p} chunks, {2 * (p - 1)} steps:\na rank sends "
                       f"one chunk (n/{p})\nper step, 2(P-1)/P n = "
                       f"{data['elements_sent'][0] / p:g} n in all:\nunder 2 n, whatever the"
                       "\nnumber of ranks.\n'all': every rank's value\nsummed", fontsize=10,
                       va="center")
    fig.suptitle(f"ring allreduce on {p} ranks (data_parallel.ring_allreduce): a cell lists the "
                 "ranks whose values it has summed; red: the chunk a rank sends to the next "
                 "rank in that step", fontsize=10)
    save(fig, path)
    return data


# ----------------------------------------------------------------------------- 2. master vs ring
def rank_nodes(ax, plt, pts):
    """A labelled circle per rank at the points ``pts`` (rank order)."""
    for r, (x, y) in enumerate(pts):
        ax.add_patch(plt.Circle((x, y), 0.17, color=RANK_COLORS[r], zorder=3))
        ax.text(x, y, f"rank {r}", ha="center", va="center", fontsize=8, color="white", zorder=4)
    ax.set_xlim(-1.6, 1.6)
    ax.set_ylim(-1.6, 1.6)
    ax.set_aspect("equal")
    ax.axis("off")


def arrow(ax, start, end, color, rad):
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(
        arrowstyle="->", lw=1.6, shrinkA=13, shrinkB=13, color=color,
        connectionstyle=f"arc3,rad={rad}"))


def master_vs_ring_figure(path):
    """The seed's master scheme (Scatterv, Reduce, Bcast through rank 0) against the ring, with
    the bytes each rank sends per step for n bytes of gradients."""
    ring = ring_run()
    p = ring["p"]
    share = [e / p for e in ring["elements_sent"]]  # of the buffer (p one-element chunks)
    data = dict(p=p, master_root_sends=p - 1, master_worker_sends=1,
                ring_sends=[rounded(s) for s in share])
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.2))

    def circle(n, radius):  # n points clockwise from the top
        angle = np.pi / 2 - 2 * np.pi * np.arange(n) / n
        return radius * np.stack([np.cos(angle), np.sin(angle)], axis=1)

    star, ring_xy = np.vstack([[0, 0], circle(p - 1, 1.1)]), circle(p, 1.0)
    rank_nodes(axes[0], plt, star)
    rank_nodes(axes[1], plt, ring_xy)
    for r in range(1, p):
        arrow(axes[0], star[r], star[0], "#C44E52", 0.35)  # Reduce: gradients in
        arrow(axes[0], star[0], star[r], "#4C72B0", 0.35)  # Bcast: parameters out
    for r in range(p):
        arrow(axes[1], ring_xy[r], ring_xy[(r + 1) % p], "#55A868", -0.25)
    axes[0].set_title(f"master (--sync master): gradients in to rank 0 (Reduce, red),\n"
                      f"parameters out (Bcast, blue). Rank 0 receives and sends {p - 1} n;\n"
                      "a worker sends n: all traffic crosses rank 0", fontsize=9)
    axes[1].set_title(f"ring (--sync ring): each rank sends to its right neighbour only,\n"
                      f"2(P-1) = {2 * (p - 1)} messages of n/P: "
                      f"{' = '.join(sorted({f'{s:g} n' for s in share}))} per rank, "
                      "the same\non every rank (counted in a run of ring_allreduce)", fontsize=9)
    fig.suptitle(f"data-parallel gradient sum on P = {p} ranks, n bytes of gradients per rank",
                 fontsize=10, y=1.03)
    save(fig, path)
    return data


# ----------------------------------------------------------------------------- 3. Megatron MLP
def rule(cls):
    """The 'forward: ...' and 'backward: ...' lines of a class's docstring, first sentence."""
    lines = [line.strip() for line in cls.__doc__.splitlines()]
    return [re.split(r"[.,]", line)[0] for line in lines
            if line.startswith(("forward:", "backward:"))]


def megatron_lane(ax, plt, y, r, a_cols, b_rows, width):
    """One rank's row: X, its columns of A (of ``width``), GELU, its rows of B, partial Y."""
    (a0, a1), (b0, b1) = a_cols, b_rows
    for x, label in ((0, "X (whole)"), (14, "Y (whole)")):
        ax.add_patch(plt.Rectangle((x, y), 1, 1, color="#999999"))
        ax.text(x + 0.5, y - 0.25, label, ha="center", fontsize=8)
    ax.text(-0.2, y + 0.5, f"rank {r}", ha="right", va="center", fontsize=10)
    ax.add_patch(plt.Rectangle((3, y), 4, 1, fill=False))  # A: (h, 4h) drawn 4 x 1
    ax.add_patch(plt.Rectangle((3 + 4 * a0 / width, y), 4 * (a1 - a0) / width, 1,
                               color=RANK_COLORS[r]))
    ax.text(5, y - 0.25, f"A[:, {a0}:{a1}]  (column-parallel)", ha="center", fontsize=8)
    ax.text(7.9, y + 0.5, "GELU", ha="center", va="center", fontsize=8)
    ax.add_patch(plt.Rectangle((8.8, y - 0.5), 1, 2, fill=False))  # B: (4h, h) drawn 1 x 2
    ax.add_patch(plt.Rectangle((8.8, y + 1.5 - 2 * b1 / width), 1, 2 * (b1 - b0) / width,
                               color=RANK_COLORS[r]))
    ax.text(9.3, y - 0.8, f"B[{b0}:{b1}, :]  (row-parallel)", ha="center", fontsize=8)
    ax.text(10.7, y + 0.5, "partial\nY_r", ha="center", va="center", fontsize=8)
    for x0, x1 in ((1, 1.6), (2.4, 3), (7, 7.5), (8.3, 8.8), (9.8, 10.3), (11.1, 11.8),
                   (13.4, 14)):
        ax.annotate("", xy=(x1, y + 0.5), xytext=(x0, y + 0.5), arrowprops=dict(arrowstyle="->"))


def megatron_layout(t=2, h=8):
    """The columns of A (h, 4h) and rows of B (4h, h) each of t ranks holds, as the real
    layers pick them, and the forward/backward rules of f and g from their docstrings."""
    from mpipar.parts.tp_layers import (
        ColumnParallelLinear,
        CopyToTP,
        ReduceFromTP,
        RowParallelLinear,
    )

    groups = [SimpleNamespace(rank=r, size=t) for r in range(t)]
    cols = [ColumnParallelLinear(h, 4 * h, g).W.ranges[g.rank][0] for g in groups]
    rows = [RowParallelLinear(4 * h, h, g).W.ranges[g.rank][0] for g in groups]
    return dict(t=t, h=h, A_columns=cols, B_rows=rows, f=rule(CopyToTP), g=rule(ReduceFromTP))


def megatron_figure(path):
    """GELU(X A) B on t ranks: A column-parallel behind f, B row-parallel before g."""
    data = megatron_layout()
    t, h, cols, rows = data["t"], data["h"], data["A_columns"], data["B_rows"]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(13, 1.6 + 2.3 * t))
    lane = 2.6
    for r in range(t):
        megatron_lane(ax, plt, (t - 1 - r) * lane, r, cols[r], rows[r], 4 * h)
    for x, name, lines, color in ((2, "f", data["f"], "#55A868"),
                                  (12.6, "g", data["g"], "#C44E52")):
        ax.add_patch(plt.Rectangle((x - 0.4, -0.3), 0.8, lane * (t - 1) + 1.6, color=color,
                                   alpha=0.25))
        ax.text(x, lane * (t - 1) + 1.45, name, ha="center", fontsize=14, weight="bold")
        ax.text(x, -0.55, "\n".join(textwrap.fill(line, 30) for line in lines),
                ha="center", va="top", fontsize=8)
    ax.set_xlim(-1, 15.3)
    ax.set_ylim(-1.6, lane * (t - 1) + 1.9)
    ax.axis("off")
    ax.set_title(f"Megatron's MLP block GELU(X A) B on {t} ranks (h = {h}): each rank holds "
                 "one colour; nothing moves between f and g", fontsize=10)
    save(fig, path)
    return data


# ----------------------------------------------------------------------------- 4. vocab CE
def cross_entropy_run(t=3, vocab=9, target=4):
    """VocabParallelCrossEntropy's forward on one row of logits split over t stand-in ranks:
    the ranges, each Allreduce's parts and result, the loss, and the serial loss."""
    from mpipar.engine import nn
    from mpipar.parts.tp_layers import VocabParallelCrossEntropy, blocks

    logits = np.array([[1.0, -0.5, 2.0, 0.3, 1.2, 3.1, -1.0, 0.7, 1.6]])[:, :vocab]  # (1, V)
    targets = np.array([target])
    ranges = [r[0] for r in blocks(vocab, t)]
    group = ThreadRanks(t)
    losses = group.run(lambda comm: VocabParallelCrossEntropy(vocab, comm).forward(
        logits[:, slice(*ranges[comm.rank])], targets))
    serial = nn.SoftmaxCrossEntropy().forward(logits, targets)
    data = dict(logits=logits[0].tolist(), target=target, ranges=ranges,
                loss=rounded(losses[0]), serial_loss=rounded(serial),
                allreduces=[dict(op=a["op"], what=a["what"], result=rounded(a["result"][0]),
                                 parts=[rounded(q[0]) for q in a["parts"]])
                            for a in group.allreduces])
    return data


def cross_entropy_figure(path):
    """The row's logits by rank, then one panel per Allreduce: each rank's part, the result."""
    data = cross_entropy_run()
    logits, ranges, target, t = np.array(data["logits"]), data["ranges"], data["target"], \
        len(data["ranges"])
    vocab = len(logits)
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.9), gridspec_kw=dict(width_ratios=[2, 1, 1, 1]))
    ax = axes[0]
    for r, (a, b) in enumerate(ranges):
        ax.bar(range(a, b), logits[a:b], color=RANK_COLORS[r], label=f"rank {r}")
    ax.bar(target, logits[target], fill=False, hatch="//", ec="black", label="the target")
    ax.set_xticks(range(vocab))
    ax.set_xlabel("vocabulary column\n(after the MAX, every rank subtracts it: the target "
                  "logit and the exps\nbelow are of logit - max)", fontsize=8)
    ax.set_title(f"the logits of one row, split by vocabulary over {t} ranks", fontsize=9)
    ax.legend(fontsize=7)
    for ax, a in zip(axes[1:], data["allreduces"]):
        ax.bar(range(t), a["parts"], color=RANK_COLORS[:t])
        ax.bar(t + 0.5, a["result"], color="#555555")
        ax.axhline(0, color="black", lw=0.5)
        ax.set_xticks([*range(t), t + 0.5], [f"rank {r}" for r in range(t)] + [a["op"]],
                      fontsize=7)
        ax.set_title(f"Allreduce {a['op']}: {a['what'].split(': ')[-1]}\n= {a['result']:.4f}",
                     fontsize=9)
    fig.suptitle("vocabulary-parallel cross-entropy (tensor_parallel.VocabParallelCrossEntropy):"
                 " each rank reduces its columns, then three Allreduces of one number per row;\n"
                 f"loss = log(sum exp) - target logit = {data['loss']:.6f} (serial "
                 f"{data['serial_loss']:.6f})", fontsize=9)
    fig.tight_layout()
    save(fig, path)
    return data
