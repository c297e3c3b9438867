"""What the project's layers cost against the bare calls, at the sizes learners run.

    python -m mpipar.tools.bench overhead       # overhead.csv and overhead.png in --out

- The comm wrapper (as the grid hands it out, :func:`mpipar.mpi.direct.communicator`: checks,
  counts, trace, waits) against raw mpi4py for a ping-pong between 2 ranks, 8 bytes and 1 MiB:
  one-way time, wrapper / raw.
  Targets: at most 1.3x for 8 bytes, 1.05x for 1 MiB.
- The autograd engine (:mod:`mpipar.engine.nn`) against the same MLP step in bare NumPy
  (:func:`mpipar.tools.bench.engine.bare_step`) at 16, 32 and 128 rows, the micro-batch sizes of the
  lessons: engine / bare. Target: at most 1.15 at each.

Both sides of each ratio run alternately in the same process, round after round, so a slow
spell of the machine slows both; each figure is the median over the rounds, with the range of
the per-round ratios. A ping-pong round times BURSTS short bursts of round trips of each side,
alternating, and takes each side's fastest burst: two ranks on two cores share them with the
machine's other work, and a rank descheduled for a moment spoils the burst it falls in, not
the round (with one long burst per side, the 8-byte ratio ranged from 1.16 to 1.91 within
one run). The engine's steps run on one thread and are timed in the process's CPU
time (``time.process_time``), one engine call and one bare call in turn: on a shared machine
the wall clock also counts the time other work holds the core, which falls on one side or the
other at random; on an idle core the two clocks agree.
"""

import statistics
import time

import numpy as np

from mpipar.tools.bench.common import (
    bench_parser,
    emit,
    environment,
    number,
    pyplot,
    run_ranks,
    save_figure,
    write_csv,
    wrote,
)

SIZES = (8, 1 << 20)  # bytes of a ping-pong message
BURSTS = 10  # short bursts of round trips per side and round
ROWS = (16, 32, 128)  # rows of an engine step
TARGETS = {"comm": {8: 1.3, 1 << 20: 1.05}, "engine": 1.15}


def pingpong(send, recv, buf, peer, first, iters):
    """Seconds of one one-way message, averaged over ``iters`` round trips."""
    t0 = time.perf_counter()
    for _ in range(iters):
        if first:
            send(buf, peer)
            recv(buf, peer)
        else:
            recv(buf, peer)
            send(buf, peer)
    return (time.perf_counter() - t0) / (2 * iters)


def worker(rounds):
    from mpi4py import MPI

    from mpipar.mpi import comm as C
    from mpipar.mpi import direct

    C.install_excepthook()
    C.choose_wait()  # as the runner does: how a rank waits on this machine
    w, raw = direct.world(), MPI.COMM_WORLD  # what the grid gives this rank
    peer, first = 1 - w.rank, w.rank == 0
    for n in SIZES:
        buf = np.zeros(n, dtype=np.uint8)
        iters = 40 if n < 1 << 16 else 4  # round trips in one burst: 0.2 ms, or 1.2 ms
        ratios, times = [], {"wrapper": [], "raw": []}
        for _ in range(rounds + 1):  # the first round warms up
            bursts = {"raw": [], "wrapper": []}
            for _ in range(BURSTS):  # alternating; each side's fastest burst is its time
                raw.Barrier()
                bursts["raw"].append(pingpong(lambda b, p: raw.Send(b, p),
                                              lambda b, p: raw.Recv(b, p), buf, peer, first,
                                              iters))
                raw.Barrier()
                bursts["wrapper"].append(pingpong(w.Send, w.Recv, buf, peer, first, iters))
            t_raw, t_wrap = min(bursts["raw"]), min(bursts["wrapper"])
            times["raw"].append(t_raw)
            times["wrapper"].append(t_wrap)
            ratios.append(t_wrap / t_raw)
        if first:
            emit(dict(what="comm", size=n, base_s=statistics.median(times["raw"][1:]),
                      mine_s=statistics.median(times["wrapper"][1:]), ratios=ratios[1:]))


def engine_ratios(rows, rounds, calls=40):
    """(engine seconds, bare seconds, per-round ratios) of one MLP step at ``rows`` rows."""
    from mpipar.engine import backend as B
    from mpipar.engine import nn, optim
    from mpipar.tools.bench.engine import SIZES as WIDTHS
    from mpipar.tools.bench.engine import bare_step, engine_step

    B.use("numpy", "float32")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, WIDTHS[0])).astype(np.float32)
    y = rng.integers(0, WIDTHS[-1], rows)
    model = nn.MLP(WIDTHS).init(0)
    opt, loss_fn = optim.SGD(model.parameters(), lr=1e-3), nn.SoftmaxCrossEntropy()
    Ws = [p.data.copy() for name, p in model.named_parameters() if name.endswith("W")]
    bs = [p.data.copy() for name, p in model.named_parameters() if name.endswith("b")]
    clock = time.process_time  # CPU time: one thread computes (see the module docstring)
    mine, base, ratios = [], [], []
    for _ in range(rounds + 1):
        t_mine = t_base = 0.0
        for _ in range(calls):  # one call of each in turn
            t0 = clock()
            engine_step(model, loss_fn, opt, x, y)
            t1 = clock()
            bare_step(Ws, bs, x, y, 1e-3)
            t_mine, t_base = t_mine + t1 - t0, t_base + clock() - t1
        mine.append(t_mine / calls)
        base.append(t_base / calls)
        ratios.append(mine[-1] / base[-1])
    return statistics.median(mine[1:]), statistics.median(base[1:]), ratios[1:]


def plot(rows, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels = [r["case"] for r in rows]
    ratio = [float(r["ratio"]) for r in rows]
    low = [ratio[i] - float(r["ratio_min"]) for i, r in enumerate(rows)]
    high = [float(r["ratio_max"]) - ratio[i] for i, r in enumerate(rows)]
    ax.barh(labels, ratio, xerr=[low, high], color="#4C72B0", capsize=3)
    for i, r in enumerate(rows):
        ax.plot([float(r["target"])] * 2, [i - 0.4, i + 0.4], color="black", lw=1.5)
    ax.axvline(1.0, color="#999999", lw=0.8)
    ax.set_xlabel("time against the bare call (median; bars: range over rounds; tick: target)")
    ax.set_title("The project's layers against bare mpi4py and bare NumPy")
    ax.invert_yaxis()
    return save_figure(fig, path)


def main(argv=None):
    ap = bench_parser("overhead")
    ap.sized("--rounds", 15, 5, type=number(), help="alternating rounds per case (median)")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.rounds)
        return
    found = []
    for res in run_ranks(2, "mpipar.tools.bench.overhead", ["--worker", "--rounds", args.rounds]):
        n = res["size"]
        found.append((f"Send/Recv {'8 B' if n == 8 else '1 MiB'}", res["base_s"], res["mine_s"],
                      res["ratios"], TARGETS["comm"][n]))
    for rows in ROWS:
        mine, base, ratios = engine_ratios(rows, args.rounds)
        found.append((f"MLP step, {rows} rows", base, mine, ratios, TARGETS["engine"]))
    table = [dict(environment(2 if case.startswith("Send") else 1), bench="overhead", case=case,
                  base_ms=round(base * 1e3, 5), mine_ms=round(mine * 1e3, 5),
                  ratio=round(statistics.median(ratios), 3), ratio_min=round(min(ratios), 3),
                  ratio_max=round(max(ratios), 3), target=target,
                  met=statistics.median(ratios) <= target, rounds=len(ratios))
             for case, base, mine, ratios, target in found]
    path = write_csv("overhead.csv", table, args.out)
    for r in table:
        print(f"{r['case']:<20} {r['mine_ms']:10.4f} ms against {r['base_ms']:10.4f} ms: "
              f"{r['ratio']:.2f}x ({r['ratio_min']:.2f}..{r['ratio_max']:.2f}), target "
              f"{r['target']}: {'met' if r['met'] else 'NOT met'}")
    wrote(path, plot(table, args.out / "overhead.png"))


if __name__ == "__main__":
    main()
