"""The machine the cost model (:mod:`mpipar.tools.simulate`) prices a step on: a device's FLOP rate,
its links' alpha and beta, and what each collective costs.

A collective costs what the same call measured where a measurement exists, else its formula:

1. Measured: ``python -m mpipar.tools.bench net`` times MPI's Allreduce through
:mod:`mpipar.mpi.comm` (the call tensor parallelism and ZeRO make) on 2 and 4 ranks at sizes 8 B to
16 MiB (the ``allreduce`` rows of plots/net.csv, algorithm ``mpi``). ``--hardware this`` reads them
(:func:`measured_machine`, :func:`allreduce_table`): for a rank count that was measured, a size
between two measured sizes costs the log-log linear interpolation of their times.
2. Formula: outside the measured sizes, for rank counts not measured, and on the published
   presets (a100, h100), the ring, 2(p-1) alpha + 2(p-1)/p n beta (Thakur et al. 2005).
3. Allgather and Reduce_scatter: net.csv has no rows of their own, so each costs half an
   Allreduce of the same (whole) size: an Allreduce is a Reduce_scatter then an Allgather,
   and in the ring formula each is exactly half.
"""

import csv
import math
from dataclasses import dataclass
from pathlib import Path

PLOTS = Path(__file__).resolve().parents[2] / "plots"
# what each collective of n bytes (the whole buffer) costs, as a fraction of an Allreduce
OF_ALLREDUCE = {"allreduce": 1.0, "allgather": 0.5, "reduce_scatter": 0.5}


def ring_allreduce_time(n_bytes, p, alpha, beta):
    """2(p-1) alpha + 2(p-1)/p n beta (Thakur et al. 2005); zero on one rank."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n_bytes * beta


def interpolate(points, n_bytes):
    """Seconds at ``n_bytes`` log-log linear between the measured (bytes, seconds) ``points``
    (sorted by bytes); None outside them (the caller falls back to the formula)."""
    if not points or not points[0][0] <= n_bytes <= points[-1][0]:
        return None
    for (n0, t0), (n1, t1) in zip(points, points[1:]):
        if n0 <= n_bytes <= n1:
            if n1 == n0:
                return t0
            w = (math.log(n_bytes) - math.log(n0)) / (math.log(n1) - math.log(n0))
            return math.exp((1 - w) * math.log(t0) + w * math.log(t1))
    return points[0][1]  # a single measured size


@dataclass
class Hardware:
    """A device's sustained FLOP rate and its links' alpha-beta costs.

    ``tp_*`` is the link inside a node (tensor parallel groups sit there), ``net_*`` the link
    between nodes (pipeline and data parallel traffic)."""

    name: str
    flops: float  # sustained FLOP/s of one device
    tp_alpha: float
    tp_beta: float
    net_alpha: float
    net_beta: float
    memory: float = float("inf")  # bytes per device
    source: str = ""
    # a fixed time per layer and micro-batch forward (twice that backward) that no split
    # divides: Python dispatch, and the lower efficiency of small matrix products
    layer_overhead: float = 0.0
    # seconds per parameter of a stage for the step's zero_grad and optimizer update (memory
    # bound: it grows with the parameters, not with the batch)
    update_per_param: float = 0.0
    # seconds(n_bytes, ranks) of one allreduce, where measured costs replace the ring formula
    # (ranks that share cores: see mpipar.tools.validate.lockstep_allreduce); None: the table or
    # the formula
    allreduce: object = None
    # {ranks: ((bytes, seconds), ...)} of Allreduces measured on this machine (step 1)
    measured: dict = None
    # seconds per parameter value each time ZeRO-3 gathers a layer (forward, backward): its
    # Python work beyond the collectives, a fresh full buffer filled, viewed and freed, a fresh
    # full gradient (see mpipar.tools.simulate); the full layer at any number of ranks
    zero3_per_value: float = 0.0

    def collective_time(self, kind, n_bytes, p, alpha, beta):
        """One ``kind`` (allreduce, allgather, reduce_scatter) of n_bytes over p ranks: what
        the same call measured on p ranks at that size, else the ring formula (steps 1-3)."""
        if p <= 1:
            return 0.0
        share = OF_ALLREDUCE[kind]
        if self.allreduce is not None:
            return share * self.allreduce(n_bytes, p)
        seconds = interpolate((self.measured or {}).get(p), n_bytes)
        if seconds is None:
            seconds = ring_allreduce_time(n_bytes, p, alpha, beta)
        return share * seconds


# Published peak figures, derated to 50% sustained for the FLOP rate (a typical
# model-FLOPs utilisation for large transformer training, Narayanan et al. 2021, Sec. 5.1),
# and one direction's bandwidth for the links.
PRESETS = {
    "a100": Hardware("A100 SXM 80GB, NVLink 3, HDR InfiniBand", flops=0.5 * 312e12,
                     tp_alpha=5e-6, tp_beta=1 / 300e9, net_alpha=10e-6, net_beta=1 / 25e9,
                     memory=80e9, source="312 TFLOP/s bf16 dense; NVLink 300 GB/s per direction; "
                                         "200 Gb/s HDR per GPU"),
    "h100": Hardware("H100 SXM 80GB, NVLink 4, NDR InfiniBand", flops=0.5 * 989e12,
                     tp_alpha=5e-6, tp_beta=1 / 450e9, net_alpha=10e-6, net_beta=1 / 50e9,
                     memory=80e9, source="989 TFLOP/s bf16 dense; NVLink 450 GB/s per direction; "
                                         "400 Gb/s NDR per GPU"),
}


def this_machine(flops, alpha, beta, memory=24 * 2**30, layer_overhead=0.0,
                 update_per_param=0.0, allreduce=None, name="this machine (measured)",
                 measured=None, zero3_per_value=0.0):
    """The build machine: every link is shared memory, so one alpha and beta serve all."""
    return Hardware(name, flops, alpha, beta, alpha, beta, memory, "FLOP rate, alpha, beta "
                    "as measured", layer_overhead, update_per_param, allreduce, measured,
                    zero3_per_value)


def allreduce_table(rows):
    """{ranks: ((bytes, seconds), ...)} from net.csv's rows: MPI's Allreduce through the
    wrapper (kind ``allreduce``, algo ``mpi``), sorted by size (step 1)."""
    table = {}
    for r in rows:
        if r["kind"] == "allreduce" and r["algo"] == "mpi":
            table.setdefault(int(r["ranks"]), []).append((int(r["bytes"]), float(r["seconds"])))
    return {p: tuple(sorted(points)) for p, points in table.items()}


def zero3_cost(folder=PLOTS):
    """Seconds per value of ZeRO-3's gather work (``Hardware.zero3_per_value``) as
    ``python -m mpipar.tools.bench memory`` measured it (plots/memory_bench.csv's
    ``zero3_ns_per_value``); 0 without it."""
    try:
        return next(float(r["zero3_ns_per_value"]) * 1e-9 for r in csv.DictReader(
            open(folder / "memory_bench.csv")) if r.get("zero3_ns_per_value"))
    except (OSError, StopIteration, ValueError):
        return 0.0


def measured_machine(flops=None, alpha=None, beta=None, folder=PLOTS):
    """``--hardware this``: one rank's GEMM rate alone (plots/flops.csv), the ping-pong's alpha
    and beta and the measured Allreduces (plots/net.csv), ZeRO-3's gather work
    (:func:`zero3_cost`); a number given as a flag wins (alpha or beta given: collectives by
    the formula with them); without the CSVs, the defaults."""
    try:
        rate = next(float(r["gflops_per_rank"]) * 1e9 for r in csv.DictReader(
            open(folder / "flops.csv")) if r["ranks"] == r["computing"] == "1")
        net = list(csv.DictReader(open(folder / "net.csv")))
        ping = next(r for r in net if r["kind"] == "pingpong")
        found, how = (rate, float(ping["alpha"]), float(ping["beta"])), "measured"
        table = allreduce_table(net) if alpha is None and beta is None else None
    except (OSError, StopIteration):
        found, how, table = (20e9, 5e-6, 1 / 8e9), "defaults", None
    f, a, b = (v if v is not None else d for v, d in zip((flops, alpha, beta), found))
    how += ", flags given" if {flops, alpha, beta} != {None} else ""
    return this_machine(f, a, b, name=f"this machine ({how}: {f / 1e9:.1f} GFLOP/s, alpha "
                                      f"{a * 1e6:.2f} us, beta {b * 1e9:.4f} ns/B)",
                        measured=table, zero3_per_value=zero3_cost(folder))
