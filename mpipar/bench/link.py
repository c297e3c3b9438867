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
   of medians (the steps of every pass pooled), and link.csv with the load average.

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
            sync = sum(e[1] - e[0] for e in TRACE.events if e[2] == "sync")
            per_rank = grid.dp_comm.allgather_obj((t, sync))
            samples.append((max(v[0] for v in per_rank), statistics.mean(v[1] for v in per_rank)))
        if grid.dp_comm.rank == 0:
            emit({"mode": mode, "samples": samples, "grad_bytes": trainer.flat.nbytes})


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
        steps = {mode: {"samples": [s for _, st in measured for s in st[mode]["samples"]],
                        "grad_bytes": measured[0][1][mode]["grad_bytes"]} for mode in MODES}
        results[rate] = pairs, steps
    return results


def report(results, out):
    """The table, and link.csv."""
    rows = []
    print(f"{'link':>10} {'8 B same host':>14} {'8 B across':>14} {'1 MiB across':>20}   "
          f"{'DP step':>8} {'exposed':>8} {'+overlap':>9} {'exposed':>8}")
    print(f"{'':>10} {'median/least':>14} {'median/least':>14} {'median, its rate':>20}   "
          f"{'(median of the steps)':>37}")
    load = round(os.getloadavg()[0], 2)
    for rate, (pairs, steps) in results.items():
        same, across = pairs["same host"], pairs["across hosts"]
        step = {m: statistics.median(s[0] for s in steps[m]["samples"]) for m in MODES}
        exposed = {m: statistics.median(s[1] for s in steps[m]["samples"]) for m in MODES}
        print(f"{cluster.format_rate(cluster.parse_rate(rate)):>10} "
              + "".join(f"{p['8 B'] * 1e6:7.1f}/{p['8 B least'] * 1e6:<4.1f} us "
                        for p in (same, across))
              + f"{across['1 MiB'] * 1e3:7.2f} ms {8 * SIZES[1] / across['1 MiB'] / 1e9:5.2f} Gb/s "
              + "".join(f"{step[m] * 1e3:8.0f} ms {exposed[m] * 1e3:5.0f} ms" for m in MODES))
        for where, times in pairs.items():
            rows += [dict(environment(ranks=4), bench="link", bandwidth=rate, kind="pingpong",
                          where=where, bytes=n, seconds=times[key],
                          least_seconds=times[f"{key} least"], loadavg_1min=load)
                     for n, key in ((SIZES[0], "8 B"), (SIZES[1], "1 MiB"))]
        rows += [dict(environment(ranks=2), bench="link", bandwidth=rate, kind="dp",
                      where="across hosts", mode=m, bytes=steps[m]["grad_bytes"],
                      seconds=step[m], exposed_seconds=exposed[m],
                      samples=len(steps[m]["samples"]), loadavg_1min=load) for m in MODES]
    wrote(write_csv("link.csv", rows, out))


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
