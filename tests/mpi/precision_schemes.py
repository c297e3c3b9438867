"""mpirun -n 4 python tests/mpi/precision_schemes.py: every scheme in bf16 and fp16 against
the serial trainer in the same precision.

The GPT (width 16, 2 heads, 2 blocks, 8 tokens, 12 rows; 4 experts a block where the layout
has experts) with SGD, 3 steps, in bf16, in fp16 from a loss scale of 1024 (no overflow) and
from 3e5 (the first two steps overflow: skipped, the second halving the scale). For each
layout, on every rank:
- the loss scale (and its count of skipped steps) is the serial trainer's, on every rank of
  the job: one overflow anywhere skips the step on every rank of every group;
- each parameter, gathered whole, is within 3% of its largest change over the 3 steps plus
  one unit in the last place of its own 16-bit value, element by element, of the serial one.
  The runs differ in rounding only: a rank's gradient rounded to 16 bits before the sum where
  the serial one is rounded after, micro-batch gradients added in 16 bits, activations that
  cross between ranks rounded to 16 bits (tensor, sequence and context parallelism; the
  pipeline's messages are the 16-bit values the serial model passes between its layers, so
  a pipeline alone is bit for bit the serial trainer, checked here). A gradient left out or
  counted twice moves a weight by a quarter of its change or more, past the tolerance. With
  experts the margin is 10%: top-k routing is discontinuous, and a token whose two best
  experts are within a rounding of each other may take the other one (its router gradient
  moves a few percent of a router weight's change).
Two planted mistakes train and yet fail: a pipeline whose stages each decide from their own
gradients whether to skip (fp16 from 3e5: the stages' scales and steps part), and a hybrid
whose backward starts from the unscaled loss and still divides by the scale (every change
65536 times too small).
"""

import sys

import numpy as np
from reference import make_task

from mpipar import context_parallel as X
from mpipar import expert_parallel as EP
from mpipar import hybrid as H
from mpipar import pipeline as PP
from mpipar import serial
from mpipar.engine import precision as MP
from mpipar.mpi import comm as C
from mpipar.mpi.grid import Grid
from mpipar.train import trainer_class

C.install_excepthook()
world = C.world()
RANK, STEPS = world.rank, 3
GPT = ["--model", "gpt", "--d-model", "16", "--n-heads", "2", "--n-layers", "2", "--seq-len",
       "8", "--batch-size", "12", "--optim", "sgd", "--lr", "2"]
PRECISIONS = (["--precision", "bf16"], ["--precision", "fp16", "--loss-scale", "1024"],
              ["--precision", "fp16", "--loss-scale", "3e5"])
LAYOUTS = [  # (scheme, ranks, flags)
    ("pipeline", 4, ["--schedule", "1f1b", "--micro-batches", "1"]),  # bit for bit: EXACT
    ("pipeline", 4, ["--schedule", "1f1b"]),
    ("pipeline", 2, ["--schedule", "interleaved", "--chunks", "2"]),
    ("pipeline", 2, ["--schedule", "zb-h1", "--micro-batches", "3"]),
    ("pipeline", 2, ["--schedule", "gpipe", "--micro-batches", "1", "--recompute", "full"]),
    ("data_parallel", 2, ["--sync", "allreduce", "--bucket-mb", "0.005", "--overlap"]),
    ("data_parallel", 4, ["--sync", "allreduce", "--zero", "1"]),
    ("data_parallel", 4, ["--sync", "allreduce", "--zero", "1", "--grad-sum", "bf16"]),
    ("data_parallel", 4, ["--sync", "allreduce", "--zero", "2", "--bucket-mb", "0.005",
                          "--overlap"]),
    ("data_parallel", 4, ["--sync", "allreduce", "--zero", "3", "--micro-batches", "2"]),
    ("tensor_parallel", 2, ["--sequence-parallel"]),
    ("tensor_parallel", 2, ["--recompute", "selective"]),
    ("hybrid", 4, ["--dp", "2", "--pp", "2"]),
    ("hybrid", 4, ["--dp", "2", "--tp", "2", "--sequence-parallel"]),
    ("hybrid", 4, ["--tp", "2", "--pp", "2", "--recompute", "full"]),
    ("hybrid", 4, ["--dp", "2", "--pp", "2", "--zero", "2", "--overlap"]),
    ("hybrid", 4, ["--dp", "4", "--cp", "2", "--cp-algo", "zigzag"]),
    ("context_parallel", 4, ["--cp", "2", "--cp-algo", "ring"]),
    ("context_parallel", 4, ["--cp", "4", "--cp-algo", "zigzag"]),
    ("context_parallel", 4, ["--cp", "2", "--cp-algo", "ulysses"]),
    ("expert_parallel", 4, ["--experts", "4", "--ep", "2"]),
    ("hybrid", 4, ["--experts", "4", "--ep", "2", "--dp", "2", "--pp", "2"]),
]
EXACT = {0, 4}  # the pipelines of one micro-batch: the serial model's arithmetic, cut in two


def fail(what):
    sys.stderr.write(f"[rank {RANK}] FAILED: {what}\n")
    world.mpi.Abort(1)


def build(scheme, n, flags, cls=None):
    """The scheme's trainer on the first n ranks' sub-communicator, as the runner builds it."""
    task = make_task(flags, scheme, n)
    a, sub = task.args, world.mpi.Split(RANK // n, RANK)
    if scheme == "hybrid":
        grid = H.make_grid(a.dp, a.tp, a.pp, sub, ep=a.ep if a.experts else None, cp=a.cp)
    elif scheme == "expert_parallel":
        grid = EP.make_grid(a.ep, sub)
    elif scheme == "context_parallel":
        grid = X.make_grid(a.cp, sub)
    else:
        grid = Grid(a.dp, a.tp, a.pp, sub)
    trainer = (cls or trainer_class(scheme, a))(task, grid, a)
    if a.recompute:
        from mpipar.runner import recompute

        recompute.apply(trainer, a.recompute)
    return trainer, C.Comm(sub, "job")


def serial_reference(flags):
    """The serial trainer's STEPS steps: {name: float64 parameters} before and after, and its
    loss scaler's state (None without one)."""
    task = make_task([f for f in flags if f not in ("--recompute", "full", "selective")])
    trainer = serial.Serial(task, None, task.args)
    w0 = {p.name: p.data.astype(np.float64) for p in trainer.opt.params}
    for s in range(STEPS):
        trainer.step(s)
    w = {p.name: p.data.astype(np.float64) for p in trainer.opt.params}
    return w0, w, trainer.scaler.state() if trainer.scaler else None


def check(scheme, n, flags, cls=None, strict=True):
    """Train the layout STEPS steps. Returns the worst error of a parameter over its change
    (inf if a weight is not finite), whether every parameter is bit for bit the serial one,
    and whether every rank ended with the serial trainer's loss scale."""
    model = ["--experts", "4"] if "--experts" in flags else []
    w0, want, serial_scale = serial_reference(GPT + model + PREC)
    trainer, job = build(scheme, n, GPT + PREC + flags, cls)
    for s in range(STEPS):
        trainer.step(s)
    scaler = trainer.scaler.state() if getattr(trainer, "scaler", None) else None
    scales = job.allgather_obj(scaler)
    agreed = len(set(map(str, scales))) == 1 and scaler == serial_scale
    if strict and not agreed:
        fail(f"{scheme} {flags} {PREC}: loss scales {scales}, the serial {serial_scale}")
    full = trainer.full_params()
    worst, bitwise = 0.0, True
    if job.rank == 0:
        eps = MP.facts(PREC[1])["eps"]
        for name, w in want.items():
            got = np.asarray(full[name], dtype=np.float64)
            if not np.isfinite(got).all():
                return float("inf"), False, agreed
            moved, err = np.abs(w - w0[name]).max(), np.abs(got - w)
            bitwise &= not err.any()
            tol = 0.10 if "--experts" in flags else 0.03  # a near-tie routed differently
            if strict and (err > tol * moved + eps * np.abs(w)).any():
                fail(f"{scheme} {flags} {PREC}: {name} is {err.max():.3g} off the serial, its "
                     f"change {moved:.3g}")
            worst = max(worst, float(err.max() / max(moved, 1e-30)))
    return worst, bitwise, agreed


class StageVerdict(PP.Pipeline):
    """The planted mistake: each stage skips a step when its own gradients overflowed."""

    def __init__(self, task, grid, args):
        super().__init__(task, grid, args)
        self.update = MP.Guarded(self.opt, self.scaler, lambda bad: bad)


class UnscaledBackward(H.Hybrid):
    """The planted mistake: the backward starts from the loss itself (the trainer's own
    scaler hidden from the step), while the update still divides by the scale."""

    def step(self, step):
        scaler, self.scaler = self.scaler, None
        try:
            return super().step(step)
        finally:
            self.scaler = scaler


for PREC in PRECISIONS:
    for i, (scheme, n, flags) in enumerate(LAYOUTS):
        if "--grad-sum" in flags and PREC[1] != "bf16":
            continue  # a sum of bf16 words: for bf16 only
        worst, bitwise, _ = check(scheme, n, flags)
        if i in EXACT and world.rank == 0 and not bitwise:
            fail(f"{scheme} {flags} {PREC}: not bit for bit the serial trainer")
        C.log(f"{' '.join(PREC[1:])}: {scheme} {' '.join(flags)} on {n} ranks: worst error "
              f"{worst:.2%} of a parameter's change" + (" (bit for bit)" if bitwise else ""))

PREC = PRECISIONS[2]
worst, _, agreed = check("pipeline", 4, ["--schedule", "1f1b"], StageVerdict, strict=False)
caught = world.allgather_obj(not agreed or worst > 0.25)
if not any(caught):
    fail("the planted StageVerdict passed")
C.log("planted StageVerdict: caught, " + ("the stages' loss scales part" if not agreed else
                                          f"a parameter's change {worst:.0%} off the serial"))
PREC = PRECISIONS[1]
worst, _, _ = check("hybrid", 4, ["--dp", "2", "--pp", "2"], UnscaledBackward, strict=False)
if world.rank == 0 and not worst > 0.25:
    fail(f"the planted UnscaledBackward passed ({worst:.1%} off)")
C.log(f"planted UnscaledBackward: caught, a parameter's change {worst:.0%} off the serial")
C.log(f"precision scheme checks passed on {world.size} ranks")
