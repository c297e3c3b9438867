"""mpirun -n P python tests/mpi/dp_checks.py: every data-parallel mode against the serial trainer.

For the MLP and a tiny GPT, each with a global batch that 3 and 4 do not divide, and every mode:
the first Bcast overwrites workers built from another seed; the replicas are bitwise identical
after every step; each step moves exactly the bytes of the formula; after 3 steps the losses and
every parameter equal the serial trainer's (relative error <= 1e-10). Then the hand-written ring
alone: equal to MPI's Allreduce, 2(P-1) messages, 2(P-1)/P n bytes.
"""

import hashlib

import numpy as np
from reference import BUCKET, MODELS, serial_run

from mpipar import data_parallel as DP
from mpipar import serial
from mpipar.engine import backend as B
from mpipar.mpi import comm as C
from mpipar.mpi.grid import Grid
from mpipar.runner.cli import parse_args
from mpipar.train import trainer_class

C.install_excepthook()
grid = Grid(dp=C.world().size)
dp_comm = grid.dp_comm
P, r = dp_comm.size, dp_comm.rank
STEPS = 3
TOL = 1e-10
COMMON = ["--dtype", "float64", "--steps", str(STEPS), "--quiet"]
MODES = {
    "master": [],
    "master, 2 micro-batches": ["--micro-batches", "2"],
    "allreduce": ["--sync", "allreduce"],
    "ring": ["--sync", "ring"],
    "ring, buckets": ["--sync", "ring", *BUCKET],
    "allreduce, buckets": ["--sync", "allreduce", *BUCKET],
    "allreduce, buckets, overlap": ["--sync", "allreduce", *BUCKET, "--overlap"],
    "overlap, 2 micro-batches": ["--sync", "allreduce", *BUCKET, "--overlap",
                                 "--micro-batches", "2"],
    "zero 1, adam": ["--sync", "allreduce", "--zero", "1", "--optim", "adam"],
}


def digest(params):
    h = hashlib.sha256()
    for p in params:
        h.update(B.to_numpy(p.data).tobytes())
    return h.hexdigest()


def all_equal(params):
    hashes = dp_comm.allgather_obj(digest(params))
    return all(h == hashes[0] for h in hashes)


def chunk_sizes(n):
    return [len(c) for c in np.array_split(np.empty(n), P)]


def check_traffic(name, args, dp):
    """The counted bytes of one step against the formula (stats were reset before the step)."""
    s = dp_comm.stats
    nbytes = dp.flat.nbytes  # |theta| in bytes
    ops = set(s)
    if args.sync == "master":
        assert ops == {"Scatterv", "Reduce", "Bcast"}, (name, ops)
        assert s["Reduce"]["calls"] == s["Bcast"]["calls"] == 1 and s["Scatterv"]["calls"] == 2
        if r == 0:  # the root receives (P-1)|theta| and sends (P-1)|theta|
            assert (s["Reduce"]["recv"], s["Bcast"]["sent"]) == ((P - 1) * nbytes,) * 2
        else:  # each worker sends |theta| to the root and receives |theta| from it
            assert (s["Reduce"]["sent"], s["Bcast"]["recv"]) == (nbytes, nbytes), (name, dict(s))
    elif args.zero:
        assert ops == {"Reduce_scatter", "Allgather"}, (name, ops)
        padded = dp.opt.shard_size * P * 8
        assert s["Reduce_scatter"]["calls"] == s["Allgather"]["calls"] == 1
        assert s["Reduce_scatter"]["sent"] == padded and 0 <= padded - nbytes < 8 * P
    elif args.sync == "allreduce":
        assert ops == {"Allreduce"}, (name, ops)
        assert s["Allreduce"]["calls"] == len(dp.sync.buckets), (name, dict(s["Allreduce"]))
        assert s["Allreduce"]["sent"] == nbytes
    else:  # the hand-written ring, bucket by bucket
        assert ops <= {"Sendrecv"}, (name, ops)
        messages = sent = 0
        for b in dp.sync.buckets:
            c = chunk_sizes(b.flat.size)
            if P > 1:
                messages += 2 * (P - 1)
                sent += 8 * (2 * b.flat.size - c[(r + 1) % P] - c[(r + 2) % P])
        assert s["Sendrecv"]["messages"] == messages, (name, dict(s["Sendrecv"]))
        assert s["Sendrecv"]["sent"] == sent, (name, dict(s["Sendrecv"]), sent)
    if args.bucket_mb is not None:
        assert len(dp.sync.buckets) > 1, name
        # every parameter in exactly one bucket, in reverse parameter order
        order = [id(p) for b in dp.sync.buckets for p in b.params]
        assert order == [id(p) for p in reversed(dp.params)], name
    if args.overlap:  # the first bucket went out while backward still had gradients to make
        log = dp.sync.launch_log
        assert len(log) == len(dp.sync.buckets) and log == sorted(log), log
        assert 0 < log[0] < len(dp.params), (name, log)
        filled = np.cumsum([len(b.params) for b in dp.sync.buckets])
        assert all(np.array(log) >= filled) and log[-1] == len(dp.params), (name, log)


references = {}
n_checked = 0
for model_name, model_args in MODELS.items():
    task = None
    for mode, mode_args in MODES.items():
        name = f"{model_name} / {mode} / P={P}"
        args = parse_args("data_parallel", model_args + mode_args + COMMON, P)
        if task is None:  # the data depends on the model flags only: load it once per model
            task = serial.Task(args)
        task.args = args

        # workers build their model from another seed: only the first Bcast can fix that
        model = task.build_model().init(args.seed + 1000 * r)
        hashes = dp_comm.allgather_obj(digest(model.parameters()))
        assert all(h != hashes[0] for h in hashes[1:]), name
        dp = trainer_class("data_parallel", args)(task, grid, args, model=model)
        assert all_equal(dp.params), f"{name}: replicas differ after the first Bcast"

        losses = []
        for step in range(STEPS):
            dp_comm.reset_stats()
            losses.append(dp.step(step))
            check_traffic(name, args, dp)
            assert all_equal(dp.params), f"{name}: replicas differ after step {step}"

        key = (model_name, args.optim)
        if r == 0 and key not in references:
            references[key] = serial_run(task, STEPS)
        if r == 0:
            ref_losses, ref_params, ref_opt = references[key]
            np.testing.assert_allclose(losses, ref_losses, rtol=TOL, err_msg=name)
            for pname, p in model.named_parameters():
                want = ref_params[pname]
                err = np.linalg.norm(B.to_numpy(p.data) - want) / np.linalg.norm(want)
                assert err <= TOL, f"{name}: {pname} relative error {err:.2e}"
            if args.zero:  # optimizer state per rank: 1/P of the serial one (+ padding)
                pad = dp.opt.shard_size * P - dp.n
                assert dp.optimizer_state_bytes() * P == ref_opt.state_bytes() + 2 * 8 * pad
        n_checked += 1

# -- the hand-written ring on its own
# integer values: every order of summation is exact, so it must equal MPI's Allreduce bit for bit
n = 12 * 5  # divisible by P = 1..4
buf = (r + 1.0) * np.arange(n) + r
want = buf.copy()
dp_comm.Allreduce(want)
dp_comm.reset_stats()
DP.ring_allreduce(dp_comm, buf)
assert np.array_equal(buf, want)
assert dp_comm.stats["Sendrecv"]["messages"] == 2 * (P - 1)
assert dp_comm.stats["Sendrecv"]["sent"] == 2 * (P - 1) * 8 * n // P  # 2(P-1)/P |theta|
# an uneven length (and one shorter than P): random values, close to MPI's, identical on all
for n in (61, 3):
    buf = np.random.default_rng([7, r]).standard_normal(n)
    want = buf.copy()
    dp_comm.Allreduce(want)
    dp_comm.reset_stats()
    DP.ring_allreduce(dp_comm, buf)
    np.testing.assert_allclose(buf, want, rtol=1e-13, atol=1e-15)
    assert len(set(dp_comm.allgather_obj(buf.tobytes()))) == 1
    assert abs(dp_comm.stats["Sendrecv"]["sent"] - 2 * (P - 1) / P * 8 * n) < 2 * 8

dp_comm.Barrier()
if r == 0:
    print(f"dp checks passed on {P} ranks ({n_checked} configurations)", flush=True)
