"""What the distributed checks share: a task built from flags exactly as a trainer builds it
(:func:`mpipar.cli.parse_args`), and the serial reference run every scheme is compared with."""

from mpipar import backend as B
from mpipar import serial
from mpipar.cli import parse_args

DATA = {}  # one data set per (model, seed), shared by every task of a script


def make_task(flags, scheme="serial", n_ranks=1):
    """The Task of ``flags``, parsed, completed and checked as ``scheme`` on ``n_ranks``."""
    args = parse_args(scheme, flags, n_ranks)
    task = serial.Task(args, DATA.get((args.model, args.seed)))
    DATA[args.model, args.seed] = task.data
    return task


def serial_run(task, steps):
    """The reference: the loss of each of ``steps`` steps of the serial trainer, then its
    parameters {name: host array} and its optimizer."""
    model = task.build_model().init(task.args.seed)
    opt = serial.make_optimizer(task.args, model.parameters())
    losses = [serial.train_step(model, task.loss_fn, opt, *task.to_device(*task.batch(s)))
              for s in range(steps)]
    return losses, {n: B.to_numpy(p.data).copy() for n, p in model.named_parameters()}, opt
