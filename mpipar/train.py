"""The runner: everything around the schemes, so that each scheme file holds only its steps.

    python -m mpipar.serial                                  # each scheme module hands over here
    mpirun -n 4 python -m mpipar.data_parallel --sync ring
    mpirun -n 4 python -m mpipar.train pipeline --schedule gpipe   # the same, named

This module owns the command line (:mod:`mpipar.runner.cli`: the flags every trainer shares and
each scheme's own, and the refusals as a table of condition and message), the process grid,
the one training loop (progress bar, ``--log-every``, ``--explain`` for the first step only),
the held-out evaluation, ``--save-params``, and each scheme's report at the end
(:mod:`mpipar.runner.reports`: the pipeline's bubble, stash and timeline, the optimizer state
and memory per rank).

A scheme is a trainer class with one small interface:

- ``Trainer(task, grid, args)``: build this rank's part (its Step 1);
- ``trainer.step(step) -> loss``: one optimizer step on the global batch of ``step``; the
  global loss, on every rank (so that every rank stops at once if it is not finite);
- ``trainer.full_params()``: the whole model as {canonical name: host array} on world rank 0
  (None elsewhere), the names and shapes of the serial model's parameters;
- and what clipping, checkpoints, recomputation and the memory ledger read, from
  :class:`mpipar.runner.trainer.Trainer` (its parameters' placements, its optimizers, units
  and buffers), which every trainer subclasses.
"""

import math
import os
import sys

import numpy as np
from mpi4py import MPI

from mpipar import serial
from mpipar.engine import backend as B
from mpipar.mpi import comm
from mpipar.mpi.grid import Grid
from mpipar.mpi.trace import TRACE
from mpipar.parts.schedules import format_schedule
from mpipar.runner import checkpoint, clip, memory, recompute
from mpipar.runner.checkpoint import load_params, save_params  # noqa: F401 (tests load with train's)
from mpipar.runner.cli import SCHEMES, check_model, parse_args
from mpipar.runner.reports import REPORTS, Report, scaler_lines, written


# ----------------------------------------------------------------------------- the loop
def check_paths(a):
    """Every output path and the resume directory, checked on world rank 0 before training
    (a bad path found after training would throw the run away); refused on every rank."""
    problem = None
    if MPI.COMM_WORLD.Get_rank() == 0:
        problem = path_problem(a)
    problem = comm.world().bcast_obj(problem, root=0, what="rank 0's verdict on the paths")
    if problem:
        comm.refuse(problem)


def path_problem(a):
    outputs = [("--save-params", a.save_params)]
    if getattr(a, "timeline", "none").lower() != "none":
        outputs.append(("--timeline", a.timeline))
    for flag, path in outputs:
        if path and (os.path.isdir(path) or not _writable(os.path.dirname(path) or ".")):
            return f"{flag} {path}: cannot write there (a folder, or no such writable folder)"
        if path:  # what a killed run's atomic write left
            checkpoint.remove_orphans(checkpoint.npz_path(path) if flag == "--save-params"
                                      else path)
    if a.checkpoint:
        try:
            os.makedirs(a.checkpoint, exist_ok=True)
        except OSError as err:
            return f"--checkpoint {a.checkpoint}: cannot make the folder ({err.strerror})"
        if not _writable(a.checkpoint):
            return f"--checkpoint {a.checkpoint}: the folder is not writable"
        if not checkpoint.lock(a.checkpoint):
            return (f"--checkpoint {a.checkpoint} is in use by another run: wait for it to end, "
                    "or use another folder")
        same = a.resume and os.path.realpath(a.checkpoint) in (
            os.path.realpath(a.resume), os.path.dirname(os.path.realpath(a.resume)))
        if checkpoint.checkpoints(a.checkpoint) and not same:
            return (f"--checkpoint {a.checkpoint} holds another run's checkpoints: continue it "
                    f"with --resume {a.checkpoint}, or use an empty folder")
    if a.resume and not os.path.isdir(a.resume):
        return f"--resume {a.resume}: no such folder"
    return None


def _writable(folder):
    return os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK)


def trainer_class(scheme, a):
    """The trainer class of the scheme and variant the flags name (imported on demand)."""
    if scheme == "serial":
        return serial.Serial
    if scheme == "data_parallel":
        from mpipar import data_parallel as D
        if a.sync != "master" and a.zero >= 2:  # ZeRO-2 and -3 live in their own module
            from mpipar import zero as Z
            return Z.Zero2Scheme if a.zero == 2 else Z.Zero3Scheme
        return D.MasterScheme if a.sync == "master" else D.ZeroScheme if a.zero \
            else D.AllreduceScheme
    if scheme == "tensor_parallel":
        from mpipar import tensor_parallel as T
        return T.TensorParallel
    if scheme == "pipeline":
        from mpipar import pipeline as P
        return P.Pipeline
    if scheme == "expert_parallel":
        from mpipar import expert_parallel as E
        return E.ExpertParallel
    if scheme == "context_parallel":
        from mpipar import context_parallel as X
        return X.ContextParallel
    from mpipar import hybrid as H
    return H.Hybrid


def progress(steps, desc, quiet=False, start=0):
    """A tqdm progress bar over the steps from ``start`` (off with --quiet, and off world
    rank 0)."""
    from tqdm import tqdm

    return tqdm(range(start, steps), desc=desc, disable=quiet, file=sys.stderr,
                dynamic_ncols=True, initial=start, total=steps)


def train(trainer, a, desc, after_step=None, start=0, loss=None):
    """The one training loop: steps ``start`` to ``a.steps``, the loss on the bar (world rank
    0), every rank narrating the first step with --explain, a checkpoint every
    ``--checkpoint-every`` steps and at the end. A loss that is not finite stops every rank at
    once (each has the loss), before anything is saved. ``after_step()`` runs after each step
    (the pipeline's report reads the step's trace there). Returns the last loss."""
    rank = MPI.COMM_WORLD.Get_rank()
    bar = progress(a.steps, desc, a.quiet or rank != 0, start)
    saved = start if a.resume else None  # the step whose checkpoint exists already
    clipped = 0  # steps whose gradient norm was above --clip-grad (on world rank 0)
    for step in bar:
        comm.EXPLAIN = a.explain and step == start
        TRACE.clear()
        loss = trainer.step(step)
        if not math.isfinite(loss):
            comm.refuse(f"the loss is {loss} after step {step + 1}: training diverged (try a "
                        "smaller --lr); nothing was saved", code=3)
        clipped += bool(a.clip_grad) and getattr(trainer, "grad_norm", 0.0) > a.clip_grad
        if after_step is not None:
            after_step()
        if rank == 0:
            bar.set_postfix(loss=f"{loss:.4f}")
            if a.log_every and (step + 1) % a.log_every == 0:
                bar.write(f"step {step + 1:5d}  loss {loss:.4f}\n", end="")  # one write
        if a.checkpoint_every and (step + 1) % a.checkpoint_every == 0:
            checkpoint.save(a.checkpoint, trainer, a, step + 1, loss)
            saved = step + 1
    comm.EXPLAIN = False
    if a.clip_grad:
        comm.log(f"gradient norm above --clip-grad {a.clip_grad:g}, so scaled down, in {clipped} "
                 f"of {a.steps - start} steps")
    if a.checkpoint and saved != a.steps:
        checkpoint.save(a.checkpoint, trainer, a, a.steps, loss)
    checkpoint.unlock()  # the folder is free for the next run
    return loss


def final_line(metrics, loss):
    parts = [f"final train loss {loss:.4f}"]
    parts += [f"{k.replace('_', ' ')} {v:.4f}" for k, v in metrics.items()]
    return ", ".join(parts)


def main(scheme, argv=None, trainer_cls=None):
    """Run ``scheme`` with the command line ``argv``: parse and check, build, train, finish.
    ``trainer_cls``: a trainer of one's own (:mod:`mpipar.runner.trainer`) in place of the
    scheme's, taking the scheme's flags and grid, and the plain report."""
    comm.install_excepthook()
    B.steady_heap()  # a step reuses the memory pages of the step before
    a = parse_args(scheme, argv)
    if scheme == "pipeline" and a.print_schedule:
        comm.log(format_schedule(a.schedule, a.stages, a.micro_batches, a.chunks,
                                 a.warmup or "production"))
        return
    comm.start_watchdog(a.timeout)  # from the first collective on, a rank that waits longer
    check_paths(a)  # in one call ends the job
    comm.choose_wait(long_waits=scheme == "pipeline")  # a stage waits a micro-batch's compute
    task = serial.Task(a)
    check_model(scheme, a, task)
    comm.EXPLAIN = a.explain
    if scheme == "hybrid":  # its Step 1 is carving the grid, so the scheme file does it
        from mpipar.hybrid import make_grid
        grid = make_grid(a.dp, a.tp, a.pp, ep=a.ep if a.experts else None, cp=a.cp)
    elif scheme == "expert_parallel":  # its Step 1 too: the ep and expert-replica groups
        from mpipar.expert_parallel import make_grid
        grid = make_grid(a.ep)
    elif scheme == "context_parallel":  # its Step 1 too: the cp groups
        from mpipar.context_parallel import make_grid
        grid = make_grid(a.cp)
    else:
        grid = None if scheme == "serial" else Grid(a.dp, a.tp, a.pp)
    if scheme == "hybrid" and a.print_grid:
        text = grid.describe()
        comm.log(f"grid dp {grid.dp_size} x tp {grid.tp_size} x pp {grid.pp_size} = "
                 f"{grid.world.size} ranks; world_rank = dp*{grid.pp_size * grid.tp_size} + "
                 f"pp*{grid.tp_size} + tp\n{text}")
        return
    trainer = (trainer_cls or trainer_class(scheme, a))(task, grid, a)
    if a.recompute:
        recompute.apply(trainer, a.recompute)
    if a.clip_grad:
        clip.apply(trainer, a.clip_grad)
    start, loss = checkpoint.load(a.resume, trainer, a) if a.resume else (0, None)
    report = (Report if trainer_cls else REPORTS[scheme])(a, task, trainer, grid, start)
    probe = memory.Probe(trainer) if a.memory else None  # counts through the first step
    comm.log(report.header() + (f"\n{B.describe()}" if a.backend == "cupy" else "")
             + (f"\nresumed from {a.resume} after step {start}" if a.resume else ""))
    with np.errstate(over="ignore", invalid="ignore"):  # a diverging run stops with one line
        loss = train(trainer, a, report.desc, report.after_step, start, loss)
    comm.EXPLAIN = a.explain
    params = trainer.full_params()  # narrated: a scheme's last step gathers the model
    comm.EXPLAIN = False
    lines = report.lines()  # a collective: every rank takes part
    lines[1].extend(scaler_lines(getattr(trainer, "scaler", None), a.steps - start))
    if probe is not None:  # a collective too: the table of every rank's ledger
        lines[1].extend(memory.lines(probe, a, task, grid))
    if MPI.COMM_WORLD.Get_rank() == 0:
        finish(a, task, report, lines, params, loss)


def finish(a, task, report, lines, params, loss):
    """World rank 0, after training: the report's lines around the final loss and metrics,
    then the parameters saved; a failed output ends the run with one line and code 1."""
    before, after = lines
    for line in before:
        comm.log(line)
    comm.log(final_line(task.evaluate(task.model_with(params).forward), loss))
    for line in after + [B.staged_line()] * (a.backend == "cupy"):
        comm.log(line)
    bad = [name for name, value in params.items() if not np.isfinite(value).all()]
    if bad:  # the loss was finite, but a parameter is not: never save such a model
        comm.refuse(f"parameters {', '.join(bad[:3])} are not finite: nothing was saved", code=3)
    if a.save_params:
        path, problem = written("--save-params", a.save_params,
                                lambda: save_params(a.save_params, params.items()))
        if problem:
            report.failed.append(problem)
        else:
            comm.log(f"saved parameters to {path}")
    if report.failed:  # every output that could be written is; then one line, code 1
        comm.refuse("; ".join(report.failed), code=1)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in SCHEMES:
        sys.stderr.write(f"usage: python -m mpipar.train {{{','.join(SCHEMES)}}} [flags]\n")
        sys.exit(2)
    main(sys.argv[1], sys.argv[2:])
