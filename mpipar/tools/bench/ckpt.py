"""How long a checkpoint takes to write and to read back, per rank, against the model's size.

    python -m mpipar.tools.bench ckpt   # ckpt.csv and ckpt.png in --out (see mpipar.tools.bench)

The GPT of the lessons (2 blocks) at widths 64 to 512 with Adam (so every parameter has two
moments beside it), trained one step, then checkpointed with :func:`mpipar.runner.checkpoint.save`
and read back with :func:`mpipar.runner.checkpoint.load`, on one process and as a 2-stage pipeline
(each stage writes its own file, as every scheme does). Times are each rank's own, from a
barrier; the write includes the flush to disk (``fsync``) and the rank-0 manifest with every
file's SHA-256; the read includes rank 0's check of every file's SHA-256. The machine's page
cache makes a read of a file just written fast; a cold read from disk would be slower.
"""

import os
import shutil
import statistics
import tempfile
import time

from mpipar.tools.bench.common import (
    bench_parser,
    emit,
    environment,
    number,
    pyplot,
    run_ranks,
    save_figure,
    write_csv,
    wrote,
)

WIDTHS = (64, 128, 256, 512)
RANKS = ((1, "serial"), (2, "pipeline"))


def worker(scheme, widths, repeats):
    from mpi4py import MPI

    from mpipar import serial
    from mpipar.mpi import comm
    from mpipar.mpi.grid import Grid
    from mpipar.runner import checkpoint
    from mpipar.runner.cli import parse_args
    from mpipar.train import trainer_class

    comm.install_excepthook()
    world = MPI.COMM_WORLD
    for h in widths:
        flags = ["--model", "gpt", "--d-model", str(h), "--n-heads", "4", "--n-layers", "2",
                 "--optim", "adam", "--steps", "1", "--batch-size", "8", "--keep", "1"]
        a = parse_args(scheme, flags + (["--timeline", "none"] if scheme == "pipeline" else []))
        task = serial.Task(a)
        grid = Grid(pp=world.size) if scheme == "pipeline" else None
        trainer = trainer_class(scheme, a)(task, grid, a)
        trainer.step(0)
        folder = tempfile.mkdtemp(prefix="mpipar-ckpt-") if world.rank == 0 else None
        folder = world.bcast(folder)
        writes, reads = [], []
        for _ in range(repeats):
            world.barrier()
            t0 = time.perf_counter()
            path = checkpoint.save(folder, trainer, a, 1, 0.0)
            writes.append(time.perf_counter() - t0)
            world.barrier()
            t0 = time.perf_counter()
            checkpoint.load(folder, trainer, a)
            reads.append(time.perf_counter() - t0)
        mine = os.path.getsize(os.path.join(path, f"rank-{world.rank:05d}.npz"))
        rows = world.gather((statistics.median(writes), min(writes), max(writes),
                             statistics.median(reads), mine))
        if world.rank == 0:
            n = sum(p.size for p in task.build_model().parameters())
            emit(dict(width=h, params=n, ranks=world.size, scheme=scheme,
                      per_rank=[list(r) for r in rows]))
            shutil.rmtree(folder, ignore_errors=True)


def plot(rows, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for scheme, marker in (("serial", "o"), ("pipeline", "s")):
        mine = [r for r in rows if r["scheme"] == scheme]
        mb = [float(r["bytes_per_rank_max"]) / 2**20 for r in mine]
        ax.plot(mb, [float(r["write_ms"]) for r in mine], marker=marker, label=f"write, {scheme}")
        ax.plot(mb, [float(r["read_ms"]) for r in mine], marker=marker, ls="--",
                label=f"read, {scheme}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("MiB written by the busiest rank (parameters and Adam's two moments)")
    ax.set_ylabel("ms per checkpoint (slowest rank)")
    ax.set_title("Checkpoint write and read time against the model's size")
    ax.legend()
    return save_figure(fig, path)


def main(argv=None):
    ap = bench_parser("ckpt")
    ap.sized("--repeats", 5, 2, type=number(), help="writes and reads per size (median)")
    ap.add_argument("--scheme", default="serial", choices=[s for _, s in RANKS],
                    help="worker only")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.scheme, WIDTHS, args.repeats)
        return
    rows = []
    for ranks, scheme in RANKS:
        for res in run_ranks(ranks, "mpipar.tools.bench.ckpt", ["--worker", "--scheme", scheme,
                                                          "--repeats", args.repeats]):
            per = res["per_rank"]
            rows.append(dict(environment(ranks), bench="ckpt", scheme=scheme,
                             model=f"gpt d{res['width']} h4 L2, adam", params=res["params"],
                             write_ms=round(1e3 * max(r[0] for r in per), 3),
                             write_ms_min=round(1e3 * max(r[1] for r in per), 3),
                             write_ms_max=round(1e3 * max(r[2] for r in per), 3),
                             read_ms=round(1e3 * max(r[3] for r in per), 3),
                             bytes_per_rank_max=max(r[4] for r in per),
                             bytes_total=sum(r[4] for r in per), repeats=args.repeats))
    path = write_csv("ckpt.csv", rows, args.out)
    for r in rows:
        print(f"{r['scheme']:<8} {r['params']:>10,} parameters: {r['bytes_total'] / 2**20:7.2f} "
              f"MiB written, write {r['write_ms']:8.2f} ms ({r['write_ms_min']:.2f}.."
              f"{r['write_ms_max']:.2f}), read {r['read_ms']:8.2f} ms")
    wrote(path, plot(rows, args.out / "ckpt.png"))


if __name__ == "__main__":
    main()
