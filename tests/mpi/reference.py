"""What the distributed checks share: a task built from flags exactly as a trainer builds it
(:func:`mpipar.runner.cli.parse_args`), and the serial reference run every scheme is compared with.
"""

import numpy as np

from mpipar import serial
from mpipar.engine import backend as B
from mpipar.runner.cli import parse_args

# the data-parallel checks' models (dp_checks, zero_checks) and their gradient buckets
MODELS = {  # 10 and 11 rows: uneven over 3 and 4 ranks (and 11 over 2)
    "mlp": ["--model", "mlp", "--sizes", "64,16,12,10", "--batch-size", "10", "--lr", "0.1"],
    "gpt": ["--model", "gpt", "--d-model", "16", "--n-heads", "2", "--n-layers", "2",
            "--seq-len", "8", "--batch-size", "11"],
}
BUCKET = ["--bucket-mb", "0.002"]  # 2 KiB: several buckets in both models

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


def relative(got, want):
    """The largest difference over the largest value: a tensor's relative error."""
    return float(np.abs(got - want).max() / np.abs(want).max())


def worst_error(trainer, want, steps):
    """Train ``trainer`` ``steps`` steps; the worst relative error of its parameters against
    the serial ones ``want``: how far a planted mistake drifts."""
    for step in range(steps):
        trainer.step(step)
    return max(relative(B.to_numpy(p.data), want[name])
               for name, p in trainer.model.named_parameters())
