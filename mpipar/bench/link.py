"""The link between emulated hosts (mpipar.cluster), measured: a ping-pong across hosts beside
one within a host, and a data-parallel training step, at several bandwidths of the link.

    sudo python -m mpipar.bench.link               # link.csv in --out, every rate of --rates
    mpirun -n 4 python -m mpipar.bench.link --pingpong    # the ping-pong alone, on any mpirun

1. Ping-pong (``--pingpong``, under any mpirun, in an emulated cluster or on a real one): rank 0
   and the first other rank on its host, then rank 0 and the first rank on another host
   (``MPI.Get_processor_name`` tells hosts apart). 8 B (the latency alpha) and 1 MiB (the
   bandwidth 1/beta), one way = half a round trip, each round trip timed on its own: the
   median, and the least (what the path itself costs: other work on the machine only adds).
   Bare mpi4py ``Send``/``Recv`` of NumPy buffers: this measures the link, not mpipar.comm's
   bookkeeping (``python -m mpipar.bench net`` measures that). The ranks outside the pair
   wait in an ``Ibarrier`` polled with sleeps, so that they leave the cores to the pair.
2. A data-parallel step (hidden ``--worker dp``, 2 ranks, one per host): the MLP of
   :mod:`mpipar.bench.dp` (2.2 M parameters, 8.7 MB of float32 gradients, batch 1024), with
   one Allreduce after the backward (``--sync allreduce``) and with 2 MiB buckets whose
   Iallreduces start during the backward (``--bucket-mb 2 --overlap``). Per step the slowest
   rank's time and the exposed communication (the step's "sync" spans, mpipar.trace, the mean
   over ranks), for ``--rounds`` steps after one to warm up.
3. The driver: for each rate of ``--rates`` (none: no limit), a cluster of 2 emulated hosts
   with that link, 1. on 4 ranks (2 per host) and 2. on 2 ranks; ``--passes`` times over the
   rates, rate after rate, so that other work on the machine hits every rate alike. A table
   of medians (the steps of every pass pooled), link.csv with the load average, and link.png.
4. The prediction beside each step (:func:`predict_step`): compute + the ring allreduce's
   2(p-1) alpha + 2(p-1)/p n beta (:func:`mpipar.simulate.ring_allreduce_time`), alpha the
   across-hosts 8 B one-way median at that rate, beta its 1 MiB one-way median per byte. The
   compute is a step minus its exposed communication at the unlimited rate (the fastest
   measured when ``none`` is not among the rates), the least over the two ranks (the rank
   that waits least is the one the step waits for), per mode: a 1-rank step would have twice
   the rows per rank and none of the 2-rank step's MPI bookkeeping, and it would need a
   launch more. With overlap each bucket's Allreduce starts when it was posted at the
   unlimited rate (the step's own timeline, from the trace) or when the bucket before it is
   done, and the step waits for what is left after its backward ends. The error is
   predicted / measured - 1.

The emulated hosts share this machine's cores: the step times are those of 2 ranks on its
cores, and what the rates change is the link alone. Needs root (:func:`cluster.unavailable`).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from mpipar import cluster
from mpipar.bench.common import ONE_THREAD, bench_parser, environment, write_csv, wrote

SIZES = (8, 2**20)  # bytes: the latency, and a message long enough for the bandwidth
MODES = ("allreduce", "allreduce+overlap")  # of mpipar.bench.dp.MODES
PAIR = re.compile(r"rank 0 \((\S+)\) <-> rank (\d+) \((\S+)\), (same host|across hosts): +"
                  r"8 B +([\d.]+) us \(least ([\d.]+)\), 1 MiB +([\d.]+) ms \(least ([\d.]+)\)")


# ----------------------------------------------------------------------------- workers (mpirun)
def one_way(comm, partner, buf, trips):
    """Seconds one way (half the round trip) of each of ``trips`` round trips of ``buf``."""
    from mpi4py import MPI

    times = []
    for _ in range(trips):
        t0 = MPI.Wtime()
        if comm.rank == 0:
            comm.Send(buf, dest=partner)
            comm.Recv(buf, source=partner)
        else:
            comm.Recv(buf, source=0)
            comm.Send(buf, dest=0)
        times.append((MPI.Wtime() - t0) / 2)
    return times


def wait_sleeping(comm):
    """A barrier that sleeps while it waits: ranks outside a measured pair leave it the cores."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(1e-3)


def pingpong(repeats):
    """Rank 0 with the first other rank on its host, then with the first one on another host;
    rank 0 prints one line per pair (the format :data:`PAIR` reads)."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    names = comm.allgather(MPI.Get_processor_name())
    spec = json.loads(os.environ.get("MPIPAR_CLUSTER") or "null")
    if comm.rank == 0:
        link = cluster.format_rate(spec["bandwidth"]) if spec else "not an emulated cluster"
        print(f"ping-pong on {comm.size} ranks, one way (half a round trip): the median and the "
              f"least of {20 * repeats} round trips of 8 B and {repeats} of 1 MiB; link: {link}",
              flush=True)
    for where, same in (("same host", True), ("across hosts", False)):
        partners = [r for r in range(1, comm.size) if (names[r] == names[0]) == same]
        if not partners:
            continue
        partner = partners[0]
        if comm.rank in (0, partner):
            times = []
            for n in SIZES:
                buf = np.zeros(n, dtype=np.uint8)
                one_way(comm, partner, buf, 2)  # warm-up: the connection, the buffers
                times.append(one_way(comm, partner, buf, 20 * repeats if n < 2**16 else repeats))
            if comm.rank == 0:
                small, big = times
                bits = 8 * SIZES[1] / statistics.median(big)
                print(f"rank 0 ({names[0]}) <-> rank {partner} ({names[partner]}), {where}: "
                      f"8 B {statistics.median(small) * 1e6:7.1f} us (least "
                      f"{min(small) * 1e6:.1f}), 1 MiB {statistics.median(big) * 1e3:7.2f} ms "
                      f"(least {min(big) * 1e3:.2f}) = {cluster.format_rate(bits)}", flush=True)
        wait_sleeping(comm)


def dp_worker(rounds):
    """Time a data-parallel step of each of :data:`MODES`; rank 0 emits one result per mode."""
    from mpi4py import MPI

    from mpipar import comm as C
    from mpipar import serial
    from mpipar.bench import dp as bench_dp
    from mpipar.bench.common import emit
    from mpipar.cli import parse_args
    from mpipar.grid import Grid
    from mpipar.trace import TRACE
    from mpipar.train import trainer_class

    TRACE.calls = True  # the buckets' posting times are read from the MPI calls' spans
    C.install_excepthook()
    bench_dp.steady_heap()
    grid = Grid(dp=C.world().size)
    task = None
    for mode in MODES:
        args = parse_args("data_parallel", bench_dp.MODEL + bench_dp.MODES[mode], grid.dp_size)
        task = serial.Task(args, task and task.data)
        trainer = trainer_class("data_parallel", args)(task, grid, args)
        trainer.step(0)  # warm-up: the connections, the buffers, the caches
        samples = []
        for step in range(1, rounds + 1):
            grid.dp_comm.Barrier()
            TRACE.clear()
            t0 = MPI.Wtime()
            trainer.step(step)
            t = MPI.Wtime() - t0
            per_rank = grid.dp_comm.allgather_obj((t, *timeline(TRACE.events, t0)))
            samples.append((max(v[0] for v in per_rank), statistics.mean(v[1] for v in per_rank),
                            min(v[1] for v in per_rank), max(v[2] for v in per_rank),
                            [max(b) for b in zip(*(v[3] for v in per_rank))]))
        if grid.dp_comm.rank == 0:
            emit({"mode": mode, "samples": samples, "grad_bytes": trainer.flat.nbytes,
                  "buckets": [b.flat.nbytes for b in trainer.sync.buckets]})


def timeline(events, t0):
    """From one step's trace: its exposed communication (the "sync" spans), when the backward
    ended and when each gradient Allreduce was posted (seconds after ``t0``)."""
    sync = sum(e[1] - e[0] for e in events if e[2] == "sync")
    backward_end = max(e[1] for e in events if e[3] == "backward") - t0
    posted = [e[0] - t0 for e in events if e[2] == "comm" and e[3] == "Allreduce"]
    return sync, backward_end, posted


# ----------------------------------------------------------------------------- driver
def read_pairs(text):
    """{'same host' or 'across hosts': {"8 B", "8 B least", "1 MiB", "1 MiB least"}: seconds}
    from the lines --pingpong prints."""
    return {m[4]: dict(zip(("8 B", "8 B least", "1 MiB", "1 MiB least"),
                           (float(m[5]) * 1e-6, float(m[6]) * 1e-6, float(m[7]) * 1e-3,
                            float(m[8]) * 1e-3))) for m in PAIR.finditer(text)}


def launch(n, args, env):
    """Run this module on n ranks of the emulated cluster; its stdout."""
    line = cluster.mpiexec_line(2, ["-n", str(n), sys.executable, "-m", "mpipar.bench.link",
                                    *args])
    proc = subprocess.run(line, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise SystemExit(f"{' '.join(line)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def measure(bits, repeats, rounds):
    """The ping-pong and the data-parallel steps on 2 emulated hosts joined at ``bits``/s:
    ({where: times}, {mode: result})."""
    with cluster.Cluster(2, bits) as c:
        env = c.env(dict(os.environ, **ONE_THREAD))
        pairs = read_pairs(launch(4, ["--pingpong", "--repeats", str(repeats)], env))
        out = launch(2, ["--worker", "dp", "--rounds", str(rounds)], env)
    steps = {r["mode"]: r for r in (json.loads(line[7:]) for line in out.splitlines()
                                    if line.startswith("RESULT "))}
    return pairs, steps


def drive(rates, passes, repeats, rounds):
    """Every rate, ``passes`` times over (rate after rate, so that other work on the machine
    hits every rate alike); per rate the median of the ping-pongs' medians, the least of their
    least times, and the data-parallel steps pooled."""
    runs = {rate: [] for rate in rates}
    for _ in range(passes):
        for rate in rates:
            runs[rate].append(measure(cluster.parse_rate(rate), repeats, rounds))
    results = {}
    for rate, measured in runs.items():
        pairs = {where: {key: (min if "least" in key else statistics.median)(
                     p[where][key] for p, _ in measured) for key in measured[0][0][where]}
                 for where in measured[0][0]}
        steps = {mode: dict(measured[0][1][mode],
                            samples=[s for _, st in measured for s in st[mode]["samples"]])
                 for mode in MODES}
        results[rate] = pairs, steps
    return results


# ----------------------------------------------------------------------------- the prediction
def predict_step(compute, buckets, alpha, beta, backward_end=None, p=2):
    """A data-parallel step predicted from its compute and the link's alpha and beta.

    ``buckets``: (seconds after the step's start when its Allreduce is posted, bytes), in the
    order posted; each costs the ring formula (:func:`mpipar.simulate.ring_allreduce_time`),
    one after another, as they share the link. ``backward_end`` None (one Allreduce after the
    backward): compute + every bucket's time. Otherwise (overlap) a bucket starts when it is
    posted or when the one before it is done, whichever is later, and the step waits only
    for what is left after the backward ends: compute + max(0, last done - backward_end).
    """
    from mpipar.simulate import ring_allreduce_time

    if backward_end is None:
        return compute + sum(ring_allreduce_time(n, p, alpha, beta) for _, n in buckets)
    done = 0.0
    for posted, n in buckets:
        done = max(done, posted) + ring_allreduce_time(n, p, alpha, beta)
    return compute + max(0.0, done - backward_end)


def compute_rate(results):
    """The rate whose steps give the compute: no limit if measured, else the fastest."""
    return max(results, key=lambda rate: cluster.parse_rate(rate) or float("inf"))


def predictions(results):
    """{rate: {mode: (predicted seconds, compute seconds, that rate's own compute)}}:
    :func:`predict_step` with the compute and the overlap's timeline of :func:`compute_rate`'s
    steps and each rate's alpha (8 B across hosts, one way) and beta (1 MiB across hosts, one
    way, per byte). A rate's own compute (its steps less their exposed communication) is not
    used: it is kept to show when other work on the machine slowed that rate's steps."""
    base = results[compute_rate(results)][1]
    out = {}
    for rate, (pairs, steps) in results.items():
        alpha, beta = pairs["across hosts"]["8 B"], pairs["across hosts"]["1 MiB"] / SIZES[1]
        out[rate] = {}
        for m in MODES:
            samples = base[m]["samples"]
            compute = statistics.median(s[0] - s[2] for s in samples)
            if m == "allreduce":
                pred = predict_step(compute, [(0.0, steps[m]["grad_bytes"])], alpha, beta)
            else:
                posted = [statistics.median(t) for t in zip(*(s[4] for s in samples))]
                if len(posted) != len(base[m]["buckets"]):  # the trace missed some calls
                    raise SystemExit(f"{len(posted)} gradient Allreduces in the trace, "
                                     f"{len(base[m]['buckets'])} buckets")
                pred = predict_step(compute, list(zip(posted, base[m]["buckets"])), alpha, beta,
                                    statistics.median(s[3] for s in samples))
            own = statistics.median(s[0] - s[2] for s in steps[m]["samples"])
            out[rate][m] = pred, compute, own
    return out


def report(results, out):
    """The table, link.csv and link.png."""
    rows = []
    print(f"{'link':>10} {'8 B same host':>14} {'8 B across':>14} {'1 MiB across':>20}   "
          f"{'DP step':>8} {'exposed':>8} {'predicted':>16} {'+overlap':>9} {'exposed':>8} "
          f"{'predicted':>16}")
    print(f"{'':>10} {'median/least':>14} {'median/least':>14} {'median, its rate':>20}   "
          f"{'(median of the steps; predicted: and its error)':>78}")
    load = round(os.getloadavg()[0], 2)
    predicted = predictions(results)
    for rate, (pairs, steps) in results.items():
        same, across = pairs["same host"], pairs["across hosts"]
        step = {m: statistics.median(s[0] for s in steps[m]["samples"]) for m in MODES}
        exposed = {m: statistics.median(s[1] for s in steps[m]["samples"]) for m in MODES}
        pred = {m: predicted[rate][m][0] for m in MODES}
        print(f"{cluster.format_rate(cluster.parse_rate(rate)):>10} "
              + "".join(f"{p['8 B'] * 1e6:7.1f}/{p['8 B least'] * 1e6:<4.1f} us "
                        for p in (same, across))
              + f"{across['1 MiB'] * 1e3:7.2f} ms {8 * SIZES[1] / across['1 MiB'] / 1e9:5.2f} Gb/s "
              + "".join(f"{step[m] * 1e3:8.0f} ms {exposed[m] * 1e3:5.0f} ms "
                        f"{pred[m] * 1e3:7.0f} ms {100 * (pred[m] / step[m] - 1):+4.0f}% "
                        for m in MODES))
        for where, times in pairs.items():
            rows += [dict(environment(ranks=4), bench="link", bandwidth=rate, kind="pingpong",
                          where=where, bytes=n, seconds=times[key],
                          least_seconds=times[f"{key} least"], loadavg_1min=load)
                     for n, key in ((SIZES[0], "8 B"), (SIZES[1], "1 MiB"))]
        rows += [dict(environment(ranks=2), bench="link", bandwidth=rate, kind="dp",
                      where="across hosts", mode=m, bytes=steps[m]["grad_bytes"],
                      seconds=step[m], exposed_seconds=exposed[m],
                      least_seconds=min(s[0] for s in steps[m]["samples"]),
                      most_seconds=max(s[0] for s in steps[m]["samples"]),
                      predicted_seconds=pred[m], prediction_error=pred[m] / step[m] - 1,
                      compute_seconds=predicted[rate][m][1], compute_from=compute_rate(results),
                      compute_here_seconds=predicted[rate][m][2],
                      alpha_seconds=across["8 B"], beta_seconds_per_byte=across["1 MiB"] / SIZES[1],
                      samples=len(steps[m]["samples"]), loadavg_1min=load) for m in MODES]
    path = write_csv("link.csv", rows, out)
    wrote(path, plot(rows, path.with_suffix(".png")))


def plot(rows, path):
    """Step time against the link's rate: the measured step of each mode as a bar, its exposed
    communication shaded, the prediction as a line over it."""
    from mpipar.bench.common import pyplot, save_figure

    plt = pyplot()
    dp = [r for r in rows if r["kind"] == "dp"]
    rates = sorted(dict.fromkeys(r["bandwidth"] for r in dp),
                   key=lambda rate: -(cluster.parse_rate(rate) or float("inf")))
    fig, ax = plt.subplots(figsize=(8, 4.4))
    width = 0.38
    for j, mode in enumerate(MODES):
        at = {r["bandwidth"]: r for r in dp if r["mode"] == mode}
        xs = [i + (j - 0.5) * width for i in range(len(rates))]
        step = [at[rate]["seconds"] * 1e3 for rate in rates]
        bars = ax.bar(xs, step, width, label=f"{mode}: measured step", alpha=0.75)
        color = bars.patches[0].get_facecolor()
        ax.bar(xs, [at[rate]["exposed_seconds"] * 1e3 for rate in rates], width, fill=False,
               hatch="//", edgecolor="black", lw=0, label="exposed communication" if j else None)
        ax.plot(xs, [at[rate]["predicted_seconds"] * 1e3 for rate in rates], "o-", ms=5,
                color=color[:3], markeredgecolor="black", label=f"{mode}: predicted")
        for x, rate in zip(xs, rates):
            ax.annotate(f"{100 * at[rate]['prediction_error']:+.0f}%",
                        (x, at[rate]["predicted_seconds"] * 1e3), fontsize=7, ha="center",
                        xytext=(0, 6), textcoords="offset points")
    ax.set_xticks(range(len(rates)))
    ax.set_xticklabels([cluster.format_rate(cluster.parse_rate(rate)) for rate in rates])
    ax.set_xlabel("link between the 2 emulated hosts")
    ax.set_ylabel("data-parallel step (ms), 2 ranks")
    ax.set_title(f"DP step of the {dp[0]['bytes'] / 1e6:.1f} MB-gradient MLP across an emulated "
                 f"link (load {dp[0]['loadavg_1min']:.1f}); error = predicted/measured - 1",
                 fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, path)


def main(argv=None):
    ap = bench_parser("link", "two rates, one pass, fewer repeats and steps", worker=False)
    ap.prog = "python -m mpipar.bench.link"
    ap.sized("--rates", "none,10gbit,1gbit,100mbit", "1gbit,100mbit",
             help="link rates to measure, as tc writes them (none: no limit)")
    ap.sized("--passes", 3, 1, type=int, help="times over every rate")
    ap.sized("--repeats", 9, 3, type=int,
             help="timed round trips of 1 MiB per pair (of 8 B: 20 times as many)")
    ap.sized("--rounds", 5, 2, type=int, help="timed data-parallel steps per mode and pass")
    ap.add_argument("--pingpong", action="store_true",
                    help="only the ping-pong, on the ranks of this mpirun (2 or more)")
    ap.add_argument("--worker", choices=["dp"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.pingpong:
        return pingpong(args.repeats)
    if args.worker:
        return dp_worker(args.rounds)
    reason = cluster.unavailable()
    if reason:
        raise SystemExit(f"cannot emulate hosts: {reason}")
    rates = args.rates.split(",")
    for rate in rates:
        cluster.parse_rate(rate, "--rates")  # refuse a bad one before measuring anything
    report(drive(rates, args.passes, args.repeats, args.rounds), args.out)


if __name__ == "__main__":
    main()
