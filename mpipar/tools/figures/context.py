"""The picture of ring attention: which (query chunk, key chunk) pairs each rank computes at
each step of the ring, for the plain layout and the zigzag. It runs the real layer,
:class:`mpipar.context_parallel.RingAttention`, on stand-in ranks
(:class:`~mpipar.tools.figures.draw.ThreadRanks`), checks its output against the serial
attention core, and draws the pairs the layer's own :func:`~mpipar.context_parallel.pairs`
chose at each step."""

import numpy as np

from mpipar.tools.figures.draw import RANK_COLORS, ThreadRanks, pyplot, rounded, save


def ring_run(algo, g=4, seq_len=16, heads=2, width=8, seed=0):
    """RingAttention's forward over ``seq_len`` tokens on g stand-in ranks with ``algo``'s
    layout. Returns each rank's chunks, per ring step the source of its keys and the pairs
    computed ((i, j, "full" or "diagonal") over the two ranks' chunk lists), each rank's work
    in pairs of the zigzag's chunks of T/(2G) tokens (a diagonal counted as half, a ring's
    chunk pair as 4), and the largest difference between the output and the serial core's."""
    from mpipar import context_parallel as X
    from mpipar.engine import nn

    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((1, seq_len, 3 * width))  # (B, T, 3C): every token's q, k, v
    serial = nn.CausalSelfAttention(width, heads)
    want = serial.attend(qkv, 0)

    def body(comm):
        layer = X.RingAttention(width, heads, comm, algo)
        held = X.positions(comm.rank, g, algo, seq_len)
        return held, layer.attend(np.ascontiguousarray(qkv[:, held]), 0)

    runs = ThreadRanks(g).run(body)
    error = max(float(np.abs(out - want[:, held]).max()) for held, out in runs)
    steps, work = [], []
    unit = (2 * g // X.chunks_of(0, g, algo)[1]) ** 2  # a chunk pair in zigzag chunk pairs
    for r in range(g):
        mine, _ = X.chunks_of(r, g, algo)
        row = []
        for j in range(g):
            source = (r - j) % g
            theirs, _ = X.chunks_of(source, g, algo)
            row.append(dict(source=source, pairs=[(i, jj, "diagonal" if c else "full")
                                                  for i, jj, c in X.pairs(mine, theirs)]))
        steps.append(row)
        work.append(unit * sum(0.5 if kind == "diagonal" else 1.0
                               for cell in row for _, _, kind in cell["pairs"]))
    return dict(algo=algo, g=g, chunks=[X.chunks_of(r, g, algo)[0] for r in range(g)],
                steps=steps, work=work, serial_error=rounded(error),
                balance=rounded(sum(work) / len(work) / max(work)))


def ring_panel(ax, plt, data):
    g = data["g"]
    for r in range(g):
        mine = data["chunks"][r]
        for j, cell in enumerate(data["steps"][r]):
            theirs = data["chunks"][cell["source"]]
            rows, cols = len(mine), len(theirs)
            w, h = 0.9 / cols, 0.8 / rows
            done = {(i, jj): kind for i, jj, kind in cell["pairs"]}
            for i in range(rows):
                for jj in range(cols):
                    x, y = j + jj * w, r + i * h
                    kind = done.get((i, jj))
                    ax.add_patch(plt.Rectangle((x, y), w, h, facecolor="white",
                                               edgecolor="#999999", linewidth=0.5))
                    color = RANK_COLORS[cell["source"]]
                    if kind == "full":
                        ax.add_patch(plt.Rectangle((x, y), w, h, facecolor=color))
                    elif kind == "diagonal":  # keys up to the query: the lower triangle
                        ax.add_patch(plt.Polygon([(x, y), (x, y + h), (x + w, y + h)],
                                                 facecolor=color))
                    ax.text(x + w / 2, y + h / 2, f"q{mine[i]}\nk{theirs[jj]}", ha="center",
                            va="center", fontsize=6,
                            color={"full": "white", "diagonal": "#222222"}.get(kind, "#AAAAAA"))
        ax.text(-0.1, r + 0.4, f"rank {r}\nchunks {mine}", ha="right", va="center", fontsize=8,
                color=RANK_COLORS[r])
        ax.text(g + 0.05, r + 0.4, f"{data['work'][r]:g}", ha="left", va="center", fontsize=9)
    for j in range(g):
        ax.text(j + 0.45, -0.15, f"step {j}", ha="center", va="bottom", fontsize=8)
    ax.text(g + 0.05, -0.15, "work", ha="left", va="bottom", fontsize=8)
    ax.set_xlim(-1.3, g + 0.6)
    ax.set_ylim(g + 0.1, -0.6)
    ax.axis("off")
    off = f"{data['serial_error']:g}" if data["serial_error"] else "less than 1e-6"
    ax.set_title(f"--cp-algo {data['algo']}: work's mean over the busiest "
                 f"{data['balance']:.3f}; the output off the serial core's by {off}", fontsize=9)


def ring_figure(path):
    data = [ring_run("ring"), ring_run("zigzag")]
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.2))
    for ax, d in zip(axes, data):
        ring_panel(ax, plt, d)
    fig.suptitle("ring attention on 4 stand-in ranks: at step j a rank holds the keys and values "
                 "of the rank j before it (colour); filled: the (query chunk, key chunk) pairs "
                 "it attends; a triangle: the causal diagonal;\nblank: key chunks after every "
                 "query, skipped. work: what a rank computes, in pairs of T/(2G)-token chunks, "
                 "a diagonal counted as half",
                 fontsize=9)
    fig.tight_layout()
    save(fig, path)
    return data
