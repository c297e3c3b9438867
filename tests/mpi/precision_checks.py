"""mpirun -n 4 python tests/mpi/precision_checks.py: data and tensor parallelism in bf16 and
fp16.

The GPT (width 16, 2 blocks, 8 tokens, 12 rows) with SGD, 3 steps, on 4 and 2 ranks. For each
case, on every rank:
- the bytes of the gradient sum: the float32 sum sends 4 bytes a gradient (the bf16 gradients
  widened), the bf16 sum 2 (Comm.stats of the Allreduce), and fp16 8 more, the one float
  of the job-wide overflow verdict;
- every replica holds the same bits after each step;
- against the serial trainer in the same precision, each parameter's float32 master moved
  within 3% of its largest change over the 3 steps: the runs differ in rounding only (a
  replica's gradient is rounded to 16 bits before the sum, the serial one after; the bf16 sum
  rounds each partial sum), a few units of 2^-8 of a gradient, and SGD moves a weight in
  proportion to it, where a rank's gradients left out or counted twice would move it by a
  quarter or more;
- fp16 (from a loss scale of 1024, which no gradient here overflows, then of 3e5, whose
  first two steps overflow: skipped, the second halving the scale, the third taken): every
  rank skips the steps the serial trainer skips and ends at its scale.
Then tensor parallelism on 2 ranks (check_tp), whose activations cross in 16 bits. Two
planted mistakes train and yet fail: gradients left unsummed, and each rank's overflow
verdict taken from its own gradients before the sum (fp16 from 3e5: a sum of finite
gradients overflows, and the ranks that saw none update with it).
"""

import sys

import numpy as np
from reference import make_task

from mpipar import data_parallel as D
from mpipar.engine import backend as B
from mpipar.engine import precision as MP
from mpipar.mpi import comm as C
from mpipar.mpi.grid import Grid

C.install_excepthook()
world = C.world()
RANK, STEPS = world.rank, 3
GPT = ["--model", "gpt", "--d-model", "16", "--n-heads", "2", "--n-layers", "2", "--seq-len",
       "8", "--batch-size", "12", "--optim", "sgd", "--sync", "allreduce"]


def fail(what):
    sys.stderr.write(f"[rank {RANK}] FAILED: {what}\n")
    world.mpi.Abort(1)


def initial(task):
    model = task.build_model()
    return {n: p.init_value(task.args.seed, n).astype(np.float32).astype(B.dtype).astype(
        np.float64) for n, p in model.named_parameters()}


def master(opt, p):
    """The float32 master of ``p`` (its value itself while every step has been skipped)."""
    return (opt.state[p][-1] if p in opt.state else p.data).astype(np.float64)


class Unsummed(D.AllreduceScheme):
    """The planted mistake: each replica updates with its own rows' gradients alone."""

    def __init__(self, task, grid, args):
        super().__init__(task, grid, args)
        self.sync.finish = lambda: None


class LocalVerdict(D.AllreduceScheme):
    """The planted mistake: each rank decides from its own gradients, before the sum, whether
    the step overflowed. Right while no rank or every rank overflows; wrong when the sum of
    finite gradients overflows (or only some ranks' do): some ranks then update with inf."""

    def step(self, step):
        self.model.zero_grad()
        x, y, normalizer = self.own_rows(step)
        loss = self.forward_backward(x, y, normalizer)
        mine = not all(np.isfinite(p.grad.astype(np.float32)).all() for p in self.params)
        self.sync.finish()
        MP.take_step(self.opt, self.scaler, lambda _: mine)  # this rank's verdict
        return self.global_loss(loss)


def check(n, precision, grad_sum, extra=(), cls=D.AllreduceScheme, strict=True):
    flags = [*GPT, "--precision", precision, *extra]
    serial_flags = [f for f in flags if f not in ("--sync", "allreduce")]
    task = make_task([*flags, "--grad-sum", grad_sum], "data_parallel", n)
    opt, serial_scale = serial_reference(make_task(serial_flags))
    want = {p.name: master(opt, p) for p in opt.params}  # the float32 masters
    w0 = initial(task)
    t = cls(task, Grid(dp=n, mpi_comm=world.mpi.Split(RANK // n, RANK)), task.args)
    grads = sum(p.size for p in t.params)
    for step in range(STEPS):
        t.comm.reset_stats()
        t.step(step)
        sent = t.comm.stats["Allreduce"]["sent"]  # with fp16, + the 8-byte overflow verdict
        if strict and sent != grads * (2 if grad_sum == "bf16" else 4) + 8 * (precision == "fp16"):
            fail(f"{(n, precision, grad_sum)}: the gradient sum sent {sent} bytes for {grads}")
    scaler = t.scaler.state() if t.scaler else None
    if len(set(map(str, t.comm.allgather_obj(scaler)))) != 1:
        fail(f"{(n, precision, grad_sum)}: the ranks' loss scales differ: {scaler}")
    if strict and scaler != serial_scale:
        fail(f"{(n, precision, grad_sum)}: loss scale {scaler}, the serial trainer's "
             f"{serial_scale}")
    worst = 0.0
    for name, p in t.model.named_parameters():
        got = master(t.opt, p)  # the master: its 16-bit rounding would hide less
        if strict and len(set(t.comm.allgather_obj(got.tobytes()))) != 1:
            fail(f"{(n, precision, grad_sum)}: the replicas' {name} differ")
        moved = np.abs(want[name] - w0[name]).max()
        if not np.isfinite(got).all():
            worst = float("inf")  # an update with an overflowed gradient
        elif moved > 0:
            worst = max(worst, float(np.abs(got - want[name]).max() / moved))
        elif strict and np.abs(got - w0[name]).max() > 0:
            fail(f"{(n, precision, grad_sum)}: {name} moved where the serial one did not")
    if strict and worst > 0.03:
        fail(f"{(n, precision, grad_sum)}: a parameter's change is {worst:.1%} off the serial")
    return worst, scaler


def serial_reference(task):
    """The serial trainer's STEPS steps in this precision, with its own loss scaler for fp16:
    its optimizer (the masters) and the scaler's state (None without one)."""
    from mpipar import serial

    trainer = serial.Serial(task, None, task.args)
    for s in range(STEPS):
        trainer.step(s)
    return trainer.opt, trainer.scaler.state() if trainer.scaler else None


for n in (4, 2):
    for precision, grad_sum, extra in (("bf16", "fp32", ()), ("bf16", "bf16", ()),
                                       ("fp16", "fp32", ("--loss-scale", "1024")),
                                       ("fp16", "fp32", ("--loss-scale", "3e5"))):
        worst, scaler = check(n, precision, grad_sum, extra)
        C.log(f"{n} ranks, {precision}, sum in {grad_sum}{' ' + ' '.join(extra) if extra else ''}"
              f": worst change off the serial {worst:.2%}"
              + (f", {scaler['skipped']} of {STEPS} steps skipped" if scaler else ""))
def check_tp(n, precision, extra=()):
    """Tensor parallelism on n ranks: its activations cross in 16 bits (every g and f sum
    rounded), so each gathered parameter is compared with the serial one within 3% of its
    change plus one unit in the last place of its 16-bit value; the loss scale, if any, is
    the serial trainer's on every rank."""
    from mpipar import tensor_parallel as TPM
    from mpipar.engine.precision import facts

    flags = [f for f in GPT if f not in ("--sync", "allreduce")] + ["--precision", precision,
                                                                   *extra]
    opt, serial_scale = serial_reference(make_task(flags))
    task = make_task(flags, "tensor_parallel", n)
    w0 = initial(task)
    t = TPM.TensorParallel(task, Grid(tp=n, mpi_comm=world.mpi.Split(RANK // n, RANK)),
                           task.args)
    for step in range(STEPS):
        t.step(step)
    scaler = t.scaler.state() if t.scaler else None
    if len(set(map(str, t.comm.allgather_obj(scaler)))) != 1 or scaler != serial_scale:
        fail(f"tp {(n, precision)}: loss scale {scaler}, the serial trainer's {serial_scale}")
    full = t.full_params()
    worst = 0.0
    if t.comm.rank == 0:
        eps = facts(precision)["eps"]
        for p in opt.params:
            got, want = full[p.name].astype(np.float64), p.data.astype(np.float64)
            moved = np.abs(master(opt, p) - w0[p.name]).max()
            err = np.abs(got - want).max()
            if err > 0.03 * moved + eps * np.abs(want).max():
                fail(f"tp {(n, precision)}: {p.name} is {err:.3g} off the serial, its change "
                     f"{moved:.3g}")
            worst = max(worst, err / max(moved, 1e-30))
    return worst, scaler


for n in (2,):  # the model has 2 heads: 2 tensor-parallel ranks
    for precision, extra in (("bf16", ()), ("fp16", ("--loss-scale", "1024")),
                             ("fp16", ("--loss-scale", "3e5"))):
        worst, scaler = check_tp(n, precision, extra)
        C.log(f"tensor parallel on {n} ranks, {precision}{' ' + ' '.join(extra) if extra else ''}"
              + (f": {scaler['skipped']} of {STEPS} steps skipped" if scaler else ""))

for mistake, case in ((Unsummed, ("bf16", "fp32", ())),
                      (LocalVerdict, ("fp16", "fp32", ("--loss-scale", "3e5")))):
    worst, _ = check(4, *case, cls=mistake, strict=False)
    if not worst > 0.25:
        fail(f"the planted {mistake.__name__} passed the comparison ({worst:.1%} off)")
    C.log(f"planted {mistake.__name__}: caught, " + (
        f"a parameter's change {worst:.0%} off the serial" if np.isfinite(worst) else
        "a rank updated with an overflowed gradient (weights not finite)"))
C.log(f"precision checks passed on {world.size} ranks")
