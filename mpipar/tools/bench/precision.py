"""Training in 16 bits against float32: the loss curves, and the bytes of a gradient sum.

    python -m mpipar.tools.bench precision   # precision.csv and precision.png in --out

The GPT of the lessons (114,270 parameters, Adam) trained ``--steps`` steps by the serial
trainer with ``--precision`` fp32, bf16 and fp16 from one seed, each in a process of its own
(the storage type is the process's); every step's loss and the final validation loss are
recorded. Then one step of data parallelism on 4 ranks in bf16 with each gradient sum, whose
Comm.stats give the bytes a rank sends: the float32 sum widens the bf16 gradients (4 bytes
each), the bf16 sum sends the 2-byte words. Nothing here is timed: the losses and bytes are
the same on every run on the same machine.
"""

from mpipar.tools.bench.common import (
    bench_parser,
    emit,
    environment,
    pyplot,
    run_ranks,
    save_figure,
    write_csv,
    wrote,
)

PRECISIONS = ("fp32", "bf16", "fp16")
FLAGS = ["--model", "gpt", "--quiet"]


def worker(precision, steps, scheme):
    from mpipar import serial
    from mpipar.data_parallel import AllreduceScheme
    from mpipar.mpi import comm
    from mpipar.mpi.grid import Grid
    from mpipar.runner.cli import parse_args

    comm.install_excepthook()
    if scheme == "serial":
        a = parse_args("serial", FLAGS + ["--precision", precision, "--steps", str(steps)])
        task = serial.Task(a)
        trainer = serial.Serial(task, None, a)
        losses = [trainer.step(s) for s in range(steps)]
        params = trainer.full_params()
        val = task.evaluate(task.model_with(params).forward)["val_loss"]
        emit(dict(precision=precision, losses=losses, val_loss=val,
                  skipped=trainer.scaler.skipped if trainer.scaler else 0))
        return
    a = parse_args("data_parallel", FLAGS + ["--precision", "bf16", "--sync", "allreduce",
                                             "--grad-sum", precision, "--steps", "1"])
    trainer = AllreduceScheme(serial.Task(a), Grid(dp=4), a)
    trainer.comm.reset_stats()
    trainer.step(0)
    sent = trainer.comm.stats["Allreduce"]["sent"]
    if trainer.comm.rank == 0:
        emit(dict(grad_sum=precision, sent=sent, gradients=sum(p.size for p in trainer.params)))


def plot(rows, path):
    plt = pyplot()
    fig, (ax, diff) = plt.subplots(1, 2, figsize=(11, 4))
    curves = {p: [float(r["loss"]) for r in rows if r["kind"] == "loss" and r["precision"] == p]
              for p in PRECISIONS}
    steps = range(1, len(curves["fp32"]) + 1)
    for precision, style in zip(PRECISIONS, ("-", "--", ":")):
        ax.plot(steps, curves[precision], style, label=f"--precision {precision}")
        if precision != "fp32":
            diff.plot(steps, [a - b for a, b in zip(curves[precision], curves["fp32"])], style,
                      label=f"{precision} - fp32")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("The serial GPT in float32, bf16 and fp16 (one seed)", fontsize=10)
    ax.legend()
    diff.axhline(0, color="black", lw=0.5)
    diff.set_xlabel("step")
    diff.set_ylabel("training loss minus fp32's, same step")
    diff.set_title("How far the 16-bit runs drift", fontsize=10)
    diff.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv=None):
    ap = bench_parser("precision")
    ap.sized("--steps", 250, 20, type=int, help="training steps of each serial run")
    ap.add_argument("--precision", default="fp32", help="worker only")
    ap.add_argument("--scheme", default="serial", help="worker only")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.precision, args.steps, args.scheme)
        return
    rows = []
    for precision in PRECISIONS:
        (r,) = run_ranks(1, "mpipar.tools.bench.precision",
                         ["--worker", "--precision", precision, "--steps", args.steps])
        rows += [dict(environment(1), bench="precision", kind="loss", precision=precision,
                      step=i + 1, loss=round(loss, 6)) for i, loss in enumerate(r["losses"])]
        rows.append(dict(environment(1), bench="precision", kind="final", precision=precision,
                         step=args.steps, loss=round(r["losses"][-1], 6),
                         val_loss=round(r["val_loss"], 6), skipped=r["skipped"]))
    for grad_sum in ("fp32", "bf16"):
        (r,) = run_ranks(4, "mpipar.tools.bench.precision",
                         ["--worker", "--precision", grad_sum, "--scheme", "data_parallel"])
        rows.append(dict(environment(4), bench="precision", kind="grad_sum",
                         precision=grad_sum, sent_bytes=r["sent"], gradients=r["gradients"]))
    path = write_csv("precision.csv", rows, args.out)
    for r in rows:
        if r["kind"] == "final":
            print(f"--precision {r['precision']}: after {r['step']} steps train loss "
                  f"{r['loss']:.4f}, val loss {r['val_loss']:.4f}, {r['skipped']} skipped")
        elif r["kind"] == "grad_sum":
            print(f"--grad-sum {r['precision']}: {r['sent_bytes']:,} bytes a rank for "
                  f"{r['gradients']:,} bf16 gradients")
    wrote(path, plot(rows, args.out / "precision.png"))


if __name__ == "__main__":
    main()
