"""Hybrid 3D parallelism: every DP x TP x PP layout of 4 ranks on the same GPT, with its step
time, the memory each rank holds and the bytes each group type moves.

    python -m mpipar.tools.bench hybrid   # hybrid.csv and hybrid.png in --out

The GPT (d_model 128, 4 heads, 4 blocks, context 64, vocabulary of the text data; global batch
32, 4 micro-batches per replica, float32, Adam, one BLAS thread per rank) is trained by
:class:`mpipar.hybrid.Hybrid` in each layout of ``mpipar.mpi.grid.layouts(4)``: (1,1,4), (1,2,2),
(1,4,1), (2,1,2), (2,2,1), (4,1,1) as (dp, tp, pp), 1F1B. One launch of 4 ranks builds every
layout's trainer on its own grid, warms each up, then times them in interleaved rounds (so the
load of other work hits every layout alike): barrier, one step, the slowest rank's time; the
median over rounds (and over two launches). 4 ranks on 2 cores are oversubscribed: every row
says so, and the ratios between layouts, not the absolute times, are the result.

Per rank it records (from :meth:`mpipar.hybrid.Hybrid.memory` and each group's
``Comm.stats``):

- parameter, gradient and optimizer-state bytes, and the peak bytes of activations the stage
  stashed for backward (over the micro-batches in flight);
- bytes sent per step over tp_comm, pp_comm and dp_comm (the counted logical payload: an
  Allreduce of n bytes counts n), and the time spent inside each group's MPI calls (a
  pipeline receive includes the wait for the other stage, so it holds part of the bubble).

A row per layout holds the largest rank's memory (by total) and the mean per rank of the
bytes sent; ``per_rank_bytes`` lists every rank's total. The serial trainer's step on the same
model and batch is timed in the driver, for the ratio ``serial_over_step``.
"""

import argparse
import json
import statistics

from mpipar.tools.bench.common import (
    bench_parser,
    cores,
    environment,
    median_time,
    number,
    pyplot,
    run_ranks,
    save_figure,
    write_csv,
    wrote,
)

MODEL = ["--model", "gpt", "--d-model", "128", "--n-heads", "4", "--n-layers", "4",
         "--seq-len", "64", "--batch-size", "32", "--dtype", "float32", "--quiet"]
MICRO, SCHEDULE, RANKS = 4, "1f1b", 4
GROUPS = ("tp", "pp", "dp")
MEMORY = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes")


def label(d, t, p):
    return f"DP{d} TP{t} PP{p}"


# ----------------------------------------------------------------------------- worker (mpirun)
def worker(rounds, warmup):
    from mpi4py import MPI

    from mpipar import hybrid as H
    from mpipar import serial
    from mpipar.mpi import comm as C
    from mpipar.mpi.grid import layouts
    from mpipar.mpi.trace import TRACE
    from mpipar.runner.cli import parse_args
    from mpipar.tools.bench.common import emit

    TRACE.calls = True  # each group's MPI time is read from the calls' spans
    C.install_excepthook()
    world = C.world()
    task, trainers = None, {}
    for d, t, p in layouts(world.size):
        args = parse_args("hybrid", MODEL + ["--dp", str(d), "--tp", str(t), "--pp", str(p),
                                             "--micro-batches", str(MICRO), "--schedule",
                                             SCHEDULE], world.size)
        task = serial.Task(args, task and task.data)  # the data depends on the model flags only
        trainers[(d, t, p)] = H.Hybrid(task, H.make_grid(d, t, p), args)
    step = 0
    for trainer in trainers.values():
        for _ in range(warmup):
            trainer.step(step)
            step += 1
    samples = {layout: [] for layout in trainers}
    traffic = {}
    for _ in range(rounds):
        for layout, trainer in trainers.items():
            groups = {"tp": trainer.tp_comm, "pp": trainer.pp_comm, "dp": trainer.dp_comm}
            for group in groups.values():
                group.reset_stats()
            world.Barrier()
            TRACE.clear()
            t0 = MPI.Wtime()
            trainer.step(step)
            elapsed = MPI.Wtime() - t0
            step += 1
            mpi_time = {g: sum(e[1] - e[0] for e in TRACE.events
                               if e[2] == "comm" and e[4].get("comm") == g) for g in GROUPS}
            sent = {g: groups[g].total("sent") for g in GROUPS}
            per_rank = world.allgather_obj((elapsed, sent, mpi_time))
            samples[layout].append(max(v[0] for v in per_rank))
            traffic[layout] = per_rank  # the same bytes every step; the last step's times
    memory = {layout: world.gather_obj(trainer.memory()) for layout, trainer in trainers.items()}
    if world.rank == 0:
        for layout, trainer in trainers.items():
            emit({"layout": list(layout), "samples": samples[layout],
                  "sent": [v[1] for v in traffic[layout]],
                  "mpi_time": [v[2] for v in traffic[layout]],
                  "memory": memory[layout], "rows_per_replica": trainer.rows,
                  "stages": [list(b) for b in trainer.bounds]})


def serial_step_time(repeats):
    """The serial trainer's step on the same model and global batch, in this process."""
    from mpipar import serial
    from mpipar.runner.cli import parse_args

    args = parse_args("serial", MODEL)
    task = serial.Task(args)
    model = task.build_model().init(args.seed)
    opt = serial.make_optimizer(args, model.parameters())
    x, y = task.to_device(*task.batch(0))
    return median_time(lambda: serial.train_step(model, task.loss_fn, opt, x, y),
                       repeats=repeats, warmup=2)


# ----------------------------------------------------------------------------- driver
def plot(rows, path):
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    labels = [r["layout"] for r in rows]
    x = range(len(rows))
    ax = axes[0]
    ax.bar(x, [r["step_ms"] for r in rows], color="tab:blue")
    ax.axhline(rows[0]["serial_step_ms"], color="k", ls="--", lw=1,
               label="serial trainer (1 rank)")
    ax.set_ylabel("ms per step (slowest rank, median)")
    ax.set_title("step time" + (f" (4 ranks on {cores()} cores: oversubscribed)"
                                if rows[0]["oversubscribed"] else ""))
    ax.legend(fontsize=8)
    ax = axes[1]
    bottom = [0.0] * len(rows)
    for part in MEMORY:
        vals = [r[part] / 2**20 for r in rows]
        ax.bar(x, vals, bottom=bottom, label=part.replace("_bytes", ""))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("MiB on the rank that holds the most")
    ax.set_title("memory per rank")
    ax.legend(fontsize=8)
    ax = axes[2]
    bottom = [0.0] * len(rows)
    for g in GROUPS:
        vals = [r[f"{g}_bytes"] / 2**20 for r in rows]
        ax.bar(x, vals, bottom=bottom, label=f"{g} group")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("MiB sent per rank per step (mean over ranks)")
    ax.set_title("communication volume per group type")
    ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=8, rotation=20)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"every layout of {RANKS} ranks: GPT {rows[0]['params']:,} parameters, global "
                 f"batch {rows[0]['batch']}, {MICRO} micro-batches per replica, {SCHEDULE}, "
                 "float32, 1 BLAS thread/rank")
    save_figure(fig, path)
    return path


def main(argv=None):
    ap = bench_parser("hybrid", "one launch, few rounds")
    ap.sized("--rounds", 8, 2, type=number(), help="timed steps per layout and launch")
    ap.sized("--warmup", 2, 1, type=number(zero_ok=True), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.rounds, args.warmup)
        return

    rounds, warmup = args.rounds, args.warmup
    passes = 1 if args.quick else 2
    runs = {}
    for _ in range(passes):
        for res in run_ranks(RANKS, "mpipar.tools.bench.hybrid",
                             ["--worker", "--rounds", rounds, "--warmup", warmup]):
            key = tuple(res["layout"])
            if key in runs:
                runs[key]["samples"] += res["samples"]
            else:
                runs[key] = res
    serial_ms = serial_step_time(3 if args.quick else 7) * 1e3

    from mpipar import serial
    from mpipar.runner.cli import parse_args

    model_args = parse_args("serial", MODEL)
    params = sum(p.size for p in serial.Task(model_args).build_model().parameters())
    rows = []
    for (d, t, p), res in runs.items():
        step = statistics.median(res["samples"])
        totals = [sum(m[k] for k in MEMORY) for m in res["memory"]]
        largest = res["memory"][totals.index(max(totals))]
        row = dict(environment(ranks=RANKS), bench="hybrid",
                   model="gpt d128 h4 L4 s64", params=params, batch=model_args.batch_size,
                   micro_batches=MICRO, schedule=SCHEDULE, dtype="float32",
                   layout=label(d, t, p), dp=d, tp=t, pp=p,
                   step_ms=round(step * 1e3, 3), serial_step_ms=round(serial_ms, 3),
                   serial_over_step=round(serial_ms / (step * 1e3), 3))
        row.update({k: largest[k] for k in MEMORY})
        row.update(total_bytes_max=max(totals), total_bytes_min=min(totals))
        for g in GROUPS:
            sent = [s[g] for s in res["sent"]]
            row[f"{g}_bytes"] = round(statistics.mean(sent))
            row[f"{g}_bytes_max"] = max(sent)
            row[f"{g}_mpi_ms"] = round(1e3 * statistics.mean(m[g] for m in res["mpi_time"]), 3)
        row.update(per_rank_bytes=json.dumps(totals), stages=json.dumps(res["stages"]),
                   samples=len(res["samples"]))
        rows.append(row)
    path = write_csv("hybrid.csv", rows, args.out)
    png = plot(rows, args.out / "hybrid.png")
    print(f"serial step {serial_ms:.1f} ms;  {RANKS} ranks on {cores()} cores"
          + (" (oversubscribed)" if rows[0]["oversubscribed"] else ""))
    print(f"{'layout':<14} {'step ms':>8} {'serial/step':>11} {'MiB max':>8} {'MiB min':>8} "
          f"{'tp KiB':>8} {'pp KiB':>8} {'dp KiB':>8}")
    for r in rows:
        print(f"{r['layout']:<14} {r['step_ms']:8.1f} {r['serial_over_step']:11.2f} "
              f"{r['total_bytes_max'] / 2**20:8.2f} {r['total_bytes_min'] / 2**20:8.2f} "
              + " ".join(f"{r[f'{g}_bytes'] / 2**10:8.0f}" for g in GROUPS))
    wrote(path, png)


if __name__ == "__main__":
    main()
