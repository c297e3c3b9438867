"""mpirun -n N python tests/mpi/hybrid_checks.py: the 3D hybrid against the serial trainer.

For every layout (D, T, P) of the job's N ranks that the suite names (4 ranks: (2,1,2),
(1,2,2), (2,2,1); 8 ranks: (2,2,2)), with GPipe and 1F1B, float64, one grid per layout carved
from COMM_WORLD in this one launch; checked on every rank:
- the loss of every step equals the serial trainer's, and after 3 steps every parameter this
  rank holds equals its slice of the serial parameter (relative error <= 1e-10);
- the data-parallel replicas are bitwise identical, and so are the tensor-parallel copies of
  the replicated parameters;
- the tp and pp bytes of a step equal the module docstring's formula;
- the gradients cross dp_comm ONCE per step (one Allreduce of this rank's gradient bytes),
  after the stage's last backward; with --overlap, one Iallreduce per bucket;
- the model gathered to world rank 0 is the whole serial model under the serial names, and
  the comparison would catch a one-element slip.
Also a GPT with buckets and overlap, an MLP whose stage boundary cuts a column/row pair
(the activation between the stages is split over the tp ranks), ZeRO-1 over the dp groups
(--zero 1: one Reduce_scatter and one Allgather of the padded flat buffer after the last
backward, each rank's optimizer state 1/D of its piece's), also with --sequence-parallel, and
ZeRO-2 (--zero 2: per bucket, one Reduce_scatter, or with --overlap D-1 Isend and Irecv of one
block started during the last backward, and one Allgather: Reduce_scatter Psi + Allgather Psi;
between steps a rank holds its shards' gradients only, no full gradient).
"""

import hashlib
import sys

import numpy as np
from reference import make_task, serial_run

from mpipar import hybrid as H
from mpipar import serial
from mpipar.engine import backend as B
from mpipar.mpi import comm as C
from mpipar.mpi.trace import TRACE
from mpipar.parts import tp_layers
from mpipar.runner import memory
from mpipar.runner.cli import parse_args

TRACE.calls = True  # the checks read each MPI call's span
C.install_excepthook()
world = C.world()
N, RANK = world.size, world.rank
STEPS, TOL, W = 3, 1e-10, 8  # W: bytes per float64
GPT = ["--model", "gpt", "--d-model", "8", "--n-heads", "2", "--n-layers", "2", "--seq-len",
       "8", "--batch-size", "8"]
MLP = ["--model", "mlp", "--sizes", "64,16,16,10", "--batch-size", "8"]
LAYOUTS = {4: [(2, 1, 2), (1, 2, 2), (2, 2, 1)], 8: [(2, 2, 2)]}[N]
EXTRA = {  # (layout, schedule, model flags, extra flags)
    4: [((1, 2, 2), "gpipe", MLP, []), ((2, 1, 2), "1f1b", GPT, ["--bucket-mb", "0.001",
                                                                  "--overlap"]),
        ((2, 1, 2), "1f1b", GPT, ["--zero", "1"]), ((2, 2, 1), "gpipe", MLP, ["--zero", "1"]),
        ((2, 2, 1), "1f1b", GPT, ["--zero", "1", "--sequence-parallel"]),
        ((2, 1, 2), "1f1b", GPT, ["--zero", "2", "--optim", "adam"]),
        ((2, 2, 1), "gpipe", MLP, ["--zero", "2", "--bucket-mb", "0.002", "--overlap"]),
        ((2, 2, 1), "gpipe", GPT, ["--zero", "2", "--bucket-mb", "0.002", "--sequence-parallel"])],
    8: [((2, 2, 2), "1f1b", GPT, ["--bucket-mb", "0.001", "--overlap"]),
        ((2, 2, 2), "gpipe", GPT, ["--zero", "1"]),
        ((2, 2, 2), "1f1b", GPT, ["--zero", "2", "--bucket-mb", "0.001", "--overlap"])],
}[N]
TASKS, REFS = {}, {}


def task_for(flags):
    """One Task (and its data) per model, shared by the layouts."""
    key = tuple(flags)
    if key not in TASKS:
        TASKS[key] = make_task(flags + ["--dtype", "float64"])
    return TASKS[key]


def reference(flags):
    """The serial trainer's losses per step and parameters after STEPS steps."""
    key = tuple(flags)
    if key not in REFS:
        REFS[key] = serial_run(task_for(flags), STEPS)[:2]
    return REFS[key]


def rel_err(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def digest(params):
    return hashlib.sha256(b"".join(B.to_numpy(p.data).tobytes() for p in params)).hexdigest()


def check_traffic(trainer, name):
    """A GPT step's tp and pp bytes equal the module docstring's formula: per micro-batch of r
    rows, 4 Allreduces of r*s*h numbers per block (+1 embedding, +1 output layer and 3 of r*s
    for the cross-entropy), and one activation or gradient of r*s*h numbers (+ an 80-byte
    header) per send across a stage boundary, plus the loss (8 bytes) to stage 0."""
    a, g = trainer.args, trainer.grid
    lo, hi = trainer.bounds[trainer.stage_id]
    n_blocks = sum(n.startswith("blocks.") for n in trainer.layer_names[lo:hi])
    first, last = trainer.is_first_stage, trainer.is_last_stage
    act = [r * a.seq_len * a.d_model * W for r in trainer.micro_rows]
    tp = 0 if g.tp_size == 1 else (4 * n_blocks + first + last) * sum(act) \
        + last * 3 * sum(r * a.seq_len * W for r in trainer.micro_rows)
    pp = 0 if g.pp_size == 1 else ((not first) + (not last)) * sum(n + 80 for n in act) \
        + 8 * last
    assert trainer.tp_comm.total("sent") == tp, (name, trainer.tp_comm.total("sent"), tp)
    assert trainer.pp_comm.total("sent") == pp, (name, trainer.pp_comm.total("sent"), pp)


def check_sync(trainer, name):
    """One step's traffic over dp_comm: one Allreduce per bucket of exactly this rank's
    gradient bytes, none of it before the stage's last backward unless overlapped."""
    params = trainer.stage.parameters()
    stats = trainer.dp_comm.stats
    if trainer.grid.dp_size == 1:
        assert trainer.update.sync is None and not stats, (name, dict(stats))
        return
    want = sum(p.data.nbytes for p in params)
    last_backward = max(e[1] for e in TRACE.events if e[2] == "backward")
    dp_calls = [e for e in TRACE.events if e[2] == "comm" and e[4].get("comm") == "dp"]
    if trainer.args.zero == 2:
        check_zero_2(trainer, name, want, last_backward, dp_calls)
        return
    if trainer.args.zero:  # one Reduce_scatter and one Allgather of the padded flat buffer
        zero, d = trainer.update.zero, trainer.grid.dp_size
        assert set(stats) == {"Reduce_scatter", "Allgather"}, (name, set(stats))
        assert stats["Reduce_scatter"]["calls"] == stats["Allgather"]["calls"] == 1, name
        assert stats["Reduce_scatter"]["sent"] == zero.flat.nbytes == d * zero.shard.data.nbytes
        assert 0 <= zero.flat.nbytes - want < d * W, (name, zero.flat.nbytes, want)
        assert all(e[0] >= last_backward for e in dp_calls), f"{name}: dp sync before backward"
        return
    n_buckets = len(trainer.update.sync.buckets)
    assert stats["Allreduce"]["calls"] == n_buckets, (name, dict(stats["Allreduce"]))
    assert stats["Allreduce"]["sent"] == want, (name, stats["Allreduce"]["sent"], want)
    assert set(stats) == {"Allreduce"}, (name, set(stats))
    if trainer.args.overlap:
        assert n_buckets > 1, (name, "overlap test needs several buckets")
        launched_after = trainer.update.sync.launch_log  # gradients final at each launch
        assert launched_after[0] < len(params), (name, "no bucket started during backward")
    else:
        assert all(e[0] >= last_backward for e in dp_calls), f"{name}: dp sync before backward"


def check_zero_2(trainer, name, want, last_backward, dp_calls):
    """ZeRO-2's step over dp_comm, per bucket: one Reduce_scatter (or, with --overlap, D-1
    Isend and Irecv of one block, the first started before the backward ends) and one Allgather:
    Reduce_scatter Psi + Allgather Psi, Psi the padded flat buffers. After it this rank holds
    its shards' gradients and no full one."""
    stats, buckets, d = trainer.dp_comm.stats, trainer.update.sharded, trainer.grid.dp_size
    sizes = [d * b.shard_size * W for b in buckets]  # each flat buffer, padded, in bytes
    psi, ops = sum(sizes), set(stats)
    assert sum(b.n for b in buckets) * W == want, (name, "a parameter is in no bucket")
    assert all(0 <= size - b.n * W < d * W for size, b in zip(sizes, buckets)), (name, sizes)
    assert stats["Allgather"]["calls"] == len(buckets), (name, dict(stats["Allgather"]))
    assert stats["Allgather"]["sent"] + stats["Allgather"]["recv"] == psi, name
    if trainer.args.overlap:
        assert ops == {"Send", "Recv", "Allgather"} and len(buckets) > 1, (name, ops)
        assert stats["Send"]["messages"] == (d - 1) * len(buckets), name
        assert stats["Send"]["sent"] == stats["Recv"]["recv"] == (d - 1) * psi // d, name
        log = trainer.update.sync.launch_log  # gradients final as each bucket launched
        assert 0 < log[0] < len(trainer.stage.parameters()), (name, log)
    else:
        assert ops == {"Reduce_scatter", "Allgather"}, (name, ops)
        assert stats["Reduce_scatter"]["calls"] == len(buckets), name
        assert stats["Reduce_scatter"]["sent"] == psi, (name, stats["Reduce_scatter"]["sent"])
        assert all(e[0] >= last_backward for e in dp_calls), f"{name}: dp sync before backward"
    held = memory.count(memory.arrays_of(trainer))["grads"]  # every gradient it references
    assert held == sum(b.shard_size for b in buckets) * W, (name, held)
    assert all(p.grad is None for p in trainer.stage.parameters()), name


def check(layout, schedule, flags, extra=()):
    d, t, p = layout
    name = f"{flags[1]} dp={d} tp={t} pp={p} {schedule} {' '.join(extra)}"
    ref_losses, ref_params = reference(flags)
    task = task_for(flags)
    args = parse_args("hybrid", flags + ["--dtype", "float64", "--dp", str(d), "--tp", str(t),
                                         "--pp", str(p), "--schedule", schedule,
                                         "--micro-batches", "2", *extra], N)
    if args.sequence_parallel:  # the task's flags choose the tp model: the hybrid's, here
        task = serial.Task(args, task.data)
    grid = H.make_grid(d, t, p)
    trainer = H.Hybrid(task, grid, args)
    marked = any(getattr(q, "sequence_parallel", False) for q in trainer.stage.parameters())
    assert marked == args.sequence_parallel, (name, "the model is not the one the flags ask for")
    for step in range(STEPS):
        for group in (grid.dp_comm, grid.tp_comm, grid.pp_comm):
            group.reset_stats()
        TRACE.clear()
        loss = trainer.step(step)
        check_sync(trainer, name)
        if task.kind == "gpt" and not args.sequence_parallel:  # sp_checks counts SP's bytes
            check_traffic(trainer, name)
        if RANK == 0:
            assert abs(loss - ref_losses[step]) <= 1e-12 * abs(ref_losses[step]), \
                (name, step, loss, ref_losses[step])
    assert trainer.stage.cached_bytes() == 0, (name, "activations left in the cache")
    for pname, prm in trainer.stage.named_parameters():  # this rank's piece, as it is
        want = prm.select(ref_params[pname], prm.rank) if tp_layers.is_sharded(prm) \
            else ref_params[pname]
        err = rel_err(B.to_numpy(prm.data), want)
        assert err <= TOL, f"{name}: rank {RANK} {pname} relative error {err:.2e}"
    mine = digest(trainer.stage.parameters())
    assert set(grid.dp_comm.allgather_obj(mine)) == {mine}, f"{name}: dp replicas differ"
    if args.zero:  # each rank's optimizer state: 1/D of its piece's, plus the padding
        sharded, n = trainer.update.sharded, sum(q.size for q in trainer.stage.parameters())
        kept = sum(z.shard_size for z in sharded)  # ZeRO-1: one shard, ZeRO-2: one per bucket
        kinds = len(trainer.update.opt.new_state(sharded[0].shard))  # SGD's momentum, Adam's m, v
        assert trainer.update.opt.state_bytes() == kinds * W * kept > 0, name
        assert 0 <= kept * d - n < d * len(sharded), (name, kept, n)
    _, replicated = tp_layers.split_parameters(trainer.stage)
    mine = digest(replicated)
    assert set(grid.tp_comm.allgather_obj(mine)) == {mine}, f"{name}: tp copies differ"
    full = H.gather_model(task, trainer)
    if RANK != 0:
        assert full is None, (name, RANK)
        return
    assert list(full) == list(ref_params), (name, list(full))
    for pname, value in full.items():
        err = rel_err(value, ref_params[pname])
        assert err <= TOL, f"{name}: gathered {pname} relative error {err:.2e}"
    pname = list(full)[len(full) // 2]  # the check catches a one-element slip of 1e-9
    bad = full[pname].copy()
    bad.flat[bad.size // 2] += 1e-9 * np.abs(bad).max()
    assert rel_err(bad, ref_params[pname]) > TOL


B.use("numpy", "float64")
for layout in LAYOUTS:
    for schedule in ("gpipe", "1f1b"):
        check(layout, schedule, GPT)
for layout, schedule, flags, extra in EXTRA:
    check(layout, schedule, flags, extra)
world.Barrier()
C.log(f"hybrid checks passed on {N} ranks")
sys.exit(0)
