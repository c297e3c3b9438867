"""The link between emulated hosts (mpipar.tools.cluster), measured: a ping-pong across hosts beside
one within a host, and the training steps of data, tensor and pipeline parallelism across it,
at several bandwidths of the link.

    sudo python -m mpipar.tools.bench.link               # link.csv in --out, every rate of --rates
    mpirun -n 4 python -m mpipar.tools.bench.link --pingpong    # the ping-pong alone, on any mpirun

1. Ping-pong (``--pingpong``, under any mpirun, in an emulated cluster or on a real one): rank 0
   and the first other rank on its host, then rank 0 and the first rank on another host
   (``MPI.Get_processor_name`` tells hosts apart). 8 B (the latency alpha), 1 MiB and 4 MiB
   (the bandwidth 1/beta: several bursts of the token bucket, :func:`alpha_beta`), one way =
   half a round trip, each round trip timed on its own: the median, and the least (what the
   path itself costs: other work on the machine only adds).
   Bare mpi4py ``Send``/``Recv`` of NumPy buffers: this measures the link, not mpipar.mpi.comm's
   bookkeeping (``python -m mpipar.tools.bench net`` measures that). The ranks outside the pair
   wait in an ``Ibarrier`` polled with sleeps, so that they leave the cores to the pair.
2. The steps (hidden ``--worker dp``, 2 ranks, one per host): a data-parallel step: the MLP of
   :mod:`mpipar.tools.bench.dp` (2.2 M parameters, 8.7 MB of float32 gradients, batch 1024), with
   one Allreduce after the backward (``--sync allreduce``) and with 2 MiB buckets whose
   Iallreduces start during the backward (``--bucket-mb 2 --overlap``). Per step the slowest
   rank's time and the exposed communication (the step's "sync" spans, mpipar.mpi.trace, the mean
   over ranks), for ``--rounds`` steps after one to warm up. Then, in the same launch (the
   second table), the seed's master sync (Reduce to rank 0 + Bcast) and the hand-written ring
   on the same MLP, a tensor-parallel step of a GPT (2 ranks, one per host: every Allreduce
   crosses the link) and a 2-stage 1F1B pipeline of a GPT (:data:`SCHEMES`), each built from
   its flags as the runner builds it; the MPI calls' spans and bytes come from the trace
   (``TRACE.calls``), the pipeline's forward and backward from its instructions' spans.
3. The driver: for each rate of ``--rates`` (none: no limit), a cluster of 2 emulated hosts
   with that link, 1. on 4 ranks (2 per host) and 2. on 2 ranks; ``--passes`` times over the
   rates, rate after rate, so that other work on the machine hits every rate alike. A table
   of medians (the steps of every pass pooled), link.csv with the load average, and link.png.
4. The prediction beside each step (:func:`predict_step`): compute + the ring allreduce's
   2(p-1) alpha + 2(p-1)/p n beta (:func:`mpipar.tools.hardware.ring_allreduce_time`), alpha the
   across-hosts 8 B one-way median at that rate, beta its 4 MiB one-way median per byte. The
   compute is that rate's steps less their exposed communication, the least over the two
   ranks (the rank that waits least is the one the step waits for), per mode: the link
   changes only the communication, while other work on the machine moves the compute from
   rate to rate, so what is predicted is the communication (the unlimited rate's compute is
   kept beside it in link.csv). With overlap each bucket's Allreduce starts when it was
   posted (the step's own timeline, from the trace) or when the bucket before it is done,
   and the step waits for what is left after its backward ends. The error is predicted /
   measured - 1. The second table's (lessons/formulas.md#collectives): master and ring,
   :func:`predict_sync`; tensor parallelism, :func:`predict_tp` (the step less its MPI time
   + each traced Allreduce at the ring formula); the pipeline, :func:`predict_pp` (the
   schedule replayed by :func:`mpipar.parts.schedules.simulate` with that rate's stage times and
   alpha + n beta per message, plus what the unlimited rate's step does outside it).
5. The speedup of every step over the serial trainer's on the same model and batch (hidden
   ``--worker serial``, one process outside the cluster, once per pass).

The emulated hosts share this machine's cores: the step times are those of 2 ranks on its
cores, and what the rates change is the link alone. Needs root (:func:`cluster.unavailable`).
"""

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import time

from mpipar.tools import cluster
from mpipar.tools.bench.common import (
    ONE_THREAD,
    bench_parser,
    emitted,
    environment,
    number,
    run_ranks,
    write_csv,
    wrote,
)

SIZES = (8, 2**20, 2**22)  # bytes: the latency; 1 MiB; 4 MiB, several token-bucket bursts
BETA = 2**22  # the message whose time per byte is the link's beta (:func:`alpha_beta`)
MODES = ("allreduce", "allreduce+overlap")  # of mpipar.tools.bench.dp.MODES: lesson 9's table
# the other sync modes of mpipar.tools.bench.dp.MODES, in the second table
SYNC = ("master", "ring")
SCHEMES = {  # the flags of each scheme's step across the link (2 ranks, one per host)
    "tensor_parallel": ["--model", "gpt", "--d-model", "256", "--n-layers", "2", "--seq-len",
                        "64", "--batch-size", "8", "--dtype", "float32", "--quiet"],
    "pipeline": ["--model", "gpt", "--d-model", "256", "--n-layers", "2", "--seq-len", "64",
                 "--batch-size", "16", "--micro-batches", "4", "--schedule", "1f1b",
                 "--dtype", "float32", "--timeline", "none", "--quiet"],
}
NOT_SERIAL = {"--micro-batches", "--schedule", "--timeline"}  # pipeline flags; each takes a value


def serial_flags(scheme):
    """The serial trainer's flags for the same model and batch as a scheme's step."""
    from mpipar.tools.bench import dp as bench_dp

    if scheme == "data_parallel":
        return list(bench_dp.MODEL)
    flags = SCHEMES[scheme]
    return [f for i, f in enumerate(flags)
            if f not in NOT_SERIAL and (i == 0 or flags[i - 1] not in NOT_SERIAL)]


PAIR = re.compile(r"rank 0 \((\S+)\) <-> rank (\d+) \((\S+)\), (same host|across hosts): +"
                  r"8 B +([\d.]+) us \(least ([\d.]+)\), 1 MiB +([\d.]+) ms \(least ([\d.]+)\)"
                  r", 4 MiB +([\d.]+) ms \(least ([\d.]+)\)")
KEYS = ("8 B", "1 MiB", "4 MiB")  # the names of SIZES in the lines PAIR reads


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

    from mpipar.mpi import comm as C

    spec = cluster.spec_from_env(C.refuse)  # a bad one: refused on every rank, said once
    comm = MPI.COMM_WORLD
    names = comm.allgather(MPI.Get_processor_name())
    if comm.rank == 0:
        link = cluster.format_rate(spec["bandwidth"]) if spec else "not an emulated cluster"
        print(f"ping-pong on {comm.size} ranks, one way (half a round trip): the median and the "
              f"least of {20 * repeats} round trips of 8 B and {repeats} of 1 MiB and of 4 MiB; "
              f"link: {link}",
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
                small, mib, big = times
                bits = 8 * BETA / statistics.median(big)
                print(f"rank 0 ({names[0]}) <-> rank {partner} ({names[partner]}), {where}: "
                      f"8 B {statistics.median(small) * 1e6:7.1f} us (least "
                      f"{min(small) * 1e6:.1f}), 1 MiB {statistics.median(mib) * 1e3:7.2f} ms "
                      f"(least {min(mib) * 1e3:.2f}), 4 MiB {statistics.median(big) * 1e3:7.2f} "
                      f"ms (least {min(big) * 1e3:.2f}) = {cluster.format_rate(bits)}",
                      flush=True)
        wait_sleeping(comm)


def dp_worker(rounds):
    """Time a data-parallel step of each of :data:`MODES` and :data:`SYNC`, then the steps of
    :data:`SCHEMES` (:func:`scheme_steps`, in the same launch); rank 0 emits one result per
    mode and scheme."""
    from mpi4py import MPI

    from mpipar import serial
    from mpipar.engine import backend as B
    from mpipar.mpi import comm as C
    from mpipar.mpi.grid import Grid
    from mpipar.mpi.trace import TRACE
    from mpipar.runner.cli import parse_args
    from mpipar.tools.bench import dp as bench_dp
    from mpipar.tools.bench.common import emit
    from mpipar.train import trainer_class

    TRACE.calls = True  # the buckets' posting times are read from the MPI calls' spans
    C.install_excepthook()
    B.steady_heap()
    grid = Grid(dp=C.world().size)
    task = None
    for mode in MODES + SYNC:
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
                  "buckets": [b.flat.nbytes for b in getattr(getattr(trainer, "sync", None),
                                                               "buckets", [])]})
    for scheme in SCHEMES:
        scheme_steps(scheme, rounds)


def scheme_steps(scheme, rounds):
    """Time a tensor-parallel or pipeline step (:data:`SCHEMES`) on the 2 ranks; rank 0 emits
    per step the slowest rank's time, each rank's MPI time (the "comm" spans: for the pipeline
    its receives and the final waits on its sends) and, from rank 0's first timed step, every
    MPI call's (op, bytes); for the pipeline also each stage's forward and backward spans."""
    from mpi4py import MPI

    from mpipar import serial
    from mpipar.mpi import comm as C
    from mpipar.mpi.grid import Grid
    from mpipar.mpi.trace import TRACE
    from mpipar.runner.cli import parse_args
    from mpipar.tools.bench.common import emit
    from mpipar.train import trainer_class

    args = parse_args(scheme, SCHEMES[scheme], C.world().size)
    grid = Grid(tp=2) if scheme == "tensor_parallel" else Grid(pp=2)
    world = grid.world
    trainer = trainer_class(scheme, args)(serial.Task(args), grid, args)
    trainer.step(0)  # warm-up: the connections, the buffers, the caches
    samples, calls, stages = [], None, None
    for step in range(1, rounds + 1):
        world.Barrier()
        TRACE.clear()
        t0 = MPI.Wtime()
        trainer.step(step)
        t = MPI.Wtime() - t0
        mine = [e for e in TRACE.events if e[2] == "comm"]
        spans = {k: [e[1] - e[0] for e in TRACE.events if e[2] == k]
                 for k in ("forward", "backward")}
        per_rank = world.allgather_obj((t, sum(e[1] - e[0] for e in mine),
                                        [(e[3], e[4]["bytes"]) for e in mine], spans))
        samples.append((max(v[0] for v in per_rank), [v[1] for v in per_rank]))
        calls = calls or [v[2] for v in per_rank]
        stages = [v[3] for v in per_rank] if stages is None else [
            {k: old[k] + new[k] for k in old} for old, new in zip(stages, (v[3] for v in per_rank))]
    if world.rank == 0:
        emit({"mode": scheme, "samples": samples, "calls": calls, "stages": stages,
              "micro_batches": args.micro_batches})


def serial_worker(rounds):
    """One process: the serial trainer's step on the same model and batch as each scheme's
    (data parallelism's MLP, the tensor-parallel and the pipeline GPT), the median of
    ``rounds`` steps after one to warm up: the 1-rank step a speedup divides."""
    from mpipar import serial
    from mpipar.runner.cli import parse_args
    from mpipar.tools.bench.common import emit

    for scheme in ("data_parallel", *SCHEMES):
        args = parse_args("serial", serial_flags(scheme), 1)
        trainer = serial.Serial(serial.Task(args), None, args)
        trainer.step(0)
        times = []
        for step in range(1, rounds + 1):
            t0 = time.perf_counter()
            trainer.step(step)
            times.append(time.perf_counter() - t0)
        emit({"mode": scheme, "seconds": statistics.median(times)})


def timeline(events, t0):
    """From one step's trace: its exposed communication (the "sync" spans), when the backward
    ended and when each gradient Allreduce was posted (seconds after ``t0``)."""
    sync = sum(e[1] - e[0] for e in events if e[2] == "sync")
    backward_end = max(e[1] for e in events if e[3] == "backward") - t0
    posted = [e[0] - t0 for e in events if e[2] == "comm" and e[3] == "Allreduce"]
    return sync, backward_end, posted


# ----------------------------------------------------------------------------- driver
def read_pairs(text):
    """{'same host' or 'across hosts': {"8 B", "8 B least", "1 MiB", ..., "4 MiB least"}:
    seconds} from the lines --pingpong prints."""
    names = [f"{k}{least}" for k in KEYS for least in ("", " least")]
    return {m[4]: {name: float(v) * (1e-6 if name.startswith("8 B") else 1e-3)
                   for name, v in zip(names, m.groups()[4:])} for m in PAIR.finditer(text)}


def launch(n, args, env):
    """Run this module on n ranks of the emulated cluster; its stdout."""
    line = cluster.mpiexec_line(2, ["-n", str(n), sys.executable, "-m", "mpipar.tools.bench.link",
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
    return pairs, {r["mode"]: r for r in emitted(out)}


def serial_steps(rounds):
    """{scheme: the serial trainer's step on its model and batch} (:func:`serial_worker`, one
    process on this machine: no link)."""
    return {r["mode"]: r["seconds"] for r in run_ranks(1, "mpipar.tools.bench.link", [
        "--worker", "serial", "--rounds", rounds])}


def drive(rates, passes, repeats, rounds):
    """Every rate, ``passes`` times over (rate after rate, so that other work on the machine
    hits every rate alike), after the serial steps of each pass; per rate the median of the
    ping-pongs' medians, the least of their least times, the steps (and stage spans) pooled;
    the serial steps' median over the passes."""
    runs = {rate: [] for rate in rates}
    serials = []
    for _ in range(passes):
        serials.append(serial_steps(rounds))
        for rate in rates:
            runs[rate].append(measure(cluster.parse_rate(rate), repeats, rounds))
    results = {}
    for rate, measured in runs.items():
        pairs = {where: {key: (min if "least" in key else statistics.median)(
                     p[where][key] for p, _ in measured) for key in measured[0][0][where]}
                 for where in measured[0][0]}
        steps = {mode: dict(measured[0][1][mode],
                            samples=[s for _, st in measured for s in st[mode]["samples"]])
                 for mode in (*MODES, *SYNC, *SCHEMES)}
        stages = [st["pipeline"]["stages"] for _, st in measured]  # per pass, per stage
        steps["pipeline"]["stages"] = [{k: [t for one in passes for t in one[k]] for k in passes[0]}
                                       for passes in zip(*stages)]  # the passes' spans pooled
        results[rate] = pairs, steps
    return results, {k: statistics.median(s[k] for s in serials) for k in serials[0]}


# ----------------------------------------------------------------------------- the prediction
def predict_step(compute, buckets, alpha, beta, backward_end=None, p=2):
    """A data-parallel step predicted from its compute and the link's alpha and beta.

    ``buckets``: (seconds after the step's start when its Allreduce is posted, bytes), in the
    order posted; each costs the ring formula (:func:`mpipar.tools.hardware.ring_allreduce_time`),
    one after another, as they share the link. ``backward_end`` None (one Allreduce after the
    backward): compute + every bucket's time. Otherwise (overlap) a bucket starts when it is
    posted or when the one before it is done, whichever is later, and the step waits only
    for what is left after the backward ends: compute + max(0, last done - backward_end).
    """
    from mpipar.tools.hardware import ring_allreduce_time

    if backward_end is None:
        return compute + sum(ring_allreduce_time(n, p, alpha, beta) for _, n in buckets)
    done = 0.0
    for posted, n in buckets:
        done = max(done, posted) + ring_allreduce_time(n, p, alpha, beta)
    return compute + max(0.0, done - backward_end)


def predict_sync(compute, n, mode, alpha, beta, p=2):
    """A data-parallel step with one exchange of the ``n`` gradient bytes after the backward
    (lessons/formulas.md#collectives, without gamma):

    ========= ============================================== =====================
    mode      exchange                                       p = 2
    ========= ============================================== =====================
    master    Reduce to a root, Bcast from it (trees):       2 (alpha + n beta)
              2 lg p (alpha + n beta)
    allreduce MPI's, priced as the ring (:func:`predict_step`) 2 alpha + n beta
    ring      hand-written ring: 2(p-1) alpha + 2(p-1)/p n beta 2 alpha + n beta
    ========= ============================================== =====================
    """
    from mpipar.tools.hardware import ring_allreduce_time

    if mode == "master":
        return compute + 2 * math.ceil(math.log2(p)) * (alpha + n * beta)
    return compute + ring_allreduce_time(n, p, alpha, beta)


def predict_tp(compute, calls, alpha, beta, p=2):
    """A tensor-parallel step: its compute + each of its Allreduces ((op, bytes) of the step's
    MPI calls, from the trace) at the ring's 2(p-1) alpha + 2(p-1)/p n beta, one after another
    (each blocks the layer that needs it). Any other call is refused: it has no formula here."""
    from mpipar.tools.hardware import ring_allreduce_time

    other = sorted({op for op, _ in calls if op != "Allreduce"})
    if other:
        raise ValueError(f"tensor-parallel calls without a formula here: {other}")
    return compute + sum(ring_allreduce_time(n, p, alpha, beta) for _, n in calls)


def predict_pp(other, forward, backward, micro_batches, sends, alpha, beta, schedule="1f1b"):
    """A pipeline step: ``other`` (what the step does outside its schedule: the optimizer,
    the loss) + the makespan of the schedule replayed by :func:`mpipar.parts.schedules.simulate`,
    with ``forward`` and ``backward`` the seconds of one micro-batch on each stage and a
    boundary message costing alpha + n beta for each MPI message that carries it. ``sends``:
    each stage's sends in a step ((op, bytes), from the trace); those a micro-batch needs
    (the first stage's, over the micro-batches) price the message, and the rest (past the
    last stage's share of the micro-batches' messages, e.g. the loss) add alpha + n beta
    each after the makespan."""
    from mpipar.parts import schedules

    per_micro = [n for _, n in sends[0]][: len(sends[0]) // micro_batches]
    message = sum(alpha + n * beta for n in per_micro)
    extra = [n for s in sends for _, n in s[micro_batches * len(per_micro):]]
    timeline = schedules.simulate(schedules.schedule(schedule, len(forward), micro_batches),
                                  list(forward), list(backward), message)
    return (other + max(end for stage in timeline for _, _, end in stage)
            + sum(alpha + n * beta for n in extra))


def compute_rate(results):
    """The rate whose steps give what a pipeline step does outside its schedule (the optimizer,
    the loss; :func:`pp_prediction`): no limit if measured, else the fastest."""
    return max(results, key=lambda rate: cluster.parse_rate(rate) or float("inf"))


def predictions(results):
    """{rate: {mode: (predicted seconds, compute seconds, the unlimited rate's compute)}}:
    each rate's steps predicted from that rate's compute (its steps less their exposed
    communication; with overlap also its buckets' posting times and the backward's end) and
    its alpha (8 B across hosts, one way) and beta (4 MiB across hosts, one way, per byte).
    The compute is each rate's own because the machine's other work moves it from rate to
    rate (by a quarter in one run, more than the link's effect at 10 Gbit/s), while the link
    moves only the communication: what is predicted is the communication. The unlimited
    rate's compute is kept beside it to show how far it moved."""
    pairs0, base = results[compute_rate(results)]
    out = {}
    for rate, (pairs, steps) in results.items():
        alpha, beta = alpha_beta(pairs)
        out[rate] = {}
        for m in MODES:
            samples = steps[m]["samples"]
            compute = sync_free(samples)
            if m == "allreduce":
                pred = predict_step(compute, [(0.0, steps[m]["grad_bytes"])], alpha, beta)
            else:
                posted = [statistics.median(t) for t in zip(*(s[4] for s in samples))]
                if len(posted) != len(steps[m]["buckets"]):  # the trace missed some calls
                    raise SystemExit(f"{len(posted)} gradient Allreduces in the trace, "
                                     f"{len(steps[m]['buckets'])} buckets")
                pred = predict_step(compute, list(zip(posted, steps[m]["buckets"])), alpha,
                                    beta, statistics.median(s[3] for s in samples))
            out[rate][m] = pred, compute, sync_free(base[m]["samples"])
        for m in SYNC:
            compute = sync_free(steps[m]["samples"])
            out[rate][m] = (predict_sync(compute, steps[m]["grad_bytes"], m, alpha, beta),
                            compute, sync_free(base[m]["samples"]))
        out[rate]["tensor_parallel"] = tp_prediction(base, steps, alpha, beta)
        out[rate]["pipeline"] = pp_prediction(base, alpha_beta(pairs0), steps, alpha, beta)
    return out


def sync_free(samples):
    """The median data-parallel step less the exposed communication of the rank that
    exposed least (the rank the step waits for): its compute."""
    return statistics.median(s[0] - s[2] for s in samples)


def mpi_free(samples):
    """The median step less the MPI time of the rank that spent least in MPI."""
    return statistics.median(s[0] - min(s[1]) for s in samples)


def tp_prediction(base, steps, alpha, beta):
    """(predicted, compute, the unlimited rate's compute) of the tensor-parallel step:
    :func:`predict_tp` with the compute of this rate's steps and rank 0's calls of one step."""
    compute = mpi_free(steps["tensor_parallel"]["samples"])
    unlimited = mpi_free(base["tensor_parallel"]["samples"])
    return (predict_tp(compute, steps["tensor_parallel"]["calls"][0], alpha, beta), compute,
            unlimited)


def stage_times(result):
    """Each stage's median forward and backward of one micro-batch, from the trace's spans."""
    return ([statistics.median(st["forward"]) for st in result["stages"]],
            [statistics.median(st["backward"]) for st in result["stages"]])


def alpha_beta(pairs):
    """The link's alpha (8 B across hosts, one way) and beta (4 MiB across, per byte). A
    token bucket lets its burst (1 ms of traffic, :func:`mpipar.tools.cluster.burst_bytes`) pass at
    once: at 10 Gbit/s a 1 MiB message fits in it and comes out faster than the rate, while a
    step's megabytes of gradients do not; 4 MiB is several bursts, so its beta is the rate's."""
    return pairs["across hosts"]["8 B"], pairs["across hosts"]["4 MiB"] / BETA


def pp_prediction(base, base_link, steps, alpha, beta):
    """(predicted, compute, the unlimited rate's compute) of the pipeline step:
    :func:`predict_pp` with this rate's stage times (forward and backward of a micro-batch,
    from the trace) and ``other``, what a step does outside its schedule: the unlimited
    rate's median step less the replay with that rate's alpha and beta (the same work at
    every rate). The compute is the replay with free messages."""
    def replay(result, a, b, other=0.0):
        sends = [[c for c in calls if c[0] == "Send"] for calls in result["calls"]]
        return predict_pp(other, *stage_times(result), result["micro_batches"], sends, a, b)

    b0 = base["pipeline"]
    other = statistics.median(s[0] for s in b0["samples"]) - replay(b0, *base_link)
    mine = steps["pipeline"]
    return (replay(mine, alpha, beta, other), replay(mine, 0.0, 0.0, other),
            replay(b0, 0.0, 0.0, other))


def report(results, serials, out):
    """The tables, link.csv and link.png; ``serials``: {scheme: its serial step}."""
    rows = []
    print(f"{'link':>10} {'8 B same host':>14} {'8 B across':>14} {'4 MiB across':>20}   "
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
              + f"{across['4 MiB'] * 1e3:7.2f} ms {8 * BETA / across['4 MiB'] / 1e9:5.2f} Gb/s "
              + "".join(f"{step[m] * 1e3:8.0f} ms {exposed[m] * 1e3:5.0f} ms "
                        f"{pred[m] * 1e3:7.0f} ms {100 * (pred[m] / step[m] - 1):+4.0f}% "
                        for m in MODES))
        for where, times in pairs.items():
            rows += [dict(environment(ranks=4), bench="link", bandwidth=rate, kind="pingpong",
                          where=where, bytes=n, seconds=times[key],
                          least_seconds=times[f"{key} least"], loadavg_1min=load)
                     for n, key in zip(SIZES, KEYS)]
        rows += [dict(environment(ranks=2), bench="link", bandwidth=rate, kind="dp",
                      where="across hosts", mode=m, bytes=steps[m]["grad_bytes"],
                      seconds=step[m], exposed_seconds=exposed[m],
                      least_seconds=min(s[0] for s in steps[m]["samples"]),
                      most_seconds=max(s[0] for s in steps[m]["samples"]),
                      predicted_seconds=pred[m], prediction_error=pred[m] / step[m] - 1,
                      compute_seconds=predicted[rate][m][1], compute_from=compute_rate(results),
                      compute_unlimited_seconds=predicted[rate][m][2],
                      alpha_seconds=across["8 B"], beta_seconds_per_byte=across["4 MiB"] / BETA,
                      samples=len(steps[m]["samples"]), loadavg_1min=load) for m in MODES]
    rows += scheme_table(results, predicted, load)
    speedups(rows, serials)
    path = write_csv("link.csv", rows, out)
    wrote(path, plot(rows, path.with_suffix(".png")))


def speedups(rows, serials):
    """Each step row's speedup over the serial trainer's step on the same model and batch
    (one process, no link), set into the row (serial_seconds, speedup) and printed."""
    steps = [r for r in rows if r["kind"] in ("dp", "scheme")]
    for r in steps:
        r["serial_seconds"] = serials[r.get("scheme") or "data_parallel"]
        r["speedup"] = r["serial_seconds"] / r["seconds"]
    modes = list(dict.fromkeys(r["mode"] for r in steps))
    print("\nspeedup over one process (serial step: " + ", ".join(
        f"{k} {v * 1e3:.0f} ms" for k, v in serials.items()) + ")")
    print(f"{'link':>10} " + " ".join(f"{m:>17}" for m in modes))
    for rate in dict.fromkeys(r["bandwidth"] for r in steps):
        at = {r["mode"]: r for r in steps if r["bandwidth"] == rate}
        print(f"{cluster.format_rate(cluster.parse_rate(rate)):>10} "
              + " ".join(f"{at[m]['speedup']:16.2f}x" for m in modes))


OTHERS = (*SYNC, *SCHEMES)  # the second table's columns
SCHEME_OF = {"master": "data_parallel", "ring": "data_parallel"}


def measured(mode, result, compute):
    """(step, exposed communication, bytes and messages per step) of one mode's steps: DP's
    exposed is its "sync" spans; tensor parallelism's its MPI calls' time (the mean over
    ranks); the pipeline's the step less its predicted compute (the replay with free
    messages): the messages' cost and the waits they cause."""
    samples = result["samples"]
    step = statistics.median(s[0] for s in samples)
    if mode in SYNC:
        return step, statistics.median(s[1] for s in samples), result["grad_bytes"], 2
    sends = [c for c in result["calls"][0] if mode == "tensor_parallel" or c[0] == "Send"]
    exposed = (statistics.median(statistics.mean(s[1]) for s in samples)
               if mode == "tensor_parallel" else step - compute)
    return step, exposed, sum(n for _, n in sends), len(sends)


def scheme_table(results, predicted, load):
    """The second table (DP's other sync modes, tensor parallelism, the pipeline) and its
    link.csv rows (kind "scheme")."""
    rows = []
    print(f"\n{'link':>10} " + " ".join(f"{m:>31}" for m in OTHERS))
    print(f"{'':>10} " + " ".join(f"{'step, exposed, predicted (error)':>31}" for _ in OTHERS))
    for rate, (pairs, steps) in results.items():
        alpha, beta = alpha_beta(pairs)
        cells = []
        for m in OTHERS:
            pred, compute, own = predicted[rate][m]
            step, exposed, nbytes, messages = measured(m, steps[m], compute)
            cells.append(f"{step * 1e3:6.0f} {exposed * 1e3:6.0f} {pred * 1e3:6.0f} ms "
                         f"{100 * (pred / step - 1):+4.0f}%")
            rows.append(dict(environment(ranks=2), bench="link", bandwidth=rate, kind="scheme",
                             where="across hosts", scheme=SCHEME_OF.get(m, m), mode=m,
                             bytes=nbytes, messages=messages, seconds=step,
                             exposed_seconds=exposed,
                             least_seconds=min(s[0] for s in steps[m]["samples"]),
                             most_seconds=max(s[0] for s in steps[m]["samples"]),
                             predicted_seconds=pred, prediction_error=pred / step - 1,
                             compute_seconds=compute, compute_from=compute_rate(results),
                             compute_unlimited_seconds=own, alpha_seconds=alpha,
                             beta_seconds_per_byte=beta, samples=len(steps[m]["samples"]),
                             loadavg_1min=load))
        print(f"{cluster.format_rate(cluster.parse_rate(rate)):>10} " + " ".join(
            f"{c:>31}" for c in cells))
    return rows


def plot(rows, path):
    """Step time against the link's rate, one panel per table: the measured step of each mode
    or scheme as a bar, its exposed communication shaded, the prediction as a line over it;
    and a third panel, each one's speedup over one process against the rate."""
    from mpipar.tools.bench.common import pyplot, save_figure

    plt = pyplot()
    dp = [r for r in rows if r["kind"] == "dp"]
    rates = sorted(dict.fromkeys(r["bandwidth"] for r in dp),
                   key=lambda rate: -(cluster.parse_rate(rate) or float("inf")))
    fig, (top, bottom, third) = plt.subplots(3, 1, figsize=(9, 12), height_ratios=(1, 1, 0.7))
    speedup_panel(third, [r for r in rows if r.get("speedup")], rates)
    bars(top, dp, MODES, rates)
    top.set_ylabel("data-parallel step (ms), 2 ranks")
    top.set_title(f"DP step of the {dp[0]['bytes'] / 1e6:.1f} MB-gradient MLP across an "
                  f"emulated link (load {dp[0]['loadavg_1min']:.1f}); error = predicted/measured"
                  " - 1", fontsize=9)
    bars(bottom, [r for r in rows if r["kind"] == "scheme"], OTHERS, rates)
    bottom.set_yscale("log")
    top_ms = max(r["seconds"] for r in rows if r["kind"] == "scheme") * 1e3
    bottom.set_ylim(10, 8 * top_ms)  # room for the legend above the bars
    bottom.set_ylabel("step (ms), 2 ranks, one per host (log)")
    bottom.set_title("DP master and hand-written ring, tensor parallelism (GPT), pipeline "
                     "(GPT, 1F1B): measured and predicted", fontsize=9)
    return save_figure(fig, path)


def colour(mode):
    """One colour per mode or scheme, the same in every panel of the picture."""
    names = [*MODES, *OTHERS]
    return f"C{names.index(mode) % 10}" if mode in names else "gray"


def speedup_panel(ax, rows, rates):
    """Each mode's and scheme's speedup over the serial step against the link's rate (log),
    with the break-even line: below it two hosts train slower than one process."""
    for mode in dict.fromkeys(r["mode"] for r in rows):
        at = {r["bandwidth"]: r["speedup"] for r in rows if r["mode"] == mode}
        ax.plot(range(len(rates)), [at[rate] for rate in rates], "o-", label=mode,
                color=colour(mode))
    ax.axhline(1.0, color="black", lw=1, ls="--", label="one process")
    ax.set_yscale("log")
    ax.set_xticks(range(len(rates)))
    ax.set_xticklabels([cluster.format_rate(cluster.parse_rate(rate)) for rate in rates])
    ax.set_ylabel("speedup over one process (log)")
    ax.set_xlabel("link between the 2 emulated hosts")
    ax.set_title("speedup of 2 ranks, one per host, over the serial trainer's step on the same "
                 "model and batch", fontsize=9)
    ax.legend(fontsize=7, ncol=3, loc="lower left")
    ax.grid(alpha=0.3)


def bars(ax, rows, modes, rates):
    """One bar per (rate, mode) with its exposed part hatched; the prediction a line."""
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        at = {r["bandwidth"]: r for r in rows if r["mode"] == mode}
        xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(rates))]
        step = [at[rate]["seconds"] * 1e3 for rate in rates]
        ax.bar(xs, step, width, label=f"{mode}: measured step", alpha=0.75, color=colour(mode))
        ax.bar(xs, [max(at[rate]["exposed_seconds"], 0) * 1e3 for rate in rates], width,
               fill=False, hatch="//", edgecolor="black", lw=0,
               label="exposed communication" if j == len(modes) - 1 else None)
        ax.plot(xs, [at[rate]["predicted_seconds"] * 1e3 for rate in rates], "o-", ms=5,
                color=colour(mode), markeredgecolor="black", label=f"{mode}: predicted")
        for x, rate in zip(xs, rates):
            ax.annotate(f"{100 * at[rate]['prediction_error']:+.0f}%",
                        (x, at[rate]["predicted_seconds"] * 1e3), fontsize=7, ha="center",
                        xytext=(0, 6), textcoords="offset points")
    ax.set_xticks(range(len(rates)))
    ax.set_xticklabels([cluster.format_rate(cluster.parse_rate(rate)) for rate in rates])
    ax.legend(fontsize=7, ncol=2 if len(modes) > 2 else 1, loc="upper left")
    ax.grid(alpha=0.3, axis="y")


def rate_list(text):
    """An argparse type: link rates as tc writes them, comma-separated, each read by
    :func:`mpipar.tools.cluster.parse_rate` (which refuses a bad one); the text as given."""
    for rate in text.split(","):
        cluster.parse_rate(rate, "--rates")
    return text


def main(argv=None):
    ap = bench_parser("link", "two rates, one pass, fewer repeats and steps", worker=False)
    ap.prog = "python -m mpipar.tools.bench.link"
    ap.sized("--rates", "none,10gbit,1gbit,100mbit", "1gbit,100mbit", type=rate_list,
             help="link rates to measure, as tc writes them (none: no limit)")
    ap.sized("--passes", 3, 1, type=number(), help="times over every rate")
    ap.sized("--repeats", 9, 3, type=number(),
             help="timed round trips of 1 MiB and of 4 MiB per pair (of 8 B: 20 times as many)")
    ap.sized("--rounds", 5, 2, type=number(), help="timed data-parallel steps per mode and pass")
    ap.add_argument("--pingpong", action="store_true",
                    help="only the ping-pong, on the ranks of this mpirun (2 or more)")
    ap.add_argument("--worker", choices=["dp", "serial"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.pingpong:
        return pingpong(args.repeats)
    if args.worker:
        return (dp_worker if args.worker == "dp" else serial_worker)(args.rounds)
    reason = cluster.unavailable()
    if reason:
        raise SystemExit(f"cannot emulate hosts: {reason}")
    report(*drive(args.rates.split(","), args.passes, args.repeats, args.rounds), args.out)


if __name__ == "__main__":
    main()
